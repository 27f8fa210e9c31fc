"""Grouped matmul: one call for all experts, each over its real row count."""
from dropless.ops.gmm.baselines import (loop_gmm, padded_gmm, padding_stats, ragged_dot_gmm,
                                        reference_gmm)
from dropless.ops.gmm.registry import (backend_spec, grouped_matmul, grouped_matmul_backends,
                                       register_backend, resolve_backend, tokamax_unusable)
from dropless.ops.native import native_gmm, problem as native_problem
from dropless.ops.gpu.pallas_gpu import OPTIONS as PALLAS_GPU_OPTIONS, pallas_gpu_gmm
from dropless.ops.gpu.pallas_plan import ALIGNED_ROW_BLOCK
from dropless.ops.gmm.tiled import DEFAULT_TILE_SIZES, tiled_gmm
from dropless.ops.gpu.tokamax_backend import tokamax_gmm
from dropless.ops.gpu.mosaic_gpu import (OPTIONS as MOSAIC_GPU_OPTIONS, mosaic_gpu_gmm,
                                         mosaic_problem)
from dropless.ops.gpu.cudnn_ragged import cudnn_ragged_gmm, problem as cudnn_problem

register_backend("reference", reference_gmm,
                 description="per-group masked loop, G x the work; obviously correct (tests)")
register_backend("ragged_dot", ragged_dot_gmm,
                 description="jax.lax.ragged_dot (XLA): a grouped kernel on TPU; on CUDA a "
                             "zero-padded dense product (G x the FLOPs), by name only")
register_backend("tiled", tiled_gmm, options=("tile_sizes",),
                 description="pure-JAX row tiles per group with hand-written VJP; CPU default")
register_backend("native", native_gmm, problem=native_problem,
                 description="the native CPU library (ops/native): one GEMM per group through "
                             "XLA's FFI, rows in place, OpenBLAS's sgemm or, on AVX-512, the "
                             "library's own tiled kernel (float32; other dtypes run tiled); CPU "
                             "default when it builds (old name: openblas)")
register_backend("pallas_gpu", pallas_gpu_gmm, options=PALLAS_GPU_OPTIONS,
                 description="our Pallas kernels via Triton (fwd, dlhs, drhs), sizes on device; "
                             "CUDA; interpret mode on CPU (slow, for tests)",
                 aligned=True, row_block=ALIGNED_ROW_BLOCK)
register_backend("tokamax", tokamax_gmm, options=("implementation",), problem=tokamax_unusable,
                 description="tokamax.ragged_dot (Mosaic GPU SM90/SM100, Triton); optional "
                             "dependency, the `gpu` extra")
register_backend("mosaic_gpu", mosaic_gpu_gmm, options=MOSAIC_GPU_OPTIONS, problem=mosaic_problem,
                 description="jax's own Mosaic GPU kernels for Hopper (ragged_dot_mgpu: fwd, dlhs; "
                             "drhs ours or, with drhs='mosaic', transposed_ragged_dot_mgpu); "
                             "bf16/f16, sm_90a; other operands run pallas_gpu")
register_backend("cudnn_ragged_dot", cudnn_ragged_gmm, problem=cudnn_problem,
                 description="jax.lax.ragged_dot as XLA's cuDNN grouped GEMM; usable only where "
                             "cuDNN >= 9.22 is loaded and XLA_FLAGS enables the fusion "
                             "(ops/gpu/cudnn_ragged.py detects both)")
register_backend("padded", padded_gmm, options=("capacity",),
                 description="pad each group to a capacity, one batched GEMM (naive baseline)")
register_backend("loop", loop_gmm, jittable=False,
                 description="host loop over groups, sizes copied to host (naive baseline)")

__all__ = ["grouped_matmul", "grouped_matmul_backends", "register_backend", "resolve_backend",
           "backend_spec", "padding_stats", "DEFAULT_TILE_SIZES"]
