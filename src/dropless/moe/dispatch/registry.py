"""The dispatcher registry: named strategies sharing one contract, and how a name resolves.

A dispatcher is a DispatcherSpec (functions take the EPContext last):
  state = prepare(ids_TK)                       routing-only bookkeeping, no gradients
  rounds(state)                                 rounds all devices agree on (on device)
  x_ND, group_sizes_El, meta = dispatch(x_TD, w_TK, state, r)   expert-major rows of round r
                                        (the module's dispatch moves an array or MXRows with
                                        rows.each; the spec's quantizes first: `quantizing`)
  y_TD += combine(expert_ffn(x_ND, group_sizes_El), meta)      back in token order
`state` is the strategy's own NamedTuple (spec.state_type), `meta` another (spec.meta_type);
everything else the shard_map boundary asks of a strategy is a field of its spec.
Legend: T local tokens, D model dim, K top-k, El local experts, N rows entering the grouped
matmul. One file per strategy in this package; `expert_parallel.py` is the shard_map boundary.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

from dropless import config
from dropless.moe.dispatch import a2a, allgather as ag, node_a2a as na, ragged_a2a as ra
from dropless.moe.dispatch.send_plan import SendPlan
from dropless.moe.experts import quantized_rows


@dataclasses.dataclass(frozen=True, kw_only=True)
class DispatcherSpec:
    """A registered dispatcher: its four functions (each takes the EPContext last) and what the
    shard_map boundary (`expert_parallel.py`) needs to know of it, so that nothing there tests
    a strategy's name.

    name, description: what `MoEConfig.dispatcher` says and what it does (config's
      DISPATCH_STRATEGIES, where both are written).
    prepare, rounds, dispatch, combine: the contract in the module docstring.
    state_type: the NamedTuple `prepare` returns (carried unchanged through all rounds).
    meta_type: the NamedTuple `dispatch` returns as metadata and `combine` consumes.
    device_plan: state -> its (token, device) SendPlan, the rows the traffic stats count.
    replicates_tokens: every token travels to every peer of the EP group (rows sent = T per
      peer), not only to the peers its choices name.
    overflows: its static buffers can be exceeded: extra rounds under overflow="rounds", rows
      dropped (and counted) under overflow="error". False: one round always holds any routing.
    unsupported_on: platforms where it cannot compile.
    buffer_rows: ctx -> row slots it fills per peer per round (for `padding_rows`).
    split_nodes: runs on the mesh with `expert` split at node boundaries.
    traffic: (state, ctx) -> its own row accounting by link; None: one hop's, from device_plan.
    """

    name: str
    description: str
    prepare: Callable[..., Any]
    rounds: Callable[..., jax.Array]
    dispatch: Callable[..., tuple]
    combine: Callable[..., jax.Array]
    state_type: type
    meta_type: type
    device_plan: Callable[[Any], SendPlan]
    replicates_tokens: bool = False
    overflows: bool = True
    unsupported_on: tuple[str, ...] = ()
    buffer_rows: Callable[..., int] = lambda ctx: ctx.budget.row_chunk
    split_nodes: bool = False
    traffic: Callable[..., dict] | None = None


def quantizing(dispatch: Callable[..., tuple]) -> Callable[..., tuple]:
    """A strategy's dispatch that, when ctx.cfg.dispatch_quantization is "mxfp8", quantizes the
    rows once before they travel: x_ND is then MXRows (FP8 codes + scales went over the wire)
    whose gradient comes back in the activation dtype (moe.experts.quantized_rows)."""
    @functools.wraps(dispatch)
    def wrapped(x_TD, w_TK, state, r, ctx):
        move = lambda x, w, state, r: dispatch(x, w, state, r, ctx)
        return quantized_rows(move, x_TD, w_TK, state, r, cfg=ctx.cfg)
    return wrapped


def _itself(plan: SendPlan) -> SendPlan:
    return plan


def _implements(name: str, **fields: Any) -> DispatcherSpec:
    """The spec of config's strategy `name` (config.DISPATCH_STRATEGIES: its name and
    description) with its implementation `fields`; its dispatch honours dispatch_quantization
    (`quantizing`)."""
    fields["dispatch"] = quantizing(fields["dispatch"])
    return DispatcherSpec(name=name, description=config.DISPATCH_STRATEGIES[name], **fields)


DISPATCHERS: dict[str, DispatcherSpec] = {spec.name: spec for spec in (
    _implements(
        "allgather",
        prepare=ag.allgather_prepare, rounds=ag.allgather_rounds,
        dispatch=ag.allgather_dispatch, combine=ag.allgather_combine,
        state_type=ag.AllGatherState, meta_type=ag.AllGatherMeta,
        device_plan=lambda state: state.plan, replicates_tokens=True, overflows=False,
        buffer_rows=lambda ctx: ctx.num_tokens),
    _implements(
        "a2a",
        prepare=a2a.a2a_prepare, rounds=a2a.a2a_rounds,
        dispatch=a2a.a2a_dispatch, combine=a2a.a2a_combine,
        state_type=SendPlan, meta_type=a2a.A2AMeta, device_plan=_itself),
    _implements(
        "ragged_a2a",
        prepare=a2a.a2a_prepare, rounds=a2a.a2a_rounds,
        dispatch=ra.ragged_dispatch, combine=ra.ragged_combine,
        state_type=SendPlan, meta_type=ra.RaggedA2AMeta, device_plan=_itself,
        unsupported_on=("cpu",)),
    _implements(
        "node_a2a",
        prepare=na.node_prepare, rounds=na.node_rounds,
        dispatch=na.node_dispatch, combine=na.node_combine,
        state_type=na.NodeA2AState, meta_type=na.NodeA2AMeta,
        device_plan=lambda state: state.devices,
        buffer_rows=na.node_buffer_rows, split_nodes=True, traffic=na.node_traffic),
)}
if set(DISPATCHERS) != set(config.DISPATCH_STRATEGIES):   # every strategy config accepts
    raise ImportError(f"config.DISPATCH_STRATEGIES names {sorted(config.DISPATCH_STRATEGIES)} "
                      f"but moe/dispatch/registry.py implements {sorted(DISPATCHERS)}")
LOCAL = "local"   # no dispatcher: the single-device layer (MoEConfig.dispatcher="local")
GPU_PLATFORMS = ("cuda", "rocm", "tpu")


def dispatcher_names() -> tuple[str, ...]:
    """Names accepted by MoEConfig.dispatcher with a mesh: auto, local, then the strategies
    (config.DISPATCHERS)."""
    return config.DISPATCHERS


@functools.lru_cache(maxsize=None)
def ragged_lowers(platform: str) -> bool:
    """Whether this JAX can lower ragged_all_to_all inside shard_map for `platform` (probed
    once, on a 2-device abstract mesh; nothing is compiled or run). Lowering is not compiling:
    XLA:CPU lowers it but cannot compile it, which `unsupported_on` records."""
    from jax.sharding import AbstractMesh, AxisType, PartitionSpec as P
    mesh = AbstractMesh((2,), ("x",), axis_types=(AxisType.Auto,))

    def body(v):
        n = jnp.ones((2,), jnp.int32)
        off = jnp.arange(2, dtype=jnp.int32)
        return lax.ragged_all_to_all(v, jnp.zeros_like(v), off, n, off, n, axis_name="x")

    f = jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False)
    try:
        jax.jit(f).trace(jax.ShapeDtypeStruct((4,), jnp.float32)).lower(
            lowering_platforms=(platform,))
    except Exception:   # any failure means "not on this platform"  # noqa: BLE001
        return False
    return True


def platform_choices(name: str, *, num_nodes: int = 1) -> dict[str, str]:
    """What `name` resolves to on each platform a function may be lowered for. The dispatcher
    picks among these with lax.platform_dependent, at lowering time (so a function lowered for
    CUDA on a CPU host gets the CUDA choice)."""
    return {p: resolve_dispatcher(name, p, num_nodes=num_nodes)
            for p in ("cpu",) + GPU_PLATFORMS
            if name == "auto" or p not in DISPATCHERS.get(name, DISPATCHERS["a2a"]).unsupported_on}


def resolve_dispatcher(name: str, platform: str | None = None, *, num_nodes: int = 1) -> str:
    """The strategy a name means on `platform` (default: JAX's default backend).

    `auto`: `node_a2a` when the EP group spans several nodes of several devices (num_nodes > 1);
    otherwise `ragged_a2a` on GPU/TPU when ragged_all_to_all lowers there (ragged_lowers), else
    `a2a`. Raises ValueError for an unknown name or a dispatcher the platform cannot compile.
    """
    platform = platform or jax.default_backend()
    if name == "auto":
        if num_nodes > 1:
            return "node_a2a"
        if platform in GPU_PLATFORMS and ragged_lowers(platform):
            return "ragged_a2a"
        return "a2a"
    if name == LOCAL:
        return name
    if name not in DISPATCHERS:
        raise ValueError(f"MoEConfig.dispatcher={name!r} is unknown; known: "
                         f"{', '.join(dispatcher_names())}")
    if platform in DISPATCHERS[name].unsupported_on:
        raise ValueError(f"MoEConfig.dispatcher={name!r} is not supported on {platform}: XLA:"
                         f"{platform.upper()} cannot compile ragged-all-to-all; use 'a2a'")
    return name
