"""The `ragged_a2a` dispatcher: a2a's buffers over `ragged_all_to_all`, so padding never travels.

Legend: T local tokens, D model dim, K top-k, P peers on the expert axis, El local experts,
Cr row slots and Ce entry slots per peer per round, S = P*Cr, Q = P*Ce, R = S received rows.

Same plan, same buffers and same receiver expansion as `a2a`; each peer's chunk travels with its
real length only. XLA:CPU cannot compile ragged-all-to-all, so this strategy is GPU/TPU only
(it lowers for CUDA on any machine: tests/moe/dispatch/test_ragged_a2a.py). Plain autodiff: the
transpose of ragged_all_to_all is a ragged_all_to_all. Runs inside the dispatcher's shard_map.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from dropless.moe.dispatch import send_plan as sp
from dropless.moe.dispatch.a2a import received_entries
from dropless.moe.dispatch.rows import (RowsToExperts, each, exchange, experts_to_rows, pack,
                                        rows_to_experts, unpack)


class RaggedA2AMeta(NamedTuple):
    """What `ragged_dispatch` hands to `ragged_combine`: a2a's, plus the rows sent per peer."""

    local: RowsToExperts  # received rows [R = S, D] -> entries [Q] (expert-major), weights
    src_S: jax.Array      # int32 [S]: the token that filled each row slot (T = empty)
    rows_P: jax.Array     # int32 [P]: rows this device sent each peer (their chunks' lengths)
    num_tokens: int       # T, for the per-token sum on the way back
    out_dtype: Any        # dtype the rows travel back in


def _ragged(x, sizes_P, axis: str, chunk: int) -> jax.Array:
    """Send the first sizes_P[p] items of chunk p to peer p, landing at [me*chunk, ...)."""
    num_peers = sizes_P.shape[0]
    offsets_P = jnp.arange(num_peers, dtype=jnp.int32) * chunk
    out_offsets_P = jnp.full((num_peers,), lax.axis_index(axis) * chunk, jnp.int32)
    recv_P = exchange(sizes_P, axis)
    return lax.ragged_all_to_all(x, jnp.zeros_like(x), offsets_P, sizes_P, out_offsets_P,
                                 recv_P, axis_name=axis)


def _round_sizes(plan: sp.SendPlan, r):
    """(rows, entries) each peer gets in round r."""
    in_round_TP = plan.hit_TP & (plan.round_TP == r)
    return (jnp.sum(in_round_TP, axis=0, dtype=jnp.int32),
            jnp.sum(jnp.where(in_round_TP, plan.entries_TP, 0), axis=0, dtype=jnp.int32))


def ragged_dispatch(x_TD, w_TK, plan: sp.SendPlan, r, ctx):
    """Like a2a_dispatch, but empty slots never travel (GPU/TPU only; plain autodiff):
    (x_ND expert-major, group_sizes_El, RaggedA2AMeta)."""
    slots = sp.round_slots(plan, r, ctx.budget, ctx.experts_per_peer)
    rows_P, entries_P = _round_sizes(plan, r)
    cr, ce = ctx.budget.row_chunk, ctx.budget.entry_chunk
    x_RD = each(lambda x: _ragged(pack(x, slots.src_S), rows_P, ctx.expert_axis, cr), x_TD)
    # unfilled entry slots arrive as zeros: shift the code by one so zero means "empty"
    ex = lambda v: _ragged(v, entries_P, ctx.expert_axis, ce)
    el = ctx.experts_per_peer
    code_Q = ex(slots.erow_Q * (el + 1) + slots.elid_Q + 1)
    empty_Q = code_Q == 0
    shifted = sp.RoundSlots(slots.src_S, jnp.where(empty_Q, cr, (code_Q - 1) // (el + 1)),
                            jnp.where(empty_Q, el, (code_Q - 1) % (el + 1)), slots.etok_Q,
                            slots.ek_Q)
    row_Q, lid_Q, w_Q = received_entries(shifted, ex(sp.entry_weights(w_TK, slots)), ctx,
                                          lambda v: v)
    x_ND, sizes, local = rows_to_experts(x_RD, row_Q, lid_Q, w_Q, el)
    return x_ND, sizes, RaggedA2AMeta(local, slots.src_S, rows_P, x_TD.shape[0], x_TD.dtype)


def ragged_combine(y_ND, meta: RaggedA2AMeta, ctx) -> jax.Array:
    """The reverse ragged exchange (each row back to its owner's slot), then the token sum."""
    y_RD = experts_to_rows(y_ND, meta.local).astype(meta.out_dtype)
    cr = ctx.budget.row_chunk
    back_SD = _ragged(y_RD, exchange(meta.rows_P, ctx.expert_axis), ctx.expert_axis, cr)
    return unpack(back_SD, meta.src_S, meta.num_tokens).astype(jnp.float32)
