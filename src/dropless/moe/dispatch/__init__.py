"""Expert parallelism: dispatcher strategies (one file each), the shard_map boundary, overflow.

  registry.py         DispatcherSpec, DISPATCHERS, resolve_dispatcher: the named strategies
  allgather.py        `allgather`: the obviously-correct reference
  a2a.py              `a2a`: deduplicated rows over all_to_all in static per-peer chunks
  ragged_a2a.py       `ragged_a2a`: the same buffers over ragged_all_to_all (GPU/TPU)
  node_a2a.py         `node_a2a`: node-level dedup, across nodes once, then inside the node
  send_plan.py, rows.py  the dedup send plan and the row exchange primitives they share
  context.py          EPContext: static facts checked against the mesh; nodes of a mesh
  expert_parallel.py  the one shard_map boundary, overflow rounds, traffic stats
The host-side check of overflow="error" is the trainer's (dropless.train.overflow).
"""
from dropless.moe.dispatch.context import EXPERT_AXIS, EPContext, make_context
from dropless.moe.dispatch.expert_parallel import expert_parallel_experts
from dropless.moe.dispatch.registry import (DISPATCHERS, DispatcherSpec, dispatcher_names,
                                            resolve_dispatcher)

__all__ = ["EXPERT_AXIS", "EPContext", "make_context", "expert_parallel_experts", "DISPATCHERS",
           "DispatcherSpec", "dispatcher_names", "resolve_dispatcher"]
