"""Dispatch overlapped with the expert matmuls: a layer's tokens in k independent chunks.

Legend: T local tokens (inside the shard_map), D model dim, K top-k, k = chunks,
Tc = T/k tokens of one chunk.

`MoEConfig.ep_comm_overlap_chunks = k` splits each device's tokens into k contiguous chunks of
Tc and runs the whole expert-parallel pipeline of a chunk (its plan, its rounds, dispatch,
expert FFN, combine) on that chunk alone, inside the dispatcher's one shard_map. Chunk c's
collectives read only chunk c's rows and routing, so nothing orders them after chunk c-1's
grouped matmul: XLA's latency-hiding scheduler is free to start the dispatch of chunk c+1 and
the combine of chunk c-1 while chunk c computes (the schedule a GPU compile produces is what
tests/moe/dispatch/test_overlap.py inspects). The chunks are unrolled in Python, not looped:
a while loop would order its iterations.

A token's output is computed by the same operations, in the same order, as with k = 1, so the
forward pass is unchanged (bitwise in f32 where the grouped matmul's rows do not depend on the
other rows in its batch); gradients of the expert weights sum k partial sums (float rounding).
Each chunk sizes its buffers for Tc tokens (send_plan.Budget at `ragged_buffer_factor`) and
agrees on its own overflow rounds, so a skewed chunk takes extra rounds and the others do not.
Code here runs inside the dispatcher's shard_map, on local arrays.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

SCOPE = "ep_chunk"   # chunk c's ops carry op_name .../ep_chunk{c}/... in HLO metadata

# How each traffic statistic of parts of a batch (the chunks here, the trainer's micro-batches)
# combines into the whole batch's (expert_parallel._stats names them): counts add up; these do
# not.
NOT_SUMMED = {"rounds": jnp.max,                     # the most rounds any part ran
              "buffer_headroom": jnp.min,            # the fullest part's headroom
              "sufficient_buffer_factor": jnp.max}   # the factor every part would fit in


def chunk_tokens(num_tokens: int, num_devices: int, chunks: int) -> int:
    """Global tokens of one chunk (the EPContext is built for them): num_tokens / chunks.

    Raises ValueError when the chunks do not split each device's tokens evenly (tokens that do
    not split over the devices are make_context's to refuse).
    """
    if num_tokens % num_devices == 0 and (num_tokens // num_devices) % chunks:
        raise ValueError(f"MoEConfig.ep_comm_overlap_chunks={chunks} does not divide the "
                         f"{num_tokens} tokens into equal chunks on each of {num_devices} "
                         f"devices ({num_tokens / num_devices:g} tokens per device); use a "
                         f"divisor of the per-device token count")
    return num_tokens // chunks


def merge_stats(stats: list[dict[str, jax.Array]]) -> dict[str, jax.Array]:
    """The layer's traffic statistics from its chunks': sums, except `NOT_SUMMED`'s keys."""
    out = {}
    for key in stats[0]:
        values = jnp.stack([s[key] for s in stats])
        out[key] = NOT_SUMMED.get(key, jnp.sum)(values, axis=0).astype(values.dtype)
    return out


def chunked(body: Callable, chunks: int) -> Callable:
    """`body` (x_TD, w_TK, ids_TK, experts) -> (y_TD, stats), run on `chunks` contiguous token
    chunks one after another in program order and joined: y_TD concatenated, stats merged.
    `body` must be built for Tc = T/chunks tokens. chunks = 1 returns `body` itself."""
    if chunks == 1:
        return body

    def one(c, x_TD, w_TK, ids_TK, experts):
        tc = x_TD.shape[0] // chunks
        part = slice(c * tc, (c + 1) * tc)
        with jax.named_scope(f"{SCOPE}{c}"):   # names the chunk in HLO metadata and profiles
            # each chunk its own handle on the weights: XLA's dot merger would otherwise join
            # the chunks' grouped matmuls (they share the weight operand) into one matmul
            # that waits for every chunk's dispatch. The chunk's rows ride along so that no
            # two chunks' barriers are alike (CSE would merge them). It copies nothing.
            x_cD, own_experts = lax.optimization_barrier((x_TD[part], experts))
            return body(x_cD, w_TK[part], ids_TK[part], own_experts)

    def run(x_TD, w_TK, ids_TK, experts):
        outs = [one(c, x_TD, w_TK, ids_TK, experts) for c in range(chunks)]
        y_TD = jnp.concatenate([y for y, _ in outs], axis=0)
        return y_TD, merge_stats([s for _, s in outs])

    return run
