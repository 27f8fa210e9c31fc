"""Grouped matmul: one call for all experts, each over its real row count.

The names below are imported when first used (PEP 562), so that importing one module of the
package (`names`, which the configs check a backend name with) loads no backend and no JAX;
the registry registers the built-in backends when it loads (`registry.py`).
"""
from __future__ import annotations

import typing

from dropless.runtime.lazy_names import lazy_names

if typing.TYPE_CHECKING:
    from dropless.ops.gmm.baselines import padding_stats
    from dropless.ops.gmm.registry import (backend_spec, grouped_matmul,
                                           grouped_matmul_backends, register_backend,
                                           resolve_backend)
    from dropless.ops.gmm.tiled import DEFAULT_TILE_SIZES

# each name -> the module it comes from
_HOME = {"grouped_matmul": "dropless.ops.gmm.registry",
         "grouped_matmul_backends": "dropless.ops.gmm.registry",
         "register_backend": "dropless.ops.gmm.registry",
         "resolve_backend": "dropless.ops.gmm.registry",
         "backend_spec": "dropless.ops.gmm.registry",
         "padding_stats": "dropless.ops.gmm.baselines",
         "DEFAULT_TILE_SIZES": "dropless.ops.gmm.tiled"}
__all__ = list(_HOME)

__getattr__, __dir__ = lazy_names(__name__, _HOME, globals())
