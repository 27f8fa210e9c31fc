"""Compile-only H100/H200 devices for tests (`dropless.train.compile_only` makes them: the jax
CUDA plugin and a target description of the GPU), and the rule for a test that needs them:
`require_plugin()` skips it where the plugin is absent, except in the GPU leg of CI
(DROPLESS_GPU_LEG=required, set by .ci/jax_leg, which installs the plugin), where its absence is
a failure: a leg that skips its compiles proves nothing. The process must run with
JAX_PLATFORMS=cpu (tests/conftest.py sets it).
"""
from __future__ import annotations

import os

import pytest

from dropless.train.compile_only import MEMORY_BYTES, TARGETS, devices, unavailable

__all__ = ["MEMORY_BYTES", "TARGETS", "devices", "require_plugin"]


def require_plugin() -> None:
    """Skip the calling test (or module, at import) without the jax CUDA plugin; in the GPU leg
    (DROPLESS_GPU_LEG=required) fail instead."""
    why = unavailable()
    if not why:
        return
    if os.environ.get("DROPLESS_GPU_LEG") == "required":
        pytest.fail(f"the GPU leg needs the jax CUDA plugin: {why}")
    pytest.skip(f"needs the jax CUDA plugin (compile only): {why}", allow_module_level=True)
