"""The SwiGLU expert FFN down(silu(x @ gate) * (x @ up)) on the native library, float32, with its
elementwise steps done by the row task that produced them, while its rows are in cache
(csrc/swiglu.cc: three handlers beside the grouped GEMM's):
  gate_up_swiglu  g = x @ w_gate[e], u = x @ w_up[e], h = silu(g) * u          (forward)
  swiglu_dlhs     dh = dy @ w_down[e]^T, dg = dh * u * silu'(g), du = dh * silu(g)
  dual_dlhs       dx = dg @ w_gate[e]^T + du @ w_up[e]^T
The down projection and the three weight gradients are the grouped GEMM's (gemm.py). The MoE
layer runs it for float32 on CPU where the grouped matmuls would all run the `native` backend.
For bfloat16 rows the FFN stays three grouped matmuls and only the activation is native
(`swiglu_bf16`, csrc/swiglu_bf16.cc: one pass forward, one backward, in float32, rounded once).

Legend: N routed rows (expert-major), D model dim, F expert hidden dim, E experts.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dropless.ops.native.load import require
from dropless.ops.native.cpu_only import on_cpu_only
from dropless.ops.native.gemm import CPU_ONLY, gmm_drhs, gmm_forward


def _call_many(target, out_shapes, *args):
    f32 = jnp.float32
    return jax.ffi.ffi_call(target, tuple(jax.ShapeDtypeStruct(s, f32) for s in out_shapes),
                            vmap_method="sequential")(*args)


def gate_up_swiglu(x_ND, w_gate_EDF, w_up_EDF, group_sizes_E):
    """(g, u, h) [N, F] float32: g = x @ w_gate[e], u = x @ w_up[e] on expert e's rows,
    h = silu(g) * u, in one pass (rows past the groups: 0)."""
    require()
    shape = (x_ND.shape[0], w_gate_EDF.shape[2])
    return _call_many("dropless_gate_up_swiglu_f32", (shape,) * 3, x_ND, w_gate_EDF, w_up_EDF,
                      group_sizes_E.astype(jnp.int32))


def swiglu_dlhs(dy_ND, w_down_EFD, g_NF, u_NF, group_sizes_E):
    """(dg, du) [N, F] float32, the gradients of g and u through h = silu(g) * u and the down
    projection: dh = dy @ w_down[e]^T, dg = dh * u * silu'(g), du = dh * silu(g)."""
    require()
    return _call_many("dropless_swiglu_dlhs_f32", (g_NF.shape,) * 2, dy_ND, w_down_EFD, g_NF,
                      u_NF, group_sizes_E.astype(jnp.int32))


def dual_dlhs(dg_NF, w_gate_EDF, du_NF, w_up_EDF, group_sizes_E):
    """dg @ w_gate[e]^T + du @ w_up[e]^T -> [N, D] float32: x's gradient through gate and up."""
    require()
    return _call_many("dropless_dual_dlhs_f32", ((dg_NF.shape[0], w_gate_EDF.shape[1]),), dg_NF,
                      w_gate_EDF, du_NF, w_up_EDF, group_sizes_E.astype(jnp.int32))[0]


@jax.custom_vjp
def swiglu_ffn(x_ND, w_gate_EDF, w_up_EDF, w_down_EFD, group_sizes_E):
    """down(silu(x @ gate) * (x @ up)) per expert over expert-major rows -> [N, D] float32, with
    the elementwise steps fused into the products (the layer's `expert_ffn` on this backend).
    Raises RuntimeError when the library cannot be built."""
    return _swiglu_ffn_fwd(x_ND, w_gate_EDF, w_up_EDF, w_down_EFD, group_sizes_E)[0]


def _swiglu_ffn_fwd(x_ND, w_gate_EDF, w_up_EDF, w_down_EFD, group_sizes_E):
    g_NF, u_NF, h_NF = gate_up_swiglu(x_ND, w_gate_EDF, w_up_EDF, group_sizes_E)
    y_ND = gmm_forward(h_NF, w_down_EFD, group_sizes_E)
    return y_ND, (x_ND, w_gate_EDF, w_up_EDF, w_down_EFD, group_sizes_E, g_NF, u_NF, h_NF)


def _swiglu_ffn_bwd(res, dy_ND):
    x_ND, w_g, w_u, w_d, gs, g_NF, u_NF, h_NF = res
    dy_ND = dy_ND.astype(jnp.float32)
    dg_NF, du_NF = swiglu_dlhs(dy_ND, w_d, g_NF, u_NF, gs)
    return (dual_dlhs(dg_NF, w_g, du_NF, w_u, gs), gmm_drhs(x_ND, dg_NF, gs),
            gmm_drhs(x_ND, du_NF, gs), gmm_drhs(h_NF, dy_ND, gs), None)


swiglu_ffn.defvjp(_swiglu_ffn_fwd, _swiglu_ffn_bwd)
# the layer's fused FFN where the backend is asked for by name: refused in one line when lowered
# for another platform, as the grouped matmul is
swiglu_ffn_on_cpu = on_cpu_only(swiglu_ffn, CPU_ONLY)


def _swiglu_bf16(g_NF, u_NF):
    out = jax.ShapeDtypeStruct(g_NF.shape, jnp.bfloat16)
    return jax.ffi.ffi_call("dropless_swiglu_bf16", out, vmap_method="sequential")(g_NF, u_NF)


@jax.custom_vjp
def swiglu_bf16(g_NF, u_NF):
    """silu(g) * u -> [N, F] bfloat16, from bfloat16 g and u, computed in float32 and rounded
    once (moe/ffn.py's `swiglu` on bf16 rows). Raises RuntimeError when the library cannot be
    built."""
    require()
    return _swiglu_bf16(g_NF, u_NF)


def _swiglu_bf16_fwd(g_NF, u_NF):
    return swiglu_bf16(g_NF, u_NF), (g_NF, u_NF)


def _swiglu_bf16_bwd(res, dh_NF):
    g_NF, u_NF = res
    out = jax.ShapeDtypeStruct(g_NF.shape, jnp.bfloat16)
    return tuple(jax.ffi.ffi_call("dropless_swiglu_bwd_bf16", (out, out),
                                  vmap_method="sequential")(
        dh_NF.astype(jnp.bfloat16), g_NF, u_NF))


swiglu_bf16.defvjp(_swiglu_bf16_fwd, _swiglu_bf16_bwd)
swiglu_bf16_on_cpu = on_cpu_only(swiglu_bf16, CPU_ONLY)
