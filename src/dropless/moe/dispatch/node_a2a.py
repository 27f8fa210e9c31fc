"""The `node_a2a` dispatcher: node-level deduplication, two hops (across nodes, then inside).

Legend: T local tokens, D model dim, K top-k, E experts, P = M*G peers of an EP group, M nodes,
G peers per node, El experts per peer, Eg = G*El experts per node, J1 = min(K, Eg) choices a
row carries across nodes, J2 = min(K, El) inside, Cr1 rows per node per round, S1 = M*Cr1
hop-1 slots = R1 rows received by hop 2, S2 = G*R1 hop-2 slots, Q entries, N grouped-matmul rows.

Runs on the mesh whose `expert` axis is split into (`expert_node`, `expert_local`)
(context.split_expert_axis). Device (m, g) sends each token that has choices on node m' one row,
to its *rail peer* (m', g): the inter-node link carries one row per (token, node) however many
of the node's devices the token picks. The row carries its J1 (node-local expert, weight)
choices. That device then plans its received rows like `a2a` does tokens, over the G devices of
its node (one row per (row, device), entries per choice), and forwards them over the intra-node
axis. Combine runs the transposes: each device reduces its entries, the intra-node hop returns
one row per (row, device) and sums them per received row, the inter-node hop returns one row
per (token, node) and sums them per token. Every exchange is rows.send_rows / return_rows /
gather_rows / sum_rows, whose custom VJPs are each other, so the backward pass is the same two
hops in reverse; the routing weights travel by plain all_to_all (its own transpose).

Hand-worked, M=2 nodes of G=2 peers, El=1 (experts 0,1 on node 0; 2,3 on node 1), K=3, device
(0, 0) holds token t with ids [1, 2, 3]: hop 1 sends t once to (0, 0) (itself: node 0, expert 1)
and once to (1, 0) (node 1, experts 2, 3: one inter-node row, not two). Hop 2: (0, 0) forwards
to (0, 1) (intra-node); (1, 0) keeps expert 2's entry and forwards one row to (1, 1) for 3.

Buffers: hop 1 rounds as `a2a` (Br1 = ragged_buffer_factor x the rows a node expects; rows
beyond it travel in further rounds, agreed by pmax); hop 2 of a round is sized for any routing
(G x R1 rows), so it never overflows: that buffer is the price of exactness here.
"""
from __future__ import annotations

import math
import types
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from dropless.moe.dispatch import send_plan as sp
from dropless.moe.dispatch.a2a import received_entries
from dropless.moe.dispatch.context import NODE_AXES
from dropless.moe.dispatch.rows import (RowsToExperts, each, exchange, experts_to_rows,
                                        return_rows, rows_to_experts, send_rows)

INTER, INTRA = NODE_AXES


class NodeA2AState(NamedTuple):
    """What `node_prepare` returns: the plans of both hops."""

    nodes: sp.SendPlan     # hop 1: (token, node) rows, over the M nodes
    devices: sp.SendPlan   # (token, device) rows over the P peers: hop 2's rows, and the stats


class NodeA2AMeta(NamedTuple):
    """What `node_dispatch` hands to `node_combine` (one round's)."""

    local: RowsToExperts  # hop-2 rows received [G*R1, D] -> entries [Q] (expert-major), weights
    src_S2: jax.Array     # int32 [S2]: the hop-1 row (of R1) that filled each hop-2 slot
    src_S1: jax.Array     # int32 [S1]: the token that filled each hop-1 slot (T = empty)
    num_tokens: int       # T, for the per-token sum on the way back
    out_dtype: Any        # dtype the rows travel back in


def node_budget(ctx) -> sp.Budget:
    """Hop 1: Br1 rows per node per round, each row carrying J1 dense entries (cost J1)."""
    t, m = ctx.num_tokens, ctx.num_nodes
    cfg = ctx.cfg
    j1 = sp.slots_per_row(cfg.top_k, ctx.node_size * ctx.experts_per_peer)
    expect = sp.expected_rows_per_peer(t, cfg.top_k, cfg.num_experts, m)
    br = min(t, max(1, math.ceil(cfg.ragged_buffer_factor * expect)))
    return sp.Budget(br, br * j1, br, br * j1, -(-t // br))


def hop2_budget(ctx) -> sp.Budget:
    """Hop 2: every received row may go to any one device: one round always suffices."""
    r1 = ctx.num_nodes * node_budget(ctx).row_chunk
    j2 = ctx.row_slots
    return sp.Budget(r1, r1 * j2, r1, r1 * j2, 1)


def node_buffer_rows(ctx) -> int:
    """Row slots per round that a device fills, summed over both hops, per peer of the group
    (the stats multiply by P): (M*Cr1 + G*R1) / P."""
    b1 = node_budget(ctx)
    return (ctx.num_nodes * b1.row_chunk + ctx.node_size * hop2_budget(ctx).rows) / ctx.num_peers


def node_prepare(ids_TK, ctx) -> NodeA2AState:
    """Plan hop 1 over the M nodes (Eg experts each) and, for the stats, the device rows."""
    eg = ctx.node_size * ctx.experts_per_peer
    return NodeA2AState(sp.make_plan(ids_TK, ctx.num_nodes, eg, node_budget(ctx)),
                     sp.make_plan(ids_TK, ctx.num_peers, ctx.experts_per_peer, ctx.budget))


def node_rounds(state: NodeA2AState, ctx) -> jax.Array:
    """Hop-1 rounds, agreed by every device (hop 2 always fits one round of hop 1)."""
    if ctx.overflow == "error":
        return jnp.ones((), jnp.int32)
    return lax.pmax(sp.rounds_needed(state.nodes), ctx.all_axes)


def _row_choices(plan: sp.SendPlan, w_TK, src_S, cr: int, j: int, empty: int):
    """For each hop-1 slot, the token's choices on the slot's node, compacted to j columns:
    (node-local expert id or `empty`, weight) [S, j]."""
    s = src_S.shape[0]
    node_S = jnp.arange(s, dtype=jnp.int32) // cr
    dest_SK = jnp.take(plan.dest_TK, src_S, axis=0, mode="fill", fill_value=-1)
    mine_SK = dest_SK == node_S[:, None]
    first_SJ = jnp.argsort(~mine_SK, axis=1, stable=True)[:, :j]
    keep_SJ = jnp.take_along_axis(mine_SK, first_SJ, axis=1)
    lid_SK = jnp.take(plan.lid_TK, src_S, axis=0, mode="fill", fill_value=0)
    w_SK = jnp.take(w_TK, src_S, axis=0, mode="fill", fill_value=0)
    ids_SJ = jnp.where(keep_SJ, jnp.take_along_axis(lid_SK, first_SJ, axis=1), empty)
    w_SJ = jnp.where(keep_SJ, jnp.take_along_axis(w_SK, first_SJ, axis=1), 0)
    return ids_SJ, w_SJ


def node_dispatch(x_TD, w_TK, state: NodeA2AState, r, ctx):
    """Round r: across nodes to the rail peer, then inside the node to the expert's device.
    Returns (x_ND expert-major, group_sizes_El, NodeA2AMeta)."""
    el, g = ctx.experts_per_peer, ctx.node_size
    b1, b2 = node_budget(ctx), hop2_budget(ctx)
    src_S1 = sp.round_slots(state.nodes, r, b1, g * el).src_S
    ids_SJ, w_SJ = _row_choices(state.nodes, w_TK, src_S1, b1.row_chunk, b1.entries // b1.rows,
                                g * el)
    # hop 1 (inter-node): one row per (token, node), with its choices on that node
    x_RD = each(send_rows, x_TD, src_S1, INTER)
    ids_RJ, w_RJ = exchange(ids_SJ, INTER), exchange(w_SJ, INTER)
    # hop 2 (intra-node): the received rows are this device's "tokens"
    plan2 = sp.make_plan(ids_RJ, g, el, b2)
    slots2 = sp.round_slots(plan2, 0, b2, el)
    x2_RD = each(send_rows, x_RD, slots2.src_S, INTRA)
    hop2 = types.SimpleNamespace(experts_per_peer=el, budget=b2, num_peers=g)
    row_Q, lid_Q, w_Q = received_entries(slots2, sp.entry_weights(w_RJ, slots2), hop2,
                                         lambda v: exchange(v, INTRA))
    x_ND, sizes, local = rows_to_experts(x2_RD, row_Q, lid_Q, w_Q, el)
    return x_ND, sizes, NodeA2AMeta(local, slots2.src_S, src_S1, x_TD.shape[0], x_TD.dtype)


def node_combine(y_ND, meta: NodeA2AMeta, ctx) -> jax.Array:
    """The transpose: reduce entries per row, back inside the node, back across nodes: [T, D]."""
    y2_RD = experts_to_rows(y_ND, meta.local).astype(meta.out_dtype)
    y_RD = return_rows(y2_RD, meta.src_S2, meta.src_S1.shape[0], INTRA)
    return return_rows(y_RD.astype(meta.out_dtype), meta.src_S1, meta.num_tokens,
                       INTER).astype(jnp.float32)


def node_traffic(state: NodeA2AState, ctx) -> dict[str, jax.Array]:
    """This device's rows by link (before the psum): inter-node rows of hop 1, intra-node rows
    of hop 2 (a (token, device) pair crosses inside the node unless the device is the rail
    peer), both without late rows under overflow="error"."""
    nodes, devs = state.nodes, state.devices
    me_node = lax.axis_index(INTER)
    me_local = lax.axis_index(INTRA)
    ok_TM = nodes.hit_TP if ctx.overflow != "error" else nodes.hit_TP & (nodes.round_TP == 0)
    node_of_P = jnp.arange(ctx.num_peers) // ctx.node_size
    ok_TP = devs.hit_TP & jnp.take(ok_TM, node_of_P, axis=1)
    hop1 = jnp.sum(ok_TM)
    hop2 = jnp.sum(ok_TP)
    inter = jnp.sum(jnp.where(jnp.arange(ctx.num_nodes) != me_node, ok_TM, False))
    intra = jnp.sum(jnp.where(jnp.arange(ctx.num_peers) % ctx.node_size != me_local, ok_TP,
                              False))
    late = jnp.sum(nodes.hit_TP & (nodes.round_TP > 0))
    return {"sent": hop1 + hop2, "inter": inter, "intra": intra, "late": late,
            "cost": jnp.max(nodes.cost_P), "units": node_budget(ctx).units[2]}
