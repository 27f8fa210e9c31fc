"""Array operations: the grouped matmul, its registry and backends (`ops.gmm`; the GPU kernels
in `ops.gpu`, the native CPU library in `ops.native`), and what each platform offers the MoE
layer beyond it, asked for by capability (`ops.kernels`).

The names below are imported when first used (PEP 562), so that the configs can check a
backend name (`ops.gmm.names`) without loading the backends, and with them JAX.
"""
from __future__ import annotations

import typing

from dropless.runtime.lazy_names import lazy_names

if typing.TYPE_CHECKING:
    from dropless.ops.gmm import (backend_spec, grouped_matmul, grouped_matmul_backends,
                                  padding_stats, register_backend, resolve_backend)

# each name -> the module it comes from: ops.gmm's own names (its `_HOME` says where each lives)
_HOME = {name: "dropless.ops.gmm" for name in (
    "grouped_matmul", "grouped_matmul_backends", "register_backend", "resolve_backend",
    "backend_spec", "padding_stats")}
__all__ = list(_HOME)

__getattr__, __dir__ = lazy_names(__name__, _HOME, globals())
