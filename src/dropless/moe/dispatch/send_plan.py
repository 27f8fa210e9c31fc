"""Deduplicated send plan: one row per (token, destination device), packed into static rounds.

Legend: T local tokens, D model dim, K top-k, P peers on the expert axis (EP ranks), El experts
per peer, J = min(K, El) choices a row can carry, Cr row slots and Ce entry slots per peer per
round, S = P*Cr row slots and Q = P*Ce entry slots of one round. Everything here works on one
device's local arrays and has no collectives.

Expert e lives on peer e // El as local expert e % El. A token with several choices on one peer
travels to it once, as one *row*; each of its choices there is an *entry* (row slot, local
expert, weight) that the receiver expands into the grouped matmul. Both are bounded per peer
per round: rows by Br, entries by Be (`ragged_buffer_factor` x the balanced load). A row costs
max(Be, e*Br) in units of 1/(Br*Be) of a round (e = its entries), rows are taken in token order,
and a row goes to the round its cumulative cost ends in; a round then holds at most
Cr = Br + ceil(J*Br/Be) rows and Ce = Be + max(ceil(Be/Br), J) entries (one row may straddle).

Hand-worked, P=2, El=2 (experts 0,1 on peer 0; 2,3 on 1), K=2, T=3, Br=Be=T*K (one round):
  ids_TK = [[0, 1], [1, 2], [3, 2]]
  hit_TP = [[1, 0], [1, 1], [0, 1]]      token 0 goes to peer 0 once, not twice
  entries_TP = [[2, 0], [1, 1], [0, 2]]  rank_TP = [[0, -], [1, 0], [-, 1]]
  counts_P = [2, 2]: 4 rows instead of 6 routed (token, choice) rows
  round 0: rows src = [[0, 1], [1, 2]]; peer 0's entries: (row 0, expert 0), (row 0, expert 1),
  (row 1, expert 1) -- token 0's two choices share its one row.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp


class Budget(NamedTuple):
    """Static per-peer, per-round limits (python ints)."""

    rows: int          # Br
    entries: int       # Be
    row_chunk: int     # Cr: row slots per peer per round
    entry_chunk: int   # Ce: entry slots per peer per round
    max_rounds: int    # a bound on the rounds any routing needs

    @property
    def units(self) -> tuple[int, int, int]:
        """(cost of a row's base, cost per entry, cost of a round), divided by gcd(Br, Be) to
        keep the int32 cumulative costs small."""
        g = math.gcd(self.rows, self.entries)
        return self.entries // g, self.rows // g, self.rows * self.entries // g


class SendPlan(NamedTuple):
    """Where each token's row goes; int32/bool on device, shapes static."""

    hit_TP: jax.Array      # token t has at least one choice on peer p
    entries_TP: jax.Array  # choices of token t on peer p (the row's entries)
    rank_TP: jax.Array     # place of row (t, p) among peer p's rows (token order)
    round_TP: jax.Array    # round the row travels in (junk where !hit)
    counts_P: jax.Array    # deduplicated rows to each peer
    routed_P: jax.Array    # (token, choice) rows to each peer: what travels without dedup
    cost_P: jax.Array      # total cost of the rows to each peer
    dest_TK: jax.Array     # peer of each choice
    lid_TK: jax.Array      # local expert id of each choice on its peer


class RoundSlots(NamedTuple):
    """One round's send buffers: which token fills each row slot, and the entries."""

    src_S: jax.Array       # token per row slot; T (out of range) marks an empty slot
    erow_Q: jax.Array      # row slot (within the peer's chunk) of each entry; Cr = empty
    elid_Q: jax.Array      # local expert of each entry; El = empty
    etok_Q: jax.Array      # token of each entry (T = empty), for its weight
    ek_Q: jax.Array        # which of the token's K choices the entry is


def slots_per_row(top_k: int, experts_per_peer: int) -> int:
    """J: a row carries at most min(K, El) choices (a token's choices are distinct experts)."""
    return min(top_k, experts_per_peer)


def expected_rows_per_peer(num_tokens: int, top_k: int, num_experts: int,
                           num_peers: int) -> float:
    """Deduplicated rows a peer gets under uniform routing: T * P(a token hits the peer).

    A token misses a peer when all K distinct choices fall outside its El experts:
    C(E-El, K) / C(E, K).
    """
    el = num_experts // num_peers
    miss = 1.0
    for i in range(top_k):
        miss *= max(num_experts - el - i, 0) / (num_experts - i)
    return num_tokens * (1.0 - miss)


def make_budget(num_tokens: int, top_k: int, num_experts: int, num_peers: int,
                factor: float) -> Budget:
    """Br = factor x the balanced deduplicated rows per peer, Be = factor x T*K/P entries.

    With Br >= T and Be >= T*J (a peer can never get more) one round always suffices and the
    buffers are exactly T rows and T*J entries. A peer's cumulative row cost (`make_plan`, int32)
    reaches T x max(Be, J*Br) / gcd(Br, Be) when every row goes to it with J entries; where that
    passes 2^31 (large T: DeepSeek-V3's 6 x 4096 tokens a device at EP 8), Br and Be are rounded
    up to a multiple of the smallest power of two q that brings it under, so gcd >= q (the
    buffers grow by less than q slots a peer).
    """
    t = num_tokens
    j = slots_per_row(top_k, num_experts // num_peers)
    br = max(1, math.ceil(factor * expected_rows_per_peer(t, top_k, num_experts, num_peers)))
    be = max(1, math.ceil(factor * t * top_k / num_peers))
    q = 1
    while q <= max(br, be):
        budget = _budget(t, j, -(-br // q) * q, -(-be // q) * q)
        base, per_entry, _ = budget.units
        if t * max(base, j * per_entry) < 2**31:
            return budget
        q *= 2
    raise ValueError(f"{t} local tokens overflow the int32 round accounting at "
                     f"ragged_buffer_factor={factor}; use more devices or a larger factor")


def _budget(t: int, j: int, br: int, be: int) -> Budget:
    """The Budget of Br = `br` rows and Be = `be` entries a peer per round (T = t, J = j)."""
    if br >= t and be >= t * j:
        return Budget(t, t * j, t, t * j, 1)
    cr = min(t, br + -(-j * br // be))
    ce = min(t * j, be + max(-(-be // br), j))
    worst = t * max(be, j * br)                  # every row to one peer with J entries
    return Budget(br, be, cr, ce, -(-worst // (br * be)))


def make_plan(ids_TK: jax.Array, num_peers: int, experts_per_peer: int,
              budget: Budget) -> SendPlan:
    """Deduplicate (token, choice) rows into (token, peer) rows and assign them to rounds.

    An id >= num_peers * experts_per_peer is an empty choice: it goes nowhere (node_a2a's
    second hop plans rows that carry fewer than K choices).
    """
    ids_TK = ids_TK.astype(jnp.int32)
    dest_TK = ids_TK // experts_per_peer
    lid_TK = ids_TK % experts_per_peer
    onehot_TKP = dest_TK[:, :, None] == jnp.arange(num_peers, dtype=jnp.int32)
    entries_TP = jnp.sum(onehot_TKP, axis=1, dtype=jnp.int32)
    hit_TP = entries_TP > 0
    rank_TP = jnp.cumsum(hit_TP, axis=0, dtype=jnp.int32) - 1
    base, per_entry, per_round = budget.units
    cost_TP = jnp.where(hit_TP, jnp.maximum(base, entries_TP * per_entry), 0)
    cum_TP = jnp.cumsum(cost_TP, axis=0, dtype=jnp.int32)
    round_TP = jnp.where(hit_TP, (cum_TP - 1) // per_round, 0)
    return SendPlan(hit_TP, entries_TP, rank_TP, round_TP,
                    jnp.sum(hit_TP, axis=0, dtype=jnp.int32),
                    jnp.sum(entries_TP, axis=0), cum_TP[-1], dest_TK, lid_TK)


def rounds_needed(plan: SendPlan) -> jax.Array:
    """Rounds this device needs for all its rows: 1 + the last row's round, >= 1."""
    last = jnp.max(jnp.where(plan.hit_TP, plan.round_TP, 0))
    return (last + 1).astype(jnp.int32)


def round_slots(plan: SendPlan, r: jax.Array, budget: Budget, experts_per_peer: int
                ) -> RoundSlots:
    """The send buffers of round r: rows [P, Cr] and entries [P, Ce], flattened."""
    t, p = plan.hit_TP.shape
    k = plan.dest_TK.shape[1]
    cr, ce = budget.row_chunk, budget.entry_chunk
    in_round_TP = plan.hit_TP & (plan.round_TP == r)
    before_TP = plan.hit_TP & (plan.round_TP < r)
    rows_before_P = jnp.sum(before_TP, axis=0, dtype=jnp.int32)
    entries_before_P = jnp.sum(jnp.where(before_TP, plan.entries_TP, 0), axis=0)
    slot_TP = jnp.where(in_round_TP, plan.rank_TP - rows_before_P, cr)  # cr: dropped
    tok_TP = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[:, None], (t, p))
    peer_TP = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32)[None, :], (t, p))
    src_PC = jnp.full((p, cr), t, jnp.int32).at[peer_TP, slot_TP].set(tok_TP, mode="drop")
    # entries: a row's entries are contiguous, starting after the peer's earlier entries
    start_TP = jnp.cumsum(plan.entries_TP, axis=0) - plan.entries_TP - entries_before_P
    same_TKK = plan.dest_TK[:, :, None] == plan.dest_TK[:, None, :]
    j_TK = jnp.sum(jnp.tril(same_TKK, -1), axis=2, dtype=jnp.int32)  # earlier choices, same peer
    dest_TK = plan.dest_TK
    valid_TK = dest_TK < p             # ids past the last peer are empty choices (node_a2a)
    d_TK = jnp.where(valid_TK, dest_TK, 0)
    mine_TK = jnp.take_along_axis(in_round_TP, d_TK, axis=1) & valid_TK
    pos_TK = jnp.where(mine_TK, jnp.take_along_axis(start_TP, d_TK, axis=1) + j_TK, ce)
    row_TK = jnp.take_along_axis(slot_TP, d_TK, axis=1)
    tok_TK = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[:, None], (t, k))
    k_TK = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32)[None, :], (t, k))

    def table(fill, values_TK):
        return jnp.full((p, ce), fill, jnp.int32).at[dest_TK, pos_TK].set(
            values_TK, mode="drop").reshape(-1)

    return RoundSlots(src_PC.reshape(-1), table(cr, row_TK), table(experts_per_peer,
                      plan.lid_TK), table(t, tok_TK), table(0, k_TK))


def entry_weights(weights_TK: jax.Array, slots: RoundSlots) -> jax.Array:
    """[Q] combine weight of each entry (0 for empty entries)."""
    w_QK = jnp.take(weights_TK, slots.etok_Q, axis=0, mode="fill", fill_value=0)
    return jnp.take_along_axis(w_QK, slots.ek_Q[:, None], axis=1)[:, 0]
