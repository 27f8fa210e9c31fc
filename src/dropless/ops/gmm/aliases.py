"""Old grouped-matmul backend names, still accepted, each mapped to its current name.

`openblas` is the native CPU library's backend under its first name: on AVX-512 machines the
GEMM that runs there is the library's own tiled kernel, so the backend is named `native` now.
Every place that takes a backend name (`grouped_matmul(backend=...)`, `MoEConfig.gmm_backend`,
the quantized configs, `auto_scope` refusals, `bench --backends`) maps an old name through
`canonical_backend`, which says so once per process.
"""
from __future__ import annotations

import warnings

ALIASES = {"openblas": "native"}   # old name -> current name
_WARNED: set[str] = set()          # the old names already reported in this process


def canonical_backend(name: str) -> str:
    """The current name of backend `name` (`name` itself unless it is an old one). An old name
    gives one DeprecationWarning per process, naming the new one."""
    new = ALIASES.get(name)
    if new is None:
        return name
    if name not in _WARNED:
        _WARNED.add(name)
        warnings.warn(f"grouped-matmul backend {name!r} is now called {new!r}; "
                      f"{name!r} still works for now", DeprecationWarning, stacklevel=3)
    return new
