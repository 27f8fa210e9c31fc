"""The `allgather` dispatcher: the simple, obviously correct reference for the fused paths.

Legend: T local tokens, D model dim, K top-k, P peers on the expert axis, El local experts,
G = P*T tokens of the whole EP group, J = min(K, El) entries per token, N = G*J rows.

Every device gathers all tokens of its EP group (with their routing), runs its local experts
on the choices that name them, reduces each token's weighted outputs, and a reduce-scatter
returns every token's sum to its owner. Autodiff is exact here: all_gather and psum_scatter
are each other's transposes. Code here runs inside the dispatcher's shard_map.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from dropless.moe.dispatch import rows as fused
from dropless.moe.dispatch.rows import RowsToExperts
from dropless.moe.dispatch.send_plan import SendPlan, make_plan


class AllGatherState(NamedTuple):
    """What `allgather_prepare` returns: the group's choices, and a2a's plan for the stats."""

    ids_GK: jax.Array     # int32 expert choices of every token of the EP group
    plan: SendPlan        # what a2a would send for this device's tokens: only for the stats


class AllGatherMeta(NamedTuple):
    """What `allgather_dispatch` hands to `allgather_combine`."""

    local: RowsToExperts  # gathered rows [G, D] -> this device's entries [Q = G*J] (N of them
                          # expert-major), with their weights: what the reduction per token needs
    out_dtype: Any        # dtype of the tokens (the reduce-scatter runs in it)


def allgather_prepare(ids_TK, ctx) -> AllGatherState:
    """Gather the group's expert choices (and plan the a2a rows, for comparable stats)."""
    plan = make_plan(ids_TK, ctx.num_peers, ctx.experts_per_peer, ctx.budget)
    ids_GK = lax.all_gather(ids_TK.astype(jnp.int32), ctx.expert_axis, tiled=True)
    return AllGatherState(ids_GK, plan)


def allgather_rounds(state: AllGatherState, ctx) -> jax.Array:
    return jnp.ones((), jnp.int32)


def allgather_dispatch(x_TD, w_TK, state: AllGatherState, r, ctx):
    """Gather tokens, pick the choices that live here: (x_ND, group_sizes_El, AllGatherMeta)."""
    x_GD = fused.each(lax.all_gather, x_TD, ctx.expert_axis, tiled=True)
    w_GK = lax.all_gather(w_TK, ctx.expert_axis, tiled=True)
    me = lax.axis_index(ctx.expert_axis)
    el = ctx.experts_per_peer
    mine_GK = state.ids_GK // el == me
    k_GJ = jnp.argsort(~mine_GK, axis=1, stable=True)[:, :ctx.row_slots]
    used_GJ = jnp.take_along_axis(mine_GK, k_GJ, axis=1)
    lid_GJ = jnp.where(used_GJ, jnp.take_along_axis(state.ids_GK % el, k_GJ, axis=1), el)
    w_GJ = jnp.where(used_GJ, jnp.take_along_axis(w_GK, k_GJ, axis=1), 0)
    row_Q, lid_Q, w_Q = fused.dense_entries(lid_GJ, w_GJ, el)
    x_ND, sizes, local = fused.rows_to_experts(x_GD, row_Q, lid_Q, w_Q, el)
    return x_ND, sizes, AllGatherMeta(local, x_TD.dtype)


def allgather_combine(y_ND, meta: AllGatherMeta, ctx) -> jax.Array:
    """Reduce per token here, then reduce-scatter the group's partial sums to their owners."""
    y_GD = fused.experts_to_rows(y_ND, meta.local).astype(meta.out_dtype)
    return lax.psum_scatter(y_GD, ctx.expert_axis, scatter_dimension=0,
                            tiled=True).astype(jnp.float32)
