"""The `a2a` dispatcher: deduplicated rows over `all_to_all` in static per-peer chunks.

Legend: T local tokens, D model dim, K top-k, P peers on the expert axis, El local experts,
Cr row slots and Ce entry slots per peer per round, S = P*Cr, Q = P*Ce (one round's buffers),
R = S received rows, N = Q entries entering the grouped matmul.

Dispatch packs one row per (token, peer) into a [P*Cr, D] buffer and one entry per
(token, choice) -- row slot, local expert, weight -- into a [P*Ce] table (both static, sized by
`ragged_buffer_factor`), and exchanges them. The receiver expands rows into exactly the entries
they carry (not J copies of every row), sorted expert-major for the grouped matmul. Combine
reduces each row's weighted expert outputs on the receiver, sends one row per (token, peer)
back, and sums the rows of each token. `send_rows`/`return_rows` (and, on the receiver,
`gather_rows`/`sum_rows`, all in rows.py) are each other's transposes and carry custom VJPs
saying so, so the backward pass runs the same fused exchange.
Code here runs inside the dispatcher's shard_map, on local arrays.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from dropless.moe.dispatch import send_plan as sp
from dropless.moe.dispatch.rows import (RowsToExperts, each, exchange, experts_to_rows,
                                        return_rows, rows_to_experts, send_rows)


class A2AMeta(NamedTuple):
    """What `a2a_dispatch` hands to `a2a_combine` (one round's)."""

    local: RowsToExperts  # received rows [R = S, D] -> entries [Q] (expert-major), weights
    src_S: jax.Array      # int32 [S]: the token that filled each row slot (T = empty)
    num_tokens: int       # T, for the per-token sum on the way back
    out_dtype: Any        # dtype the rows travel back in


def a2a_prepare(ids_TK, ctx) -> sp.SendPlan:
    """The dedup plan for this device's tokens."""
    return sp.make_plan(ids_TK, ctx.num_peers, ctx.experts_per_peer, ctx.budget)


def a2a_rounds(plan: sp.SendPlan, ctx) -> jax.Array:
    """Rounds every device agrees on: the max over all devices of the rounds each needs."""
    if ctx.overflow == "error":
        return jnp.ones((), jnp.int32)
    return lax.pmax(sp.rounds_needed(plan), ctx.all_axes)


def received_entries(slots: sp.RoundSlots, w_Q, ctx, exchange):
    """Exchange the entry tables; make entry rows index the whole received row buffer."""
    el, cr, ce = ctx.experts_per_peer, ctx.budget.row_chunk, ctx.budget.entry_chunk
    code_Q = exchange(slots.erow_Q * (el + 1) + slots.elid_Q)   # one int exchange for both
    w_Q = exchange(w_Q)
    erow_Q, lid_Q = code_Q // (el + 1), code_Q % (el + 1)
    peer_Q = jnp.arange(code_Q.shape[0], dtype=jnp.int32) // ce
    row_Q = jnp.where(erow_Q < cr, peer_Q * cr + erow_Q, ctx.num_peers * cr)
    return row_Q, jnp.where(erow_Q < cr, lid_Q, el), w_Q


def a2a_dispatch(x_TD, w_TK, plan: sp.SendPlan, r, ctx):
    """Round r of the fused dispatch: (x_ND expert-major, group_sizes_El, A2AMeta)."""
    slots = sp.round_slots(plan, r, ctx.budget, ctx.experts_per_peer)
    w_Q = sp.entry_weights(w_TK, slots)
    x_RD = each(send_rows, x_TD, slots.src_S, ctx.expert_axis)
    row_Q, lid_Q, w_Q = received_entries(slots, w_Q, ctx,
                                          lambda v: exchange(v, ctx.expert_axis))
    x_ND, sizes, local = rows_to_experts(x_RD, row_Q, lid_Q, w_Q, ctx.experts_per_peer)
    return x_ND, sizes, A2AMeta(local, slots.src_S, x_TD.shape[0], x_TD.dtype)


def a2a_combine(y_ND, meta: A2AMeta, ctx) -> jax.Array:
    """Round r of the fused combine: reduce per row, send back, sum per token -> [T, D] f32."""
    y_RD = experts_to_rows(y_ND, meta.local).astype(meta.out_dtype)
    return return_rows(y_RD, meta.src_S, meta.num_tokens, ctx.expert_axis).astype(jnp.float32)
