"""Array operations: the grouped matmul and its backends."""
from dropless.ops.gmm import (backend_spec, grouped_matmul, grouped_matmul_backends,
                              padding_stats, register_backend, resolve_backend)

__all__ = ["grouped_matmul", "grouped_matmul_backends", "register_backend", "resolve_backend",
           "backend_spec", "padding_stats"]
