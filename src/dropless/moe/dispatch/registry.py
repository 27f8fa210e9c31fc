"""The dispatcher registry: named strategies sharing one contract, and how a name resolves.

A dispatcher is a DispatcherSpec (functions take the EPContext last):
  state = prepare(ids_TK)                       routing-only bookkeeping, no gradients
  rounds(state)                                 rounds all devices agree on (on device)
  x_ND, group_sizes_El, meta = dispatch(x_TD, w_TK, state, r)   expert-major rows of round r
  y_TD += combine(expert_ffn(x_ND, group_sizes_El), meta)      back in token order
Legend: T local tokens, D model dim, K top-k, El local experts, N rows entering the grouped
matmul. One file per strategy in this package; `expert_parallel.py` is the shard_map boundary.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax

from dropless.moe.dispatch import a2a, allgather as ag, ragged_a2a as ra


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
        "ragged_a2a", a2a.a2a_prepare, a2a.a2a_rounds, ra.ragged_dispatch, ra.ragged_combine,
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
