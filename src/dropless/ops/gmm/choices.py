"""What `auto` may choose and what was chosen: the scope the grouped-matmul registry reads.

Legend: M rows, K contraction dim, N output dim, G groups.

One context variable holds the backends `auto` must not use (per shape or for every shape),
the stand-ins tried first, and the list where traced choices are recorded. `registry.py`
decides with it; `tokamax_backend.py` records what tokamax ran into it; `fallback.py` sets it.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Iterator

import jax.numpy as jnp

from dropless.ops.gmm.aliases import canonical_backend


@dataclasses.dataclass(frozen=True)
class AutoState:
    refused: frozenset = frozenset()      # (backend, shape key or None: every shape)
    events: list | None = None            # where traced choices are recorded (None: nowhere)
    first: tuple = ()                     # (platform, backend) stand-ins tried first


STATE: contextvars.ContextVar[AutoState] = contextvars.ContextVar("dropless_gmm_auto",
                                                                    default=AutoState())


@contextlib.contextmanager
def auto_scope(*, refused: frozenset = frozenset(), events: list | None = None) -> Iterator[None]:
    """Within the block, `auto` skips the `refused` (backend, shape key) pairs (shape key None:
    every shape; keys from `shape_key`; an old backend name counts as its new one), and
    functions traced record their grouped-matmul choices in `events` (dicts: asked, backend,
    shape, and platform for `auto`, implementation or reason for `tokamax`). Nested scopes add
    to the outer one's refusals."""
    outer = STATE.get()
    refused = frozenset((canonical_backend(b), shape) for b, shape in refused)
    token = STATE.set(dataclasses.replace(
        outer, refused=outer.refused | refused,
        events=events if events is not None else outer.events))
    try:
        yield
    finally:
        STATE.reset(token)


def note(event: dict) -> None:
    """Record a traced grouped-matmul choice in the active `auto_scope(events=...)`, if any."""
    events = STATE.get().events
    if events is not None:
        events.append(event)


def shape_key(lhs_MK, rhs_GKN, group_sizes_G, out_dtype) -> tuple:
    """A hashable description of one grouped matmul's operands: (lhs shape, dtype, rhs shape,
    dtype, group sizes dtype, output dtype); `fallback.kernel_problem` rebuilds operands from it."""
    return (tuple(lhs_MK.shape), str(lhs_MK.dtype), tuple(rhs_GKN.shape), str(rhs_GKN.dtype),
            str(group_sizes_G.dtype), str(jnp.dtype(out_dtype)))


