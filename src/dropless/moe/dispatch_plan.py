"""Deduplicated send plan: one row per (token, destination device), in static per-peer chunks.

Legend: T local tokens, D model dim, K top-k, P peers on the expert axis (EP ranks), El experts
per peer, J = min(K, El) expert slots a row can carry, C rows per peer per round (the chunk),
S = P*C slots of one round's send buffer. Everything here works on one device's local arrays
and has no collectives.

Expert e lives on peer e // El as local expert e % El. A token with several choices on one
peer travels to it once; the row carries the local expert ids (sentinel El = "no expert") and
combine weights of those choices. Hand-worked, P=2, El=2 (experts 0,1 on peer 0; 2,3 on 1),
K=2, T=3:
  ids_TK = [[0, 1], [1, 2], [3, 2]]
  hit_TP = [[1, 0], [1, 1], [0, 1]]    token 0 goes to peer 0 only, once (not twice)
  rank_TP = [[0, -], [1, 0], [-, 1]]   its row's place in the peer's chunk, in token order
  counts_P = [2, 2]                    4 rows instead of 6 routed (token, choice) rows
  round 0 with C=2: src_PC = [[0, 1], [1, 2]]; row (peer 0, slot 0) carries local ids [0, 1].
With C=1 the same plan takes two rounds: round 0 sends tokens [[0], [1]], round 1 [[1], [2]].
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp


class SendPlan(NamedTuple):
    """Where each token's row goes; all int32 on device, shapes static."""

    hit_TP: jax.Array      # bool: token t has at least one choice on peer p
    rank_TP: jax.Array     # place of row (t, p) among peer p's rows (token order); junk if !hit
    counts_P: jax.Array    # deduplicated rows to each peer
    routed_P: jax.Array    # (token, choice) rows to each peer: what travels without dedup
    dest_TK: jax.Array     # peer of each choice
    lid_TK: jax.Array      # local expert id of each choice on its peer


class RoundSlots(NamedTuple):
    """One round's send buffer layout: which token fills each slot and what it carries."""

    src_S: jax.Array       # token index per slot; T (out of range) marks an empty slot
    lid_SJ: jax.Array      # local expert ids carried by the row; El marks an unused entry
    k_SJ: jax.Array        # which of the token's K choices each entry is (for its weight)


def make_plan(ids_TK: jax.Array, num_peers: int, experts_per_peer: int) -> SendPlan:
    """Deduplicate (token, choice) rows into (token, peer) rows and rank them per peer."""
    ids_TK = ids_TK.astype(jnp.int32)
    dest_TK = ids_TK // experts_per_peer
    lid_TK = ids_TK % experts_per_peer
    onehot_TKP = dest_TK[:, :, None] == jnp.arange(num_peers, dtype=jnp.int32)
    routed_TP = jnp.sum(onehot_TKP, axis=1, dtype=jnp.int32)
    hit_TP = routed_TP > 0
    rank_TP = jnp.cumsum(hit_TP, axis=0, dtype=jnp.int32) - 1
    counts_P = jnp.sum(hit_TP, axis=0, dtype=jnp.int32)
    return SendPlan(hit_TP, rank_TP, counts_P, jnp.sum(routed_TP, axis=0), dest_TK, lid_TK)


def slots_per_row(top_k: int, experts_per_peer: int) -> int:
    """J: a row carries at most min(K, El) choices (a token's choices are distinct experts)."""
    return min(top_k, experts_per_peer)


def chunk_rows(num_tokens: int, top_k: int, num_peers: int, factor: float) -> int:
    """C, rows per peer per round: factor x the balanced load T*K/P, at least 1, at most T.

    T is enough for any routing (after dedup a peer gets at most one row per token), so with a
    chunk of T one round always suffices.
    """
    balanced = num_tokens * top_k / num_peers
    return int(min(num_tokens, max(1, math.ceil(factor * balanced))))


def rounds_needed(counts_P: jax.Array, chunk: int) -> jax.Array:
    """Rounds this device needs so every row fits: max over peers of ceil(count / C), >= 1."""
    return jnp.maximum(1, jnp.max((counts_P + chunk - 1) // chunk)).astype(jnp.int32)


def round_slots(plan: SendPlan, r: jax.Array, chunk: int, experts_per_peer: int,
                row_slots: int) -> RoundSlots:
    """The send buffer of round r: rows of rank in [r*C, (r+1)*C) go to slot rank - r*C."""
    t, p = plan.hit_TP.shape
    in_round_TP = plan.hit_TP & (plan.rank_TP // chunk == r)
    c_TP = jnp.where(in_round_TP, plan.rank_TP - r * chunk, chunk)  # chunk: out of range, dropped
    tok_TP = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[:, None], (t, p))
    peer_TP = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32)[None, :], (t, p))
    src_PC = jnp.full((p, chunk), t, jnp.int32).at[peer_TP, c_TP].set(tok_TP, mode="drop")
    src_S = src_PC.reshape(-1)
    peer_S = jnp.repeat(jnp.arange(p, dtype=jnp.int32), chunk)
    # the row's choices on its peer, first J of them; the rest are marked unused
    dest_SK = jnp.take(plan.dest_TK, src_S, axis=0, mode="fill", fill_value=-1)
    mine_SK = dest_SK == peer_S[:, None]
    k_SJ = jnp.argsort(~mine_SK, axis=1, stable=True)[:, :row_slots].astype(jnp.int32)
    used_SJ = jnp.take_along_axis(mine_SK, k_SJ, axis=1)
    lid_SK = jnp.take(plan.lid_TK, src_S, axis=0, mode="fill", fill_value=experts_per_peer)
    lid_SJ = jnp.where(used_SJ, jnp.take_along_axis(lid_SK, k_SJ, axis=1), experts_per_peer)
    return RoundSlots(src_S, lid_SJ.astype(jnp.int32), k_SJ)


def slot_weights(weights_TK: jax.Array, slots: RoundSlots, experts_per_peer: int) -> jax.Array:
    """[S, J] combine weights of the entries each row carries (0 for unused entries/slots)."""
    w_SK = jnp.take(weights_TK, slots.src_S, axis=0, mode="fill", fill_value=0)
    w_SJ = jnp.take_along_axis(w_SK, slots.k_SJ, axis=1)
    return jnp.where(slots.lid_SJ < experts_per_peer, w_SJ, jnp.zeros_like(w_SJ))
