"""The fused expert-parallel paths: deduplicated rows over `all_to_all` / `ragged_all_to_all`.

Legend: T local tokens, D model dim, K top-k, P peers on the expert axis, El local experts,
Cr row slots and Ce entry slots per peer per round, S = P*Cr, Q = P*Ce (one round's buffers),
R = S received rows, N = Q entries entering the grouped matmul.

Dispatch packs one row per (token, peer) into a [P*Cr, D] buffer and one entry per
(token, choice) -- row slot, local expert, weight -- into a [P*Ce] table (both static, sized by
`ragged_buffer_factor`), and exchanges them. The receiver expands rows into exactly the entries
they carry (not J copies of every row), sorted expert-major for the grouped matmul. Combine
reduces each row's weighted expert outputs on the receiver, sends one row per (token, peer)
back, and sums the rows of each token. `send_rows`/`return_rows` (and, on the receiver,
`gather_rows`/`sum_rows`) are each other's transposes and carry custom VJPs saying so, so the
backward pass runs the same fused exchange instead of autodiff's scatter-and-transpose.
Code here runs inside the dispatcher's shard_map, on local arrays.
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from dropless.moe import dispatch_plan as dp
from dropless.moe import permute as perm


def _a2a(x: jax.Array, axis: str) -> jax.Array:
    """Chunk p of dim 0 goes to peer p; the chunk from peer q lands at q. Self-transpose."""
    return lax.all_to_all(x, axis, 0, 0, tiled=True)


def _pack(x_TD: jax.Array, src_S: jax.Array) -> jax.Array:
    return jnp.take(x_TD, src_S, axis=0, mode="fill", fill_value=0)


def _unpack(y_SD: jax.Array, src_S: jax.Array, num_tokens: int) -> jax.Array:
    # each token fills at most one slot per peer; empty slots point past T and are dropped
    return jax.ops.segment_sum(y_SD, src_S, num_segments=num_tokens)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def send_rows(x_TD: jax.Array, src_S: jax.Array, axis: str) -> jax.Array:
    """Gather the rows named by src_S (T = empty slot) and exchange them: [S, D] received."""
    return _a2a(_pack(x_TD, src_S), axis)


def _send_fwd(x_TD, src_S, axis):
    return send_rows(x_TD, src_S, axis), (src_S, jnp.zeros((x_TD.shape[0], 0), x_TD.dtype))


def _send_bwd(axis, res, d_SD):
    src_S, shape_T0 = res
    d_TD = _unpack(_a2a(d_SD, axis), src_S, shape_T0.shape[0])
    return d_TD.astype(shape_T0.dtype), None


send_rows.defvjp(_send_fwd, _send_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def return_rows(y_SD: jax.Array, src_S: jax.Array, num_tokens: int, axis: str) -> jax.Array:
    """Send processed rows back to their owners and sum each token's rows: [T, D]."""
    return _unpack(_a2a(y_SD, axis), src_S, num_tokens)


def _return_fwd(y_SD, src_S, num_tokens, axis):
    return return_rows(y_SD, src_S, num_tokens, axis), (src_S,)


def _return_bwd(num_tokens, axis, res, d_TD):
    (src_S,) = res
    return _a2a(_pack(d_TD, src_S), axis), None


return_rows.defvjp(_return_fwd, _return_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def sum_rows(y_QD: jax.Array, idx_Q: jax.Array, num_rows: int) -> jax.Array:
    """out[i] = sum of y_QD[q] with idx_Q[q] == i (idx num_rows = dropped). Transpose of
    gather_rows."""
    return _unpack(y_QD, idx_Q, num_rows)


def _sum_fwd(y_QD, idx_Q, num_rows):
    return sum_rows(y_QD, idx_Q, num_rows), (idx_Q,)


def _sum_bwd(num_rows, res, d_RD):
    return _pack(d_RD, res[0]), None


sum_rows.defvjp(_sum_fwd, _sum_bwd)


@jax.custom_vjp
def gather_rows(x_RD: jax.Array, idx_Q: jax.Array) -> jax.Array:
    """out[q] = x_RD[idx_Q[q]] (zero where idx_Q = R). Transpose of sum_rows."""
    return _pack(x_RD, idx_Q)


def _gather_fwd(x_RD, idx_Q):
    return gather_rows(x_RD, idx_Q), (idx_Q, jnp.zeros((x_RD.shape[0], 0), x_RD.dtype))


def _gather_bwd(res, d_QD):
    idx_Q, shape_R0 = res
    return _unpack(d_QD, idx_Q, shape_R0.shape[0]).astype(shape_R0.dtype), None


gather_rows.defvjp(_gather_fwd, _gather_bwd)


class RowsToExperts(NamedTuple):
    """Frozen metadata of the receiver's expansion: rows -> expert-major entries."""

    perm: perm.Permutation
    row_Q: jax.Array       # received row of each entry (R = empty)
    w_Q: jax.Array         # combine weight of each entry
    num_rows: int


def rows_to_experts(x_RD, row_Q, lid_Q, w_Q, num_local: int):
    """Expand received rows into one entry per (row, local expert), expert-major. Empty entries
    (lid num_local) sort last, past the group sizes, so the grouped matmul skips them.
    Returns (x_ND, group_sizes_El, RowsToExperts)."""
    p = perm.sort_by_expert(lid_Q[:, None], num_local + 1)
    x_ND = perm.permute(gather_rows(x_RD, row_Q), p.order_N, p.inv_N, 1)
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


class A2AMeta(NamedTuple):
    local: RowsToExperts
    src_S: jax.Array
    num_tokens: int
    out_dtype: Any


def a2a_prepare(ids_TK, ctx) -> dp.SendPlan:
    """The dedup plan for this device's tokens."""
    return dp.make_plan(ids_TK, ctx.num_peers, ctx.experts_per_peer, ctx.budget)


def a2a_rounds(plan: dp.SendPlan, ctx) -> jax.Array:
    """Rounds every device agrees on: the max over all devices of the rounds each needs."""
    if ctx.overflow == "error":
        return jnp.ones((), jnp.int32)
    return lax.pmax(dp.rounds_needed(plan), ctx.all_axes)


def _received_entries(slots: dp.RoundSlots, w_Q, ctx, exchange):
    """Exchange the entry tables; make entry rows index the whole received row buffer."""
    el, cr, ce = ctx.experts_per_peer, ctx.budget.row_chunk, ctx.budget.entry_chunk
    code_Q = exchange(slots.erow_Q * (el + 1) + slots.elid_Q)   # one int exchange for both
    w_Q = exchange(w_Q)
    erow_Q, lid_Q = code_Q // (el + 1), code_Q % (el + 1)
    peer_Q = jnp.arange(code_Q.shape[0], dtype=jnp.int32) // ce
    row_Q = jnp.where(erow_Q < cr, peer_Q * cr + erow_Q, ctx.num_peers * cr)
    return row_Q, jnp.where(erow_Q < cr, lid_Q, el), w_Q


def a2a_dispatch(x_TD, w_TK, plan: dp.SendPlan, r, ctx):
    """Round r of the fused dispatch: (x_ND expert-major, group_sizes_El, A2AMeta)."""
    slots = dp.round_slots(plan, r, ctx.budget, ctx.experts_per_peer)
    w_Q = dp.entry_weights(w_TK, slots)
    x_RD = send_rows(x_TD, slots.src_S, ctx.expert_axis)
    row_Q, lid_Q, w_Q = _received_entries(slots, w_Q, ctx,
                                          lambda v: _a2a(v, ctx.expert_axis))
    x_ND, sizes, local = rows_to_experts(x_RD, row_Q, lid_Q, w_Q, ctx.experts_per_peer)
    return x_ND, sizes, A2AMeta(local, slots.src_S, x_TD.shape[0], x_TD.dtype)


def a2a_combine(y_ND, meta: A2AMeta, ctx) -> jax.Array:
    """Round r of the fused combine: reduce per row, send back, sum per token -> [T, D] f32."""
    y_RD = experts_to_rows(y_ND, meta.local).astype(meta.out_dtype)
    return return_rows(y_RD, meta.src_S, meta.num_tokens, ctx.expert_axis).astype(jnp.float32)


# ragged_all_to_all: the same buffers, but each peer's chunk travels with its real length only.

def _ragged(x, sizes_P, axis: str, chunk: int) -> jax.Array:
    """Send the first sizes_P[p] items of chunk p to peer p, landing at [me*chunk, ...)."""
    num_peers = sizes_P.shape[0]
    offsets_P = jnp.arange(num_peers, dtype=jnp.int32) * chunk
    out_offsets_P = jnp.full((num_peers,), lax.axis_index(axis) * chunk, jnp.int32)
    recv_P = _a2a(sizes_P, axis)
    return lax.ragged_all_to_all(x, jnp.zeros_like(x), offsets_P, sizes_P, out_offsets_P,
                                 recv_P, axis_name=axis)


def _round_sizes(plan: dp.SendPlan, r):
    """(rows, entries) each peer gets in round r."""
    in_round_TP = plan.hit_TP & (plan.round_TP == r)
    return (jnp.sum(in_round_TP, axis=0, dtype=jnp.int32),
            jnp.sum(jnp.where(in_round_TP, plan.entries_TP, 0), axis=0, dtype=jnp.int32))


def ragged_dispatch(x_TD, w_TK, plan: dp.SendPlan, r, ctx):
    """Like a2a_dispatch, but empty slots never travel (GPU/TPU only; plain autodiff)."""
    slots = dp.round_slots(plan, r, ctx.budget, ctx.experts_per_peer)
    rows_P, entries_P = _round_sizes(plan, r)
    cr, ce = ctx.budget.row_chunk, ctx.budget.entry_chunk
    x_RD = _ragged(_pack(x_TD, slots.src_S), rows_P, ctx.expert_axis, cr)
    # unfilled entry slots arrive as zeros: shift the code by one so zero means "empty"
    ex = lambda v: _ragged(v, entries_P, ctx.expert_axis, ce)
    el = ctx.experts_per_peer
    code_Q = ex(slots.erow_Q * (el + 1) + slots.elid_Q + 1)
    empty_Q = code_Q == 0
    shifted = dp.RoundSlots(slots.src_S, jnp.where(empty_Q, cr, (code_Q - 1) // (el + 1)),
                            jnp.where(empty_Q, el, (code_Q - 1) % (el + 1)), slots.etok_Q,
                            slots.ek_Q)
    row_Q, lid_Q, w_Q = _received_entries(shifted, ex(dp.entry_weights(w_TK, slots)), ctx,
                                          lambda v: v)
    x_ND, sizes, local = rows_to_experts(x_RD, row_Q, lid_Q, w_Q, el)
    return x_ND, sizes, (A2AMeta(local, slots.src_S, x_TD.shape[0], x_TD.dtype), rows_P)


def ragged_combine(y_ND, meta_rows, ctx) -> jax.Array:
    """The reverse ragged exchange (each row back to its owner's slot), then the token sum."""
    meta, rows_P = meta_rows
    y_RD = experts_to_rows(y_ND, meta.local).astype(meta.out_dtype)
    cr = ctx.budget.row_chunk
    back_SD = _ragged(y_RD, _a2a(rows_P, ctx.expert_axis), ctx.expert_axis, cr)
    return _unpack(back_SD, meta.src_S, meta.num_tokens).astype(jnp.float32)
