"""Compile-only H100/H200 devices for tests (`dropless.train.compile_only` makes them: the jax
CUDA plugin and a target description of the GPU), and the rule for a test that needs them:
`require_plugin()` skips it where the plugin is absent, except in the GPU leg of CI
(DROPLESS_GPU_LEG=required, set by .ci/jax_leg, which installs the plugin), where its absence is
a failure: a leg that skips its compiles proves nothing. The process must run with
JAX_PLATFORMS=cpu (tests/conftest.py sets it). `compiled_once()`: a module's pre-flight compiles
of the same step shared (a compile of a whole model takes up to a minute here).
"""
from __future__ import annotations

import contextlib
import os

import pytest

from dropless.train.compile_only import MEMORY_BYTES, TARGETS, devices, unavailable

__all__ = ["MEMORY_BYTES", "TARGETS", "compiled_once", "devices", "require_plugin"]


def require_plugin() -> None:
    """Skip the calling test (or module, at import) without the jax CUDA plugin; in the GPU leg
    (DROPLESS_GPU_LEG=required) fail instead."""
    why = unavailable()
    if not why:
        return
    if os.environ.get("DROPLESS_GPU_LEG") == "required":
        pytest.fail(f"the GPU leg needs the jax CUDA plugin: {why}")
    pytest.skip(f"needs the jax CUDA plugin (compile only): {why}", allow_module_level=True)


@contextlib.contextmanager
def compiled_once():
    """Within the block, `train.preflight.compiled` compiles each (TrainConfig, device kind) once:
    a later call with an equal config gets the first call's figures and, through its
    `on_compiled`, the first call's executable. A config that differs (a CLI that built another
    run than the test's own) compiles anew, so figures compared across the two still differ."""
    from dropless.train import preflight
    real, done = preflight.compiled, {}

    def once(cfg, device, *, on_compiled=None):
        key = (cfg, device.device_kind)
        if key not in done:
            exes: list = []
            done[key] = (real(cfg, device, on_compiled=exes.append), exes)
        fit, exes = done[key]
        if on_compiled is not None:
            on_compiled(exes[0])
        return dict(fit)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(preflight, "compiled", once)
        yield done
