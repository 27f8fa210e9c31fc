"""The grouped-matmul backends' names, without JAX: the built-in ones (`BACKENDS`) and the check
of a name (`check_backend_name`) that the registry and the configs share.

The configs check a backend name when they are built, and `dropless config show` builds them
without importing JAX, so the check cannot load the registry: that imports every backend. The
registry registers exactly `BACKENDS` when it loads (it refuses to load otherwise), so until it
is loaded they are all the backends there are; once it is, its list is read instead, which holds
the backends registered since (`register_backend`, a test's `stand_in`) too.
"""
from __future__ import annotations

import sys

from dropless.ops.gmm.aliases import ALIASES

# the built-in backends, in the order the registry registers (and lists) them
BACKENDS = ("reference", "ragged_dot", "tiled", "native", "pallas_gpu", "tokamax", "mosaic_gpu",
            "cudnn_ragged_dot", "padded", "loop")
REGISTRY = "dropless.ops.gmm.registry"   # the module that reads the list it keeps, when loaded


def known_backends() -> tuple[str, ...]:
    """The names `grouped_matmul(backend=...)` takes, `auto` first: the registry's
    `grouped_matmul_backends()` when it is loaded, else `auto` and `BACKENDS`."""
    registry = sys.modules.get(REGISTRY)
    if registry is None:
        return ("auto",) + BACKENDS
    return registry.grouped_matmul_backends()


def check_backend_name(name: str, where: str = "backend") -> None:
    """Raise ValueError naming `where`, the value and the known backends if `name` is not one
    of `known_backends()` (an old name, `aliases.ALIASES`, is known)."""
    known = known_backends()
    if ALIASES.get(name, name) not in known:
        raise ValueError(f"{where}={name!r} is not a grouped-matmul backend; "
                         f"known: {', '.join(known)}")
