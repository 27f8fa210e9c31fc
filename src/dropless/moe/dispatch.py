"""Expert parallelism: the dispatcher registry, the one shard_map boundary, rounds and stats.

Legend: T tokens (global outside shard_map, local inside), D model dim, K top-k, E experts,
P peers on the `expert` mesh axis, El = E/P local experts, J = min(K, El), N rows entering the
grouped matmul. Per-round buffer sizes are in dispatch_plan.Budget.

A dispatcher is a named strategy sharing one contract (see DispatcherSpec):
  state = prepare(ids_TK)                       routing-only bookkeeping, no gradients
  rounds(state)                                 rounds all devices agree on (on device)
  x_ND, group_sizes_El, meta = dispatch(x_TD, w_TK, state, r)   expert-major rows of round r
  y_TD += combine(expert_ffn(x_ND, group_sizes_El), meta)      back in token order
The expert math is the layer's own `expert_ffn`, so EP and the single-device layer share it.

Overflow never drops a token under `overflow="rounds"`: rows beyond a peer's budget travel in
further rounds of the same step. The round count is a pmax over all devices, so every rank runs
the same number of collectives without a host sync. Round 0 is differentiated as usual; the
extra rounds (a traced-length loop, often empty) have a custom VJP that replays them
(recomputing each round's forward, then its VJP), so memory stays bounded by one round's
buffers whatever the routing. With `overflow="error"` one round runs, rows that do not fit are counted
in `aux["dropped_rows"]`, and `check_overflow` raises on the host.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from dropless.config import MoEConfig
from dropless.moe import dispatch_a2a as a2a
from dropless.moe import dispatch_allgather as ag
from dropless.moe import dispatch_plan as dp
from dropless.moe.router import Routing, expert_counts

EXPERT_AXIS = "expert"


@dataclasses.dataclass(frozen=True)
class DispatcherSpec:
    """A registered dispatcher (functions take the EPContext last)."""

    name: str
    prepare: Callable[..., Any]
    rounds: Callable[..., jax.Array]
    dispatch: Callable[..., tuple]
    combine: Callable[..., jax.Array]
    description: str
    unsupported_on: tuple[str, ...] = ()   # platforms where it cannot compile
    buffer_rows: Callable[..., int] = lambda ctx: ctx.budget.row_chunk  # per peer per round


DISPATCHERS: dict[str, DispatcherSpec] = {
    "allgather": DispatcherSpec(
        "allgather", ag.allgather_prepare, ag.allgather_rounds, ag.allgather_dispatch,
        ag.allgather_combine, "gather all tokens, run local experts, reduce-scatter back",
        buffer_rows=lambda ctx: ctx.num_tokens),
    "a2a": DispatcherSpec(
        "a2a", a2a.a2a_prepare, a2a.a2a_rounds, a2a.a2a_dispatch, a2a.a2a_combine,
        "deduplicated rows over all_to_all in static per-peer chunks (every backend)"),
    "ragged_a2a": DispatcherSpec(
        "ragged_a2a", a2a.a2a_prepare, a2a.a2a_rounds, a2a.ragged_dispatch, a2a.ragged_combine,
        "deduplicated rows over ragged_all_to_all (GPU/TPU; padding never travels)",
        unsupported_on=("cpu",)),
}


def dispatcher_names() -> tuple[str, ...]:
    """Names accepted by MoEConfig.dispatcher with a mesh: auto, local, then the registry."""
    return ("auto", "local") + tuple(DISPATCHERS)


def resolve_dispatcher(name: str, platform: str | None = None) -> str:
    """`auto` -> `a2a` (works everywhere; `ragged_a2a` stays opt-in until measured on GPU).

    Raises ValueError for an unknown name or a dispatcher the platform cannot compile.
    """
    platform = platform or jax.default_backend()
    if name == "auto":
        return "a2a"
    if name == "local":
        return name
    if name not in DISPATCHERS:
        raise ValueError(f"MoEConfig.dispatcher={name!r} is unknown; known: "
                         f"{', '.join(dispatcher_names())}")
    if platform in DISPATCHERS[name].unsupported_on:
        raise ValueError(f"MoEConfig.dispatcher={name!r} is not supported on {platform}: XLA:"
                         f"{platform.upper()} cannot compile ragged-all-to-all; use 'a2a'")
    return name


@dataclasses.dataclass(frozen=True)
class EPContext:
    """Static facts the per-device code needs (hashable: it is a custom_vjp static argument)."""

    cfg: MoEConfig
    expert_axis: str
    all_axes: tuple[str, ...]
    mesh_shape: tuple[int, ...]
    node_of_position: tuple[int, ...]   # node id of each mesh position, row-major
    num_tokens: int                     # local tokens per device
    num_peers: int
    experts_per_peer: int
    row_slots: int
    budget: dp.Budget
    overflow: str
    row_bytes: int                      # one travelling row: D activations
    entry_bytes: int                    # one travelling entry: (row, expert) code + weight

    @property
    def max_rounds(self) -> int:
        """Static bound on the rounds any routing needs."""
        return self.budget.max_rounds


def make_context(cfg: MoEConfig, mesh: Mesh, num_tokens: int, dtype) -> EPContext:
    """Validate the mesh against the config and the token count; build the EPContext.

    Raises ValueError when the mesh has no `expert` axis, num_experts is not divisible by it,
    or the tokens do not split evenly over the devices.
    """
    if EXPERT_AXIS not in mesh.axis_names:
        raise ValueError(f"mesh axes {mesh.axis_names} have no {EXPERT_AXIS!r} axis")
    ep = int(mesh.shape[EXPERT_AXIS])
    if cfg.num_experts % ep:
        raise ValueError(f"MoEConfig.num_experts={cfg.num_experts} is not divisible by expert "
                         f"parallelism {ep} (mesh axis {EXPERT_AXIS!r})")
    if num_tokens % mesh.size:
        raise ValueError(f"token count {num_tokens} is not divisible by the {mesh.size} devices "
                         f"of the mesh {dict(mesh.shape)}; pad the batch")
    t_local = num_tokens // mesh.size
    el = cfg.num_experts // ep
    j = dp.slots_per_row(cfg.top_k, el)
    nodes = tuple(int(d.id) // cfg.devices_per_node for d in mesh.devices.flat)
    return EPContext(
        cfg=cfg, expert_axis=EXPERT_AXIS, all_axes=tuple(mesh.axis_names),
        mesh_shape=tuple(int(s) for s in mesh.devices.shape), node_of_position=nodes,
        num_tokens=t_local, num_peers=ep, experts_per_peer=el, row_slots=j,
        budget=dp.make_budget(t_local, cfg.top_k, cfg.num_experts, ep, cfg.ragged_buffer_factor),
        overflow=cfg.overflow, row_bytes=cfg.d_model * jnp.dtype(dtype).itemsize, entry_bytes=8)


def _one_round(r, x_TD, w_TK, experts, state, spec: DispatcherSpec, ctx: EPContext):
    from dropless.moe.layer import expert_ffn
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
    """(node id of each peer on my expert axis [P], my index on that axis)."""
    table = jnp.asarray(np.asarray(ctx.node_of_position, np.int32).reshape(ctx.mesh_shape))
    idx = [lax.axis_index(a) for a in ctx.all_axes]
    e = ctx.all_axes.index(ctx.expert_axis)
    me = idx[e]
    idx[e] = slice(None)
    return table[tuple(idx)], me


def _stats(state, rounds, spec: DispatcherSpec, ctx: EPContext) -> dict[str, jax.Array]:
    """Per-layer traffic and buffer statistics, summed (or maxed) over all devices.

    Rows are counted once per direction (combine moves the same rows back). `*_no_dedup` is what
    a dispatcher sending one row per (token, choice) would move. Load and headroom refer to the
    a2a budget (rows and entries per peer per round) whatever the dispatcher.
    """
    plan = state.plan if spec.name == "allgather" else state
    counts_P, routed_P = plan.counts_P, plan.routed_P
    late_P = jnp.sum(plan.hit_TP & (plan.round_TP > 0), axis=0)   # rows beyond round 0
    if spec.name == "allgather":
        sent_P = jnp.full_like(counts_P, ctx.num_tokens)
    elif ctx.overflow == "error":
        sent_P = counts_P - late_P
    else:
        sent_P = counts_P
    nodes_P, me = _peer_nodes(ctx)
    remote_P = jnp.arange(ctx.num_peers) != me
    intra_P = remote_P & (nodes_P == nodes_P[me])
    inter_P = nodes_P != nodes_P[me]
    s = lambda v: lax.psum(jnp.sum(v).astype(jnp.float32), ctx.all_axes)
    over = s(late_P)
    load = lax.pmax(jnp.max(plan.cost_P), ctx.all_axes) / ctx.budget.units[2]
    stats = {
        "rows_sent": s(sent_P), "rows_routed": s(routed_P),
        "padding_rows": s(rounds * spec.buffer_rows(ctx) * ctx.num_peers) - s(sent_P),
        "rounds": rounds.astype(jnp.int32),
        "buffer_headroom": 1.0 - load.astype(jnp.float32),
        "overflow_rows": over,
        "dropped_rows": over if ctx.overflow == "error" and spec.name != "allgather"
        else jnp.zeros((), jnp.float32),
        "sufficient_buffer_factor": (load * ctx.cfg.ragged_buffer_factor).astype(jnp.float32),
        "rows_intra_node": s(jnp.where(intra_P, sent_P, 0)),
        "rows_inter_node": s(jnp.where(inter_P, sent_P, 0)),
        "rows_intra_node_no_dedup": s(jnp.where(intra_P, routed_P, 0)),
        "rows_inter_node_no_dedup": s(jnp.where(inter_P, routed_P, 0)),
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
    if ctx.max_rounds > 1 and ctx.overflow == "rounds" and spec.name != "allgather":
        y_TD = y_TD + _rounds(x_TD, w_TK, experts, state, rounds, spec, ctx)
    return y_TD, _stats(state, rounds, spec, ctx)


def expert_parallel_experts(x_TD: jax.Array, routing: Routing, experts: dict[str, jax.Array],
                            cfg: MoEConfig, mesh: Mesh):
    """The routed experts of the MoE layer, expert-parallel over `mesh`'s `expert` axis.

    x_TD [T, D] and the routing are split over all mesh axes (tokens); experts [E, ...] over
    `expert`. Returns (y_TD f32, tokens_per_expert_E, aux) where aux holds the traffic stats
    (rows_sent, padding_rows, rounds, buffer_headroom, overflow_rows, dropped_rows,
    sufficient_buffer_factor, rows/bytes intra- and inter-node, with and without dedup).
    Raises ValueError for a bad mesh, token count or dispatcher (see make_context).
    """
    name = resolve_dispatcher(cfg.dispatcher)
    sizes_E = expert_counts(routing.ids_TK, cfg.num_experts)
    if name == "local":
        from dropless.moe.layer import dropless_experts
        y_TD, _ = dropless_experts(x_TD, routing, experts, cfg)
        return y_TD, sizes_E, {}
    spec = DISPATCHERS[name]
    ctx = make_context(cfg, mesh, x_TD.shape[0], x_TD.dtype)
    tok = PartitionSpec(ctx.all_axes)
    exp_specs = {k: PartitionSpec(EXPERT_AXIS) for k in experts}
    fn = jax.shard_map(functools.partial(_per_device, spec=spec, ctx=ctx), mesh=mesh,
                       in_specs=(tok, tok, tok, exp_specs), out_specs=(tok, PartitionSpec()),
                       check_vma=False)
    y_TD, stats = fn(x_TD, routing.weights_TK, routing.ids_TK, experts)
    return y_TD, sizes_E, stats


class BufferOverflowError(RuntimeError):
    """A static receive buffer overflowed under overflow="error"; the step must not apply."""


def should_check_overflow(step: int, cfg: MoEConfig) -> bool:
    """Whether the host reads the overflow flag at `step` (every overflow_check_every_n_steps)."""
    return cfg.overflow == "error" and step % cfg.overflow_check_every_n_steps == 0


def check_overflow(aux: dict[str, Any], *, layer: str, cfg: MoEConfig) -> None:
    """Raise BufferOverflowError if the layer's buffers dropped rows (host sync: call it every
    overflow_check_every_n_steps). The message names the layer, the rows that overflowed and
    the ragged_buffer_factor that would have been enough."""
    dropped = int(np.asarray(aux.get("dropped_rows", 0)))
    if dropped <= 0:
        return
    need = float(np.asarray(aux["sufficient_buffer_factor"]))
    enough = math.ceil(need * 10) / 10
    raise BufferOverflowError(
        f"{layer}: {dropped} rows overflowed the expert-parallel receive buffers "
        f"(MoEConfig.ragged_buffer_factor={cfg.ragged_buffer_factor}); "
        f"ragged_buffer_factor={enough} would have been enough, or use overflow='rounds'")
