"""The dense baselines every ratio is measured against, with the fastest backward we know.

Legend: M rows, K contraction dim, N output dim, D model dim, F hidden dim.

Autodiff of `jnp.dot(a, b, preferred_element_type=f32).astype(bf16)` hands the transposed dots
an f32 cotangent, so XLA upcasts the bf16 operand and runs the backward at f32 speed (measured
here: dense bf16 backward ~5x its forward). The grouped kernels run their backward on bf16
operands with f32 accumulation, so the fair dense baseline does the same: `matmul` below has a
hand-written VJP of three dots on the input dtype (for 16-bit inputs the weight gradient runs as
row tiles of a^T, the trick the grouped kernel uses). In f32 it is exactly what autodiff does.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from dropless.moe import ffn


@jax.custom_vjp
def matmul(a_MK: jax.Array, b_KN: jax.Array) -> jax.Array:
    """a @ b accumulated in f32, returned in a's dtype."""
    return jnp.dot(a_MK, b_KN, preferred_element_type=jnp.float32).astype(a_MK.dtype)


def _matmul_fwd(a_MK, b_KN):
    return matmul(a_MK, b_KN), (a_MK, b_KN)


def _transposed_tiles_drhs(a_MK, dy_MN, rows=1024):
    """a^T @ dy as a sum over row tiles of (a^T)[:, tile] @ dy[tile], a^T transposed once as bits.

    XLA:CPU runs a 16-bit dot contracting both operands' leading dim at about half speed;
    these plain [K, B] @ [B, N] tiles do not (8192x1024 bf16: 93 -> 48 ms on the 2-core Xeon).
    The grouped kernel uses the same trick, so the dense baseline must too.
    """
    from dropless.ops.gmm.tiled import as_bits, from_bits
    m = a_MK.shape[0]
    if m % rows:
        return lax.dot_general(a_MK, dy_MN, (((0,), (0,)), ((), ())),
                               preferred_element_type=jnp.float32)
    # behind a barrier, as the grouped kernel's (tiled._drhs says why)
    aT_bits, dy_bits = lax.optimization_barrier(as_bits(a_MK).T), as_bits(dy_MN)

    def body(t, acc_KN):
        aT_KB = from_bits(lax.dynamic_slice_in_dim(aT_bits, t * rows, rows, 1), a_MK.dtype)
        dy_BN = from_bits(lax.dynamic_slice_in_dim(dy_bits, t * rows, rows, 0), dy_MN.dtype)
        return acc_KN + jnp.dot(aT_KB, dy_BN, preferred_element_type=jnp.float32)
    return lax.fori_loop(0, m // rows, body,
                         jnp.zeros((a_MK.shape[1], dy_MN.shape[1]), jnp.float32))


def _matmul_bwd(res, dy_MN):
    a_MK, b_KN = res
    dy_MN = dy_MN.astype(a_MK.dtype)
    da_MK = lax.dot_general(dy_MN, b_KN, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32).astype(a_MK.dtype)
    if a_MK.dtype.itemsize == 2:
        db_KN = _transposed_tiles_drhs(a_MK, dy_MN)
    else:
        db_KN = lax.dot_general(a_MK, dy_MN, (((0,), (0,)), ((), ())),
                                preferred_element_type=jnp.float32)
    return da_MK, db_KN.astype(b_KN.dtype)


matmul.defvjp(_matmul_fwd, _matmul_bwd)


def swiglu(x_MD, w_gate_DF, w_up_DF, w_down_FD):
    """down(silu(x @ gate) * (x @ up)), with the same casts as the MoE layer's expert FFN."""
    gate_MF = matmul(x_MD, w_gate_DF)
    up_MF = matmul(x_MD, w_up_DF)
    h_MF = ffn.swiglu(gate_MF, up_MF, x_MD.dtype)
    return matmul(h_MF, w_down_FD)


def fwd_and_fwd_bwd(fn):
    """(forward, forward+backward) of fn(*args) -> out; the latter takes the cotangent last and
    returns (out, grads), so the forward is part of what is timed (never dead code)."""
    def fwd_bwd(*args):
        *primals, dy = args
        out, vjp = jax.vjp(fn, *primals)
        return out, vjp(dy)
    return fn, fwd_bwd


def split_floor(groups: int):
    """(forward, forward+backward) of the grouped problem's dot shapes with nothing ragged.

    The M rows cut into `groups` equal chunks, one XLA dot per chunk, all against ONE weight
    (so it stays in cache: no per-group weight is ever fetched or copied); drhs writes one
    [K, N] result per chunk, as a grouped drhs must. It is what any kernel that issues one
    XLA:CPU dot per group cannot beat on uniform routing: the cost of the shapes alone.
    """
    from dropless.ops.gmm.tiled import as_bits, slice_bits, from_bits  # the kernel's own slicing

    def loop(a_MK, b, dims):
        m, g = a_MK.shape[0], groups
        c = m // g
        n = b.shape[1] if dims == (1, 0) else b.shape[0]
        a_bits = as_bits(a_MK)

        def body(t, out_bits):
            y = lax.dot_general(slice_bits(a_bits, t * c, c, a_MK.dtype), b, ((dims[:1], dims[1:]),
                                ((), ())), preferred_element_type=jnp.float32)
            return lax.dynamic_update_slice_in_dim(out_bits, as_bits(y.astype(a_MK.dtype)),
                                                   t * c, 0)
        return from_bits(lax.fori_loop(0, g, body, as_bits(jnp.zeros((m, n), a_MK.dtype))),
                       a_MK.dtype)

    def fwd(a_MK, b_KN):
        return loop(a_MK, b_KN, (1, 0))

    def fwd_bwd(a_MK, b_KN, dy_MN):
        c = a_MK.shape[0] // groups
        a_bits, dy_bits = as_bits(a_MK), as_bits(dy_MN)

        # 16-bit: plain [K, c] @ [c, N] tiles behind a barrier, as the kernel's drhs does
        aT_bits = lax.optimization_barrier(a_bits.T)

        def drhs(_, t):
            dy_cN = slice_bits(dy_bits, t * c, c, dy_MN.dtype)
            if a_MK.dtype.itemsize == 2:
                aT_Kc = from_bits(lax.dynamic_slice_in_dim(aT_bits, t * c, c, 1), a_MK.dtype)
                dw = jnp.dot(aT_Kc, dy_cN, preferred_element_type=jnp.float32)
            else:
                dw = lax.dot_general(slice_bits(a_bits, t * c, c, a_MK.dtype), dy_cN,
                                     (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
            return None, as_bits(dw.astype(b_KN.dtype))
        db = lax.scan(drhs, None, jnp.arange(groups, dtype=jnp.int32))[1]
        return fwd(a_MK, b_KN), (loop(dy_MN, b_KN, (1, 1)), from_bits(db, b_KN.dtype))
    return fwd, fwd_bwd
