"""Expert parallelism: the one shard_map boundary, overflow rounds and traffic stats.

Legend: T tokens (global outside shard_map, local inside), D model dim, K top-k, E experts,
P peers on the `expert` mesh axis, El = E/P local experts, J = min(K, El), N rows entering the
grouped matmul. Per-round buffer sizes are in send_plan.Budget.

The dispatcher strategies and their contract are in registry.py (one file per strategy).
The expert math between dispatch and combine is `moe.experts.expert_ffn`, shared with the
single-device layer.

Overflow never drops a token under `overflow="rounds"`: rows beyond a peer's budget travel in
further rounds of the same step. The round count is a pmax over all devices, so every rank runs
the same number of collectives without a host sync. Round 0 is differentiated as usual; the
extra rounds (a traced-length loop, often empty) have a custom VJP that replays them
(recomputing each round's forward, then its VJP), so memory stays bounded by one round's
buffers whatever the routing. With `overflow="error"` one round runs, rows that do not fit
are counted in `aux["dropped_rows"]` (with `aux["sufficient_buffer_factor"]`), and the
trainer's guard (dropless.train.overflow) keeps such a step from applying and raises.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from dropless.config import MoEConfig
from dropless.moe.dispatch.context import (EPContext, make_context, multi_node_groups,
                                            split_expert_axis)
from dropless.moe.dispatch.overlap import chunk_tokens, chunked
from dropless.moe.dispatch.registry import (DISPATCHERS, LOCAL, DispatcherSpec,
                                             platform_choices, resolve_dispatcher)
from dropless.moe.dispatch.send_plan import SendPlan
from dropless.moe.experts import dropless_experts, expert_ffn
from dropless.moe.router import Routing, expert_counts
from dropless.parallel.mesh import LOGICAL_RULES, AnyMesh, jax_mesh, split_axes
from dropless.parallel.sharding import MOE_LAYER_AXES

FSDP_AXIS = "fsdp"


def _one_round(r, x_TD, w_TK, experts, state, spec: DispatcherSpec, ctx: EPContext):
    x_ND, sizes_El, meta = spec.dispatch(x_TD, w_TK, state, r, ctx)
    y_ND = expert_ffn(x_ND, sizes_El, experts, ctx.cfg)
    return spec.combine(y_ND, meta, ctx)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _rounds(x_TD, w_TK, experts, state, rounds, spec, ctx):
    """Sum over the extra rounds 1 <= r < rounds (traced, agreed on device) of their outputs."""
    body = lambda r, y: y + _one_round(r, x_TD, w_TK, experts, state, spec, ctx)
    return lax.fori_loop(1, rounds, body, jnp.zeros(x_TD.shape, jnp.float32))


def _rounds_fwd(x_TD, w_TK, experts, state, rounds, spec, ctx):
    return _rounds(x_TD, w_TK, experts, state, rounds, spec, ctx), (x_TD, w_TK, experts, state,
                                                                    rounds)


def _rounds_bwd(spec, ctx, res, dy_TD):
    x_TD, w_TK, experts, state, rounds = res

    def body(r, acc):
        f = lambda x, w, e: _one_round(r, x, w, e, state, spec, ctx)
        _, vjp = jax.vjp(f, x_TD, w_TK, experts)
        return jax.tree.map(jnp.add, acc, vjp(dy_TD))

    zeros = jax.tree.map(jnp.zeros_like, (x_TD, w_TK, experts))
    dx, dw, de = lax.fori_loop(1, rounds, body, zeros)
    return dx, dw, de, None, None


_rounds.defvjp(_rounds_fwd, _rounds_bwd)


def _peer_nodes(ctx: EPContext) -> tuple[jax.Array, jax.Array]:
    """(node id of each peer of my EP group [P], my index in the group)."""
    table = jnp.asarray(np.asarray(ctx.node_of_position, np.int32).reshape(ctx.mesh_shape))
    peer_axes = (ctx.expert_axis,) if isinstance(ctx.expert_axis, str) else ctx.expert_axis
    idx = tuple(slice(None) if a in peer_axes else lax.axis_index(a) for a in ctx.all_axes)
    return table[idx].reshape(-1), lax.axis_index(ctx.expert_axis)


def _traffic(state, spec: DispatcherSpec, ctx: EPContext, plan: SendPlan, intra_P, inter_P):
    """This device's rows (sent, inter-node, intra-node, late) and busiest-peer cost; `plan`
    is the state's (token, device) plan (spec.device_plan)."""
    if spec.traffic is not None:
        return spec.traffic(state, ctx)
    late_P = jnp.sum(plan.hit_TP & (plan.round_TP > 0), axis=0)   # rows beyond round 0
    if spec.replicates_tokens:
        sent_P = jnp.full_like(plan.counts_P, ctx.num_tokens)
    elif ctx.overflow == "error":
        sent_P = plan.counts_P - late_P
    else:
        sent_P = plan.counts_P
    return {"sent": jnp.sum(sent_P), "inter": jnp.sum(jnp.where(inter_P, sent_P, 0)),
            "intra": jnp.sum(jnp.where(intra_P, sent_P, 0)), "late": jnp.sum(late_P),
            "cost": jnp.max(plan.cost_P), "units": ctx.budget.units[2]}


def _stats(state, rounds, spec: DispatcherSpec, ctx: EPContext) -> dict[str, jax.Array]:
    """Per-layer traffic and buffer statistics, summed (or maxed) over all devices.

    Rows are counted once per direction (combine moves the same rows back). `*_no_dedup` is what
    a dispatcher sending one row per (token, choice) would move, `*_device_dedup` what one row
    per (token, device) moves (a2a). Load and headroom refer to the dispatcher's own budget
    (node_a2a: hop-1 rows per node per round; a2a: rows and entries per peer per round).
    """
    device_plan = spec.device_plan(state)
    nodes_P, me = _peer_nodes(ctx)
    remote_P = jnp.arange(ctx.num_peers) != me
    intra_P = remote_P & (nodes_P == nodes_P[me])
    inter_P = nodes_P != nodes_P[me]
    t = _traffic(state, spec, ctx, device_plan, intra_P, inter_P)
    s = lambda v: lax.psum(jnp.sum(v).astype(jnp.float32), ctx.all_axes)
    over = s(t["late"])
    load = lax.pmax(t["cost"], ctx.all_axes) / t["units"]
    hits_P, routed_P = device_plan.counts_P, device_plan.routed_P
    stats = {
        "rows_sent": s(t["sent"]), "rows_routed": s(routed_P),
        "padding_rows": s(rounds * spec.buffer_rows(ctx) * ctx.num_peers) - s(t["sent"]),
        "rounds": rounds.astype(jnp.int32),
        "buffer_headroom": 1.0 - load.astype(jnp.float32),
        "overflow_rows": over,
        "dropped_rows": over if ctx.overflow == "error" and spec.overflows
        else jnp.zeros((), jnp.float32),
        "sufficient_buffer_factor": (load * ctx.cfg.ragged_buffer_factor).astype(jnp.float32),
        "rows_intra_node": s(t["intra"]),
        "rows_inter_node": s(t["inter"]),
        "rows_intra_node_no_dedup": s(jnp.where(intra_P, routed_P, 0)),
        "rows_inter_node_no_dedup": s(jnp.where(inter_P, routed_P, 0)),
        "rows_intra_node_device_dedup": s(jnp.where(intra_P, hits_P, 0)),
        "rows_inter_node_device_dedup": s(jnp.where(inter_P, hits_P, 0)),
    }
    for where in ("intra", "inter"):
        stats[f"bytes_{where}_node"] = stats[f"rows_{where}_node"] * ctx.row_bytes
    return stats


def _per_device(x_TD, w_TK, ids_TK, experts, *, spec: DispatcherSpec, ctx: EPContext):
    """Inside the shard_map: local tokens in, local token outputs and global stats out."""
    state = spec.prepare(ids_TK, ctx)
    rounds = spec.rounds(state, ctx)
    # round 0 is differentiated as usual; only overflow rounds pay for recomputation
    y_TD = _one_round(0, x_TD, w_TK, experts, state, spec, ctx)
    if spec.overflows and ctx.max_rounds > 1 and ctx.overflow == "rounds":
        y_TD = y_TD + _rounds(x_TD, w_TK, experts, state, rounds, spec, ctx)
    return y_TD, _stats(state, rounds, spec, ctx)


def expert_weight_specs(experts: dict[str, jax.Array], ctx: EPContext
                        ) -> dict[str, tuple[PartitionSpec, int | None]]:
    """Each routed expert weight's PartitionSpec at the shard_map boundary, and the dim the
    body all-gathers over fsdp (None: none). The spec is the trainer's placement
    (parallel.sharding, MOE_LAYER_AXES): E over the expert axis, the model dim D over fsdp
    where fsdp divides it (parallel.mesh.split_axes, the rule that places it). Gathering D
    inside the shard_map makes the gradient's transpose a reduce-scatter over fsdp
    (lax.all_gather's transpose is psum_scatter); taken whole over fsdp at the boundary, the
    gradient would be all-reduced over fsdp and then sliced.
    A key outside MOE_LAYER_AXES (a bench's own weights) is taken whole over fsdp."""
    sizes = dict(zip(ctx.all_axes, ctx.mesh_shape))
    # D's mesh axes by the trainer's rule (parallel.mesh.split_axes), E's already used
    rule = [a for a in LOGICAL_RULES["embed"] if a in sizes and sizes[a] > 1]
    used = {ctx.expert_axis} if isinstance(ctx.expert_axis, str) else set(ctx.expert_axis)
    out = {}
    for k, w in experts.items():
        axes = MOE_LAYER_AXES.get(f"experts/{k}", ())
        d = axes.index("embed") if "embed" in axes and len(axes) == w.ndim else None
        kept = () if d is None else split_axes(rule, sizes, w.shape[d], used)
        assert set(kept) <= {FSDP_AXIS}, kept   # the body gathers over fsdp alone
        if not kept:
            out[k] = (PartitionSpec(ctx.expert_axis), None)
        else:
            dims = [ctx.expert_axis] + [None] * (w.ndim - 1)
            dims[d] = FSDP_AXIS
            out[k] = (PartitionSpec(*dims), d)
    return out


def _gathering(body, gather_dims: dict[str, int | None]):
    """`body` with the expert weights' fsdp slices all-gathered (tiled) on entry."""
    def run(x_TD, w_TK, ids_TK, experts):
        experts = {k: w if gather_dims[k] is None
                   else lax.all_gather(w, FSDP_AXIS, axis=gather_dims[k], tiled=True)
                   for k, w in experts.items()}
        return body(x_TD, w_TK, ids_TK, experts)
    return run


def _platform_dependent(*args, default, per_platform):
    return lax.platform_dependent(*args, default=default, **per_platform)


def expert_parallel_experts(x_TD: jax.Array, routing: Routing, experts: dict[str, jax.Array],
                            cfg: MoEConfig, mesh: AnyMesh):
    """The routed experts of the MoE layer, expert-parallel over `mesh`'s `expert` axis.

    x_TD [T, D] and the routing are split over all mesh axes (tokens); experts [E, ...] over
    `expert`, their model dim over fsdp (`expert_weight_specs`: gathered inside, so their
    gradients are reduce-scattered over fsdp). Returns (y_TD f32, tokens_per_expert_E, aux)
    where aux holds the traffic stats (rows_sent, padding_rows, rounds, buffer_headroom,
    overflow_rows, dropped_rows, sufficient_buffer_factor, rows/bytes intra- and inter-node,
    with and without dedup).
    The nodes are `mesh`'s: a NodeMesh's node size (parallel.mesh); a plain Mesh is one node.
    Raises ValueError for a bad mesh, token count or dispatcher (see make_context).
    """
    num_nodes = multi_node_groups(mesh)
    name = resolve_dispatcher(cfg.dispatcher, num_nodes=num_nodes)   # this host's backend
    sizes_E = expert_counts(routing.ids_TK, cfg.num_experts)
    if name == LOCAL:
        y_TD, _ = dropless_experts(x_TD, routing, experts, cfg)
        return y_TD, sizes_E, {}
    spec = DISPATCHERS[name]
    if spec.split_nodes:
        mesh = split_expert_axis(mesh)
    # ep_comm_overlap_chunks: the context (buffers, rounds) is one token chunk's (overlap.py)
    chunks = cfg.ep_comm_overlap_chunks
    ctx = make_context(cfg, mesh, chunk_tokens(x_TD.shape[0], jax_mesh(mesh).size, chunks),
                       x_TD.dtype)
    tok = PartitionSpec(ctx.all_axes)
    placed = expert_weight_specs(experts, ctx)
    exp_specs = {k: spec for k, (spec, _) in placed.items()}
    body = functools.partial(_per_device, spec=spec, ctx=ctx)
    choices = platform_choices(cfg.dispatcher, num_nodes=num_nodes)
    if len(set(choices.values())) > 1:
        # `auto` differs by platform (ragged_a2a on GPU when it lowers): pick at lowering time
        assert all(DISPATCHERS[n].split_nodes == spec.split_nodes for n in choices.values())
        # one traced body per distinct strategy: platform_dependent joins identical branches
        bodies = {n: functools.partial(_per_device, spec=DISPATCHERS[n], ctx=ctx)
                  for n in set(choices.values())}
        per_platform = {p: bodies[n] for p, n in choices.items() if n != choices["cpu"]}
        body = functools.partial(_platform_dependent, default=bodies[choices["cpu"]],
                                 per_platform=per_platform)
    gathered = _gathering(chunked(body, chunks), {k: d for k, (_, d) in placed.items()})
    fn = jax.shard_map(gathered, mesh=jax_mesh(mesh),
                       in_specs=(tok, tok, tok, exp_specs),
                       out_specs=(tok, PartitionSpec()), check_vma=False)
    y_TD, stats = fn(x_TD, routing.weights_TK, routing.ids_TK, experts)
    return y_TD, sizes_E, stats
