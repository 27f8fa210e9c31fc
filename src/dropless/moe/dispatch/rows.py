"""Row exchange primitives shared by the fused dispatchers, each with its transpose as VJP.

Legend: T local tokens, D model dim, S row slots of one round's send buffer, R received rows,
Q entries (row, local expert, weight), N entries entering the grouped matmul.
Rows in the dispatch direction are an array or quant.mx_rows.MXRows (FP8 codes and scales,
moved leaf by leaf with `each`); everything on the way back is in the activation dtype.

`send_rows`/`return_rows` move rows to peers and back over one mesh axis (or a tuple of axes);
on the receiver `gather_rows`/`sum_rows` expand rows into entries and reduce them. Each pair is
the other's transpose and carries a custom VJP saying so, so the backward pass runs the same
fused exchange instead of autodiff's scatter-and-transpose. Code here runs inside the
dispatcher's shard_map, on local arrays.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from dropless.moe import permute as perm


def each(fn, rows, *args, **kwargs):
    """fn(array, *args, **kwargs) on `rows`: an array, or every array of quant.mx_rows.MXRows
    (codes and scales travel alike; a movement of whole rows needs nothing else)."""
    return jax.tree.map(lambda a: fn(a, *args, **kwargs), rows)


def exchange(x: jax.Array, axis: str) -> jax.Array:
    """Chunk p of dim 0 goes to peer p; the chunk from peer q lands at q. Self-transpose."""
    return lax.all_to_all(x, axis, 0, 0, tiled=True)


def pack(x_TD: jax.Array, src_S: jax.Array) -> jax.Array:
    return jnp.take(x_TD, src_S, axis=0, mode="fill", fill_value=0)


def unpack(y_SD: jax.Array, src_S: jax.Array, num_tokens: int) -> jax.Array:
    # each token fills at most one slot per peer; empty slots point past T and are dropped
    return jax.ops.segment_sum(y_SD, src_S, num_segments=num_tokens)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def send_rows(x_TD: jax.Array, src_S: jax.Array, axis: str) -> jax.Array:
    """Gather the rows named by src_S (T = empty slot) and exchange them: [S, D] received."""
    return exchange(pack(x_TD, src_S), axis)


def _send_fwd(x_TD, src_S, axis):
    return send_rows(x_TD, src_S, axis), (src_S, jnp.zeros((x_TD.shape[0], 0), x_TD.dtype))


def _send_bwd(axis, res, d_SD):
    src_S, shape_T0 = res
    d_TD = unpack(exchange(d_SD, axis), src_S, shape_T0.shape[0])
    return d_TD.astype(shape_T0.dtype), None


send_rows.defvjp(_send_fwd, _send_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def return_rows(y_SD: jax.Array, src_S: jax.Array, num_tokens: int, axis: str) -> jax.Array:
    """Send processed rows back to their owners and sum each token's rows: [T, D]."""
    return unpack(exchange(y_SD, axis), src_S, num_tokens)


def _return_fwd(y_SD, src_S, num_tokens, axis):
    return return_rows(y_SD, src_S, num_tokens, axis), (src_S,)


def _return_bwd(num_tokens, axis, res, d_TD):
    (src_S,) = res
    return exchange(pack(d_TD, src_S), axis), None


return_rows.defvjp(_return_fwd, _return_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def sum_rows(y_QD: jax.Array, idx_Q: jax.Array, num_rows: int) -> jax.Array:
    """out[i] = sum of y_QD[q] with idx_Q[q] == i (idx num_rows = dropped). Transpose of
    gather_rows."""
    return unpack(y_QD, idx_Q, num_rows)


def _sum_fwd(y_QD, idx_Q, num_rows):
    return sum_rows(y_QD, idx_Q, num_rows), (idx_Q,)


def _sum_bwd(num_rows, res, d_RD):
    return pack(d_RD, res[0]), None


sum_rows.defvjp(_sum_fwd, _sum_bwd)


@jax.custom_vjp
def gather_rows(x_RD: jax.Array, idx_Q: jax.Array) -> jax.Array:
    """out[q] = x_RD[idx_Q[q]] (zero where idx_Q = R). Transpose of sum_rows."""
    return pack(x_RD, idx_Q)


def _gather_fwd(x_RD, idx_Q):
    return gather_rows(x_RD, idx_Q), (idx_Q, jnp.zeros((x_RD.shape[0], 0), x_RD.dtype))


def _gather_bwd(res, d_QD):
    idx_Q, shape_R0 = res
    return unpack(d_QD, idx_Q, shape_R0.shape[0]).astype(shape_R0.dtype), None


gather_rows.defvjp(_gather_fwd, _gather_bwd)


class RowsToExperts(NamedTuple):
    """Frozen metadata of the receiver's expansion: rows -> expert-major entries."""

    perm: perm.Permutation
    row_Q: jax.Array       # received row of each entry (R = empty)
    w_Q: jax.Array         # combine weight of each entry
    num_rows: int


def rows_to_experts(x_RD, row_Q, lid_Q, w_Q, num_local: int):
    """Expand received rows into one entry per (row, local expert), expert-major. Empty entries
    (lid num_local) sort last, past the group sizes, so the grouped matmul skips them. x_RD: an
    array or MXRows (`each`).
    Returns (x_ND, group_sizes_El, RowsToExperts)."""
    p = perm.sort_by_expert(lid_Q[:, None], num_local + 1)
    x_ND = each(lambda a: perm.permute(gather_rows(a, row_Q), p.order_N, p.inv_N, 1), x_RD)
    return x_ND, p.group_sizes_E[:num_local], RowsToExperts(p, row_Q, w_Q, x_RD.shape[0])


def experts_to_rows(y_ND, meta: RowsToExperts) -> jax.Array:
    """Each row's weighted sum of its experts' outputs (f32): the receiver-side reduction."""
    y_QD = perm.unpermute(y_ND, meta.perm.order_N, meta.perm.inv_N, 1)[:, 0]
    y_QD = y_QD.astype(jnp.float32) * meta.w_Q.astype(jnp.float32)[:, None]
    return sum_rows(y_QD, meta.row_Q, meta.num_rows)


def dense_entries(lid_RJ, w_RJ, num_local: int):
    """Entries of rows that each carry J (expert, weight) pairs: (row_Q, lid_Q, w_Q), Q = R*J."""
    r, j = lid_RJ.shape
    row_Q = jnp.repeat(jnp.arange(r, dtype=jnp.int32), j)
    lid_Q = lid_RJ.reshape(-1)
    return jnp.where(lid_Q < num_local, row_Q, r), lid_Q, w_RJ.reshape(-1)
