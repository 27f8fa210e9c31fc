"""The grouped matmul on the native library (the registry's `native` backend), with the backward
written out: one GEMM per group, on pointers into the operands, the transposes done by flags
(float32: csrc/grouped_gemm.cc; bfloat16 on AMX tiles: csrc/amx_gemm.cc):
  forward  out[rows of g] = lhs[rows of g] @ rhs[g]
  dlhs     dlhs[rows of g] = dy[rows of g] @ rhs[g]^T
  drhs     drhs[g] = lhs[rows of g]^T @ dy[rows of g]        (one GEMM, contraction = the rows)
Rows past the last group, and an empty group's weight gradient, are written as zeros without a
product, so a NaN stays in its own rows and group (the registry's rule for every backend).

Legend: M rows (sorted by group), K contraction dim, N output dim, G groups.

Why: XLA:CPU runs every dot of a `tiled` kernel through a fusion that copies the tile's rows,
the group's weights and the result; here nothing is copied but what the kernel packs itself.
bfloat16 operands with a bfloat16 output run the AMX kernel where `load.amx_ready()` (products
accumulated in float32, each output rounded once; its gradients bfloat16 as the operands are);
other operands (f16, mixed, bf16 without AMX, another output dtype) run `tiled`. The kernel is
registered for the CPU only: `backend="native"` in a function lowered for another platform
raises one line saying so (`CPU_ONLY`, cpu_only.py); `auto` lowers its CPU branch only for the
CPU.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dropless.ops.gmm.tiled import tiled_gmm
from dropless.ops.native.load import BF16_TARGET, TARGET, amx_ready, require
from dropless.ops.native.cpu_only import on_cpu_only

# what `backend="native"` (the grouped matmul, and the layer's fused FFN) raises when lowered
# for another platform (`cpu_only.on_cpu_only`)
CPU_ONLY = ("grouped_matmul backend 'native' runs on CPU only (a jax.ffi kernel registered "
            "for the CPU) and this function is lowered for {platform}: use backend='auto' or "
            "'tiled'")
MODES = {"forward": 0, "dlhs": 1, "drhs": 2}


def _call(mode: str, a, b, group_sizes_G, out_shape):
    # float32 operands: the float32 kernel; bfloat16: the AMX kernel, its output as the operands
    dtype = jnp.dtype(a.dtype)
    target = TARGET if dtype == jnp.float32 else BF16_TARGET
    return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(out_shape, dtype),
                            vmap_method="sequential")(
        a, b, group_sizes_G.astype(jnp.int32), mode=np.int32(MODES[mode]))


def gmm_forward(lhs_MK, rhs_GKN, group_sizes_G):
    """out[rows of g] = lhs[rows of g] @ rhs[g] -> [M, N] in the operands' dtype (float32, or
    bfloat16 on AMX), rows past the groups 0."""
    require()
    return _call("forward", lhs_MK, rhs_GKN, group_sizes_G, (lhs_MK.shape[0], rhs_GKN.shape[2]))


def gmm_dlhs(dy_MN, rhs_GKN, group_sizes_G):
    """dy[rows of g] @ rhs[g]^T -> [M, K]: the lhs gradient."""
    require()
    return _call("dlhs", dy_MN, rhs_GKN, group_sizes_G, (dy_MN.shape[0], rhs_GKN.shape[1]))


def gmm_drhs(lhs_MK, dy_MN, group_sizes_G):
    """lhs[rows of g]^T @ dy[rows of g] -> [G, K, N]: the rhs gradient (0 for an empty
    group)."""
    require()
    return _call("drhs", lhs_MK, dy_MN, group_sizes_G,
                 (group_sizes_G.shape[0], lhs_MK.shape[1], dy_MN.shape[1]))


@jax.custom_vjp
def _gmm(lhs_MK, rhs_GKN, group_sizes_G):
    return gmm_forward(lhs_MK, rhs_GKN, group_sizes_G)


def _gmm_fwd(lhs_MK, rhs_GKN, group_sizes_G):
    return gmm_forward(lhs_MK, rhs_GKN, group_sizes_G), (lhs_MK, rhs_GKN, group_sizes_G)


def _gmm_bwd(res, dy_MN):
    lhs_MK, rhs_GKN, group_sizes_G = res
    dy_MN = dy_MN.astype(lhs_MK.dtype)
    return (gmm_dlhs(dy_MN, rhs_GKN, group_sizes_G), gmm_drhs(lhs_MK, dy_MN, group_sizes_G),
            None)


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def supports(lhs_MK, rhs_GKN, out_dtype) -> bool:
    """Whether a native kernel takes these operands: float32 in and out, or bfloat16 in and out
    where the AMX kernel runs (`load.amx_ready`); others run tiled."""
    dtypes = {jnp.dtype(lhs_MK.dtype), jnp.dtype(rhs_GKN.dtype), jnp.dtype(out_dtype)}
    if dtypes == {jnp.dtype(jnp.float32)}:
        return True
    return dtypes == {jnp.dtype(jnp.bfloat16)} and amx_ready()


# the kernel is registered for the CPU only: asked for by name elsewhere, say so when lowering
# (auto's CPU branch is not lowered for another platform, so auto is never refused)
_gmm_on_cpu = on_cpu_only(_gmm, CPU_ONLY)


def native_gmm(lhs_MK, rhs_GKN, group_sizes_G, *, out_dtype):
    """Grouped matmul by one GEMM per group on the native library: float32 on the tiled kernel in
    AVX-512 builds, OpenBLAS's sgemm elsewhere (choice.py); bfloat16 on AMX tiles where the CPU
    has them; other dtypes run `tiled`. Shapes are checked by the caller. Raises RuntimeError
    when the library cannot be built, and ValueError (naming the platform) when the native
    kernel is lowered for a platform other than the CPU."""
    if not supports(lhs_MK, rhs_GKN, out_dtype):
        return tiled_gmm(lhs_MK, rhs_GKN, group_sizes_G, out_dtype=out_dtype)
    return _gmm_on_cpu(lhs_MK, rhs_GKN, group_sizes_G)
