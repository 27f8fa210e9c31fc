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
    from dropless.ops.gmm.baselines import padding_stats
    from dropless.ops.gmm.registry import (backend_spec, grouped_matmul,
                                           grouped_matmul_backends, register_backend,
                                           resolve_backend)

# each name -> the module it comes from
_HOME = {"grouped_matmul": "dropless.ops.gmm.registry",
         "grouped_matmul_backends": "dropless.ops.gmm.registry",
         "register_backend": "dropless.ops.gmm.registry",
         "resolve_backend": "dropless.ops.gmm.registry",
         "backend_spec": "dropless.ops.gmm.registry",
         "padding_stats": "dropless.ops.gmm.baselines"}
__all__ = list(_HOME)

__getattr__, __dir__ = lazy_names(__name__, _HOME, globals())
