"""The native CPU library: grouped GEMMs (the `native` grouped-matmul backend), the fused SwiGLU
expert FFN, and the MoE layer's row movement (gathers, the sort by expert, top-k), one C++
library behind XLA's FFI, float32 (and bfloat16: the grouped GEMM on AMX tiles, SwiGLU's
activation), registered for the CPU.

The GEMM that runs for each group is the library's own register-tiled kernel, OpenBLAS's sgemm
(the `scipy-openblas32` wheel) or MKL's (the `mkl` wheel, where installed), whichever this CPU's
calibration measured fastest for that form of product (DROPLESS_NATIVE_KERNEL=own|openblas|mkl
forces one). Each product is cut into tasks the
library runs on its own workers.

  load      build csrc/*.cc into one library for this CPU (cached; DROPLESS_NATIVE_ISA: the
            AVX2 or SSE build), load it; `problem()`
  calibrate the machine-dependent choices (kernel per form, B panels packed, streaming stores)
            timed on this CPU when the library first loads, cached per CPU and build
  choice    which GEMM kernel runs (DROPLESS_NATIVE_KERNEL, `use_kernel`) and what ran
  gemm      the grouped matmul and its gradients (`native_gmm`, the registry's backend)
  ffn       the fused SwiGLU expert FFN (`swiglu_ffn`), and SwiGLU's activation on bf16 rows
            (`swiglu_bf16`)
  rows      gather_rows, gather_sum, row_dots, sort_by_expert, top_k_indices
  cpu_only  a CPU-only kernel refused in one line where it is lowered for another platform
"""
from dropless.ops.native.load import (GEMM_HANDLERS, HANDLERS, HEADERS, ISA_ENV, ISA_FLAGS,
                                      KERNEL_CHOICES, KERNEL_ENV, NATIVE, ROW_HANDLERS, SOURCES,
                                      TARGET, amx_ready, build, cache_dir, calibration,
                                      mkl_version, problem)
from dropless.ops.native.choice import (chunk_rows, core, describe, gemm_calls, kernel,
                                        stream_min_bytes, use_kernel)
from dropless.ops.native.cpu_only import on_cpu_only
from dropless.ops.native.ffn import (dual_dlhs, gate_up_swiglu, swiglu_bf16,
                                     swiglu_bf16_on_cpu, swiglu_dlhs, swiglu_ffn,
                                     swiglu_ffn_on_cpu)
from dropless.ops.native.gemm import (CPU_ONLY, MODES, gmm_dlhs, gmm_drhs, gmm_forward,
                                      native_gmm, supports)
from dropless.ops.native.rows import (gather_rows, gather_sum, row_dots, sort_by_expert,
                                      top_k_indices)

__all__ = ["CPU_ONLY", "GEMM_HANDLERS", "HANDLERS", "HEADERS", "ISA_ENV", "ISA_FLAGS",
           "KERNEL_CHOICES", "KERNEL_ENV",
           "MODES", "NATIVE", "ROW_HANDLERS", "SOURCES", "TARGET", "amx_ready", "build",
           "cache_dir",
           "calibration",
           "chunk_rows", "core", "describe", "dual_dlhs", "gate_up_swiglu", "gather_rows",
           "gather_sum", "gemm_calls", "gmm_dlhs", "gmm_drhs", "gmm_forward", "kernel",
           "mkl_version", "native_gmm", "on_cpu_only", "problem", "row_dots", "sort_by_expert",
           "stream_min_bytes", "supports", "swiglu_bf16", "swiglu_bf16_on_cpu", "swiglu_dlhs",
           "swiglu_ffn", "swiglu_ffn_on_cpu",
           "top_k_indices", "use_kernel"]
