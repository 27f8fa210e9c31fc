"""The fused expert-parallel paths: deduplicated rows over `all_to_all` / `ragged_all_to_all`.

Legend: T local tokens, D model dim, K top-k, P peers on the expert axis, El local experts,
J = min(K, El) expert entries per row, C rows per peer per round, S = P*C buffer slots,
N = S*J replicated rows on the receiver.

Dispatch packs one row per (token, peer) into a [P*C, D] buffer (static: C comes from
`ragged_buffer_factor`), exchanges it, and on arrival replicates each row once per local expert
it names, sorted expert-major for the grouped matmul. Combine reduces each row's weighted expert
outputs on the receiver, sends one row per (token, peer) back, and sums the rows of each token.
`send_rows` and `return_rows` are each other's transposes and carry custom VJPs saying so, so
the backward pass runs the same fused exchange instead of autodiff's scatter-and-transpose.
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


class RowsToExperts(NamedTuple):
    """Frozen metadata from replicating received rows into expert-major order."""

    perm: perm.Permutation
    w_RJ: jax.Array


def rows_to_experts(x_RD, lid_RJ, w_RJ, num_local: int):
    """Replicate each row once per local expert it carries, expert-major; unused entries (id
    num_local) sort last and lie past the group sizes, so the grouped matmul skips them.
    Returns (x_ND, group_sizes_El, RowsToExperts)."""
    j = lid_RJ.shape[1]
    p = perm.sort_by_expert(lid_RJ, num_local + 1)
    x_ND = perm.permute(x_RD, p.order_N, p.inv_N, j)
    return x_ND, p.group_sizes_E[:num_local], RowsToExperts(p, w_RJ)


def experts_to_rows(y_ND, meta: RowsToExperts) -> jax.Array:
    """Each row's weighted sum of its experts' outputs (f32): the receiver-side reduction."""
    j = meta.w_RJ.shape[1]
    y_RJD = perm.unpermute(y_ND, meta.perm.order_N, meta.perm.inv_N, j)
    return jnp.einsum("rjd,rj->rd", y_RJD, meta.w_RJ.astype(y_RJD.dtype),
                      preferred_element_type=jnp.float32)


class A2AMeta(NamedTuple):
    local: RowsToExperts
    src_S: jax.Array
    num_tokens: int
    out_dtype: Any


def a2a_prepare(ids_TK, ctx) -> dp.SendPlan:
    """The dedup plan for this device's tokens."""
    return dp.make_plan(ids_TK, ctx.num_peers, ctx.experts_per_peer)


def a2a_rounds(plan: dp.SendPlan, ctx) -> jax.Array:
    """Rounds every device agrees on: the max over all devices of the rounds each needs."""
    if ctx.overflow == "error":
        return jnp.ones((), jnp.int32)
    return lax.pmax(dp.rounds_needed(plan.counts_P, ctx.chunk), ctx.all_axes)


def a2a_dispatch(x_TD, w_TK, plan: dp.SendPlan, r, ctx):
    """Round r of the fused dispatch: (x_ND expert-major, group_sizes_El, A2AMeta)."""
    slots = dp.round_slots(plan, r, ctx.chunk, ctx.experts_per_peer, ctx.row_slots)
    w_SJ = dp.slot_weights(w_TK, slots, ctx.experts_per_peer)
    x_RD = send_rows(x_TD, slots.src_S, ctx.expert_axis)
    lid_RJ = _a2a(slots.lid_SJ, ctx.expert_axis)
    w_RJ = _a2a(w_SJ, ctx.expert_axis)
    x_ND, sizes, local = rows_to_experts(x_RD, lid_RJ, w_RJ, ctx.experts_per_peer)
    return x_ND, sizes, A2AMeta(local, slots.src_S, x_TD.shape[0], x_TD.dtype)


def a2a_combine(y_ND, meta: A2AMeta, ctx) -> jax.Array:
    """Round r of the fused combine: reduce per row, send back, sum per token -> [T, D] f32."""
    y_RD = experts_to_rows(y_ND, meta.local).astype(meta.out_dtype)
    return return_rows(y_RD, meta.src_S, meta.num_tokens, ctx.expert_axis).astype(jnp.float32)


# ragged_all_to_all: the same rows, but each peer's chunk is sent with its real length only.

def _ragged_exchange(x_SD, sizes_P, axis: str, chunk: int) -> jax.Array:
    """Send the first sizes_P[p] rows of chunk p to peer p, into slot range [me*C, me*C + n)."""
    num_peers = sizes_P.shape[0]
    offsets_P = jnp.arange(num_peers, dtype=jnp.int32) * chunk
    me = lax.axis_index(axis)
    # the receiver keeps the sender's chunk at sender_index * C, like the dense exchange
    out_offsets_P = jnp.full((num_peers,), me * chunk, jnp.int32)
    recv_sizes_P = _a2a(sizes_P, axis)
    return lax.ragged_all_to_all(x_SD, jnp.zeros_like(x_SD), offsets_P, sizes_P,
                                 out_offsets_P, recv_sizes_P, axis_name=axis)


def ragged_dispatch(x_TD, w_TK, plan: dp.SendPlan, r, ctx):
    """Like a2a_dispatch, but padding slots never travel (GPU/TPU only)."""
    slots = dp.round_slots(plan, r, ctx.chunk, ctx.experts_per_peer, ctx.row_slots)
    sizes_P = jnp.clip(plan.counts_P - r * ctx.chunk, 0, ctx.chunk).astype(jnp.int32)
    w_SJ = dp.slot_weights(w_TK, slots, ctx.experts_per_peer)
    ex = functools.partial(_ragged_exchange, sizes_P=sizes_P, axis=ctx.expert_axis,
                           chunk=ctx.chunk)
    x_RD = ex(_pack(x_TD, slots.src_S))
    # unfilled receive slots stay zero: shift ids by one so zero means "no expert"
    lid1_RJ = ex(slots.lid_SJ + 1)
    lid_RJ = jnp.where(lid1_RJ == 0, ctx.experts_per_peer, lid1_RJ - 1)
    x_ND, sizes, local = rows_to_experts(x_RD, lid_RJ, ex(w_SJ), ctx.experts_per_peer)
    meta = A2AMeta(local, slots.src_S, x_TD.shape[0], x_TD.dtype)
    return x_ND, sizes, (meta, sizes_P)


def ragged_combine(y_ND, meta_sizes, ctx) -> jax.Array:
    """The reverse ragged exchange, then the per-token sum."""
    meta, sizes_P = meta_sizes
    y_RD = experts_to_rows(y_ND, meta.local).astype(meta.out_dtype)
    back_SD = _ragged_back(y_RD, sizes_P, ctx.expert_axis, ctx.chunk)
    return _unpack(back_SD, meta.src_S, meta.num_tokens).astype(jnp.float32)


def _ragged_back(y_RD, sent_P, axis: str, chunk: int) -> jax.Array:
    """Rows from peer q sit at [q*C, q*C + n_q); return them into our own chunk q."""
    num_peers = sent_P.shape[0]
    recv_P = _a2a(sent_P, axis)                  # what each peer sent us = what we return
    me = lax.axis_index(axis)
    in_offsets_P = jnp.arange(num_peers, dtype=jnp.int32) * chunk
    out_offsets_P = jnp.full((num_peers,), me * chunk, jnp.int32)
    return lax.ragged_all_to_all(y_RD, jnp.zeros_like(y_RD), in_offsets_P, recv_P,
                                 out_offsets_P, sent_P, axis_name=axis)
