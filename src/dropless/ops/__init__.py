"""Array operations: the grouped matmul, its registry and backends (`ops.gmm`; the GPU kernels
in `ops.gpu`, the native CPU library in `ops.native`), and what each platform offers the MoE
layer beyond it, asked for by capability (`ops.kernels`)."""
from dropless.ops.gmm import (backend_spec, grouped_matmul, grouped_matmul_backends,
                              padding_stats, register_backend, resolve_backend)

__all__ = ["grouped_matmul", "grouped_matmul_backends", "register_backend", "resolve_backend",
           "backend_spec", "padding_stats"]
