"""Deduplication plan and the fused exchange, by hand and by property.

Legend: T tokens, K top-k, P peers, El experts per peer, C chunk rows, S = P*C slots, D dim.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from dropless import MoEConfig
from dropless.config import MeshConfig
from dropless.moe.dispatch import rows as fused
from dropless.moe.dispatch import send_plan as sp
from dropless.moe.dispatch import expert_parallel_experts
from dropless.moe.experts import dropless_experts
from dropless.moe.layer import init_params
from dropless.moe.router import Routing
from dropless.parallel import NodeMesh, make_mesh


ONE_ROUND = sp.Budget(rows=3, entries=6, row_chunk=3, entry_chunk=6, max_rounds=1)


def test_plan_hand_worked():
    # the module docstring's example: P=2, El=2, K=2, T=3, budgets large enough for one round
    plan = sp.make_plan(jnp.asarray([[0, 1], [1, 2], [3, 2]]), 2, 2, ONE_ROUND)
    np.testing.assert_array_equal(plan.hit_TP, [[1, 0], [1, 1], [0, 1]])
    np.testing.assert_array_equal(plan.entries_TP, [[2, 0], [1, 1], [0, 2]])
    np.testing.assert_array_equal(plan.counts_P, [2, 2])   # 4 rows, not 6
    np.testing.assert_array_equal(plan.routed_P, [3, 3])
    np.testing.assert_array_equal(np.where(plan.hit_TP, plan.rank_TP, -1), [[0, -1], [1, 0],
                                                                             [-1, 1]])
    assert int(sp.rounds_needed(plan)) == 1
    s = sp.round_slots(plan, 0, ONE_ROUND, experts_per_peer=2)
    np.testing.assert_array_equal(s.src_S, [0, 1, 3, 1, 2, 3])        # T=3 marks empty
    # peer 0's entries: token 0's two choices share row slot 0; token 1's choice is in slot 1
    np.testing.assert_array_equal(s.erow_Q[:6], [0, 0, 1, 3, 3, 3])    # Cr=3 marks empty
    np.testing.assert_array_equal(s.elid_Q[:6], [0, 1, 1, 2, 2, 2])
    np.testing.assert_array_equal(s.erow_Q[6:9], [0, 1, 1])            # peer 1: tokens 1, 2
    np.testing.assert_array_equal(s.elid_Q[6:9], [0, 1, 0])            # experts 2, 3, 2
    w = sp.entry_weights(jnp.asarray([[0.6, 0.4], [0.7, 0.3], [0.9, 0.1]]), s)
    np.testing.assert_allclose(w[:3], [0.6, 0.4, 0.7])
    np.testing.assert_allclose(w[6:9], [0.3, 0.9, 0.1])


def test_plan_rounds_by_cost():
    """Br=Be=1 (units 1, 1, 1): a row costs max(1, entries), one unit per round.
    T=3, P=2, El=1, K=1, all to peer 0: rows of cost 1 -> rounds 0, 1, 2; peer 1 empty."""
    b = sp.Budget(rows=1, entries=1, row_chunk=2, entry_chunk=2, max_rounds=3)
    plan = sp.make_plan(jnp.asarray([[0], [0], [0]]), 2, 1, b)
    np.testing.assert_array_equal(plan.round_TP[:, 0], [0, 1, 2])
    assert int(sp.rounds_needed(plan)) == 3
    s = sp.round_slots(plan, 1, b, experts_per_peer=1)
    np.testing.assert_array_equal(s.src_S, [1, 3, 3, 3])   # round 1 carries token 1 only
    np.testing.assert_array_equal(s.erow_Q, [0, 2, 2, 2])


def test_make_budget():
    # E=16, K=2, P=8, T=8: a peer is hit with prob 1 - (14/16)(13/15) -> 1.93 rows expected
    b = sp.make_budget(8, 2, 16, 8, factor=1.0)
    assert (b.rows, b.entries) == (2, 2)
    assert (b.row_chunk, b.entry_chunk) == (2 + 2, 2 + 2)   # + one straddling row
    assert b.max_rounds == 8                                # all 8 rows, 2 entries, one peer
    # factor large enough: one round, buffers exactly T rows and T*J entries
    assert sp.make_budget(8, 2, 16, 8, factor=8.0) == sp.Budget(8, 16, 8, 16, 1)
    assert sp.expected_rows_per_peer(64, 8, 64, 8) == pytest.approx(
        64 * (1 - np.prod([(56 - i) / (64 - i) for i in range(8)])))


# (T, K, E, P, factor) where T x max(Be, J*Br) / gcd(Br, Be) of the unrounded budget passes
# 2^31: DeepSeek-V3's reference layout (6 x 4096 tokens a device, EP 8 of 256 experts),
# deepseek3-1gpu's batch at EP 4, a long local batch
LARGE = [(24576, 8, 256, 8, 2.0), (16384, 8, 64, 4, 2.0), (16384, 8, 64, 4, 1.5),
         (196608, 8, 256, 8, 2.0)]


@pytest.mark.parametrize("t,k,e,peers,factor", LARGE)
def test_a_large_batchs_budget_is_rounded_so_the_int32_accounting_fits(t, k, e, peers, factor):
    """Br and Be rounded up to a multiple of a small power of two (their gcd grows): the worst
    cumulative cost, every row on one peer with J entries, is under 2^31; the budget is under
    0.5% over factor x the balanced load."""
    j = sp.slots_per_row(k, e // peers)
    br = np.ceil(factor * sp.expected_rows_per_peer(t, k, e, peers))
    be = np.ceil(factor * t * k / peers)
    assert t * max(be, j * br) / np.gcd(int(br), int(be)) >= 2**31   # the case at hand
    b = sp.make_budget(t, k, e, peers, factor)
    base, per_entry, _ = b.units
    assert t * max(base, j * per_entry) < 2**31
    assert br <= b.rows < br * 1.005 and be <= b.entries < be * 1.005


@pytest.mark.parametrize("routing", ["uniform", "one_peer"])
def test_the_reference_layouts_plan_counts_its_costs_without_wrapping(routing):
    """make_plan at DeepSeek-V3's reference layout (24576 tokens, top-8 of 256 experts, EP 8),
    against the same accounting in int64 numpy: uniform routing, and the worst case (every
    token's 8 choices on peer 0): no cumulative cost wraps, every row's round is the exact
    one, within the budget's max_rounds and its slots."""
    t, k, e, peers = 24576, 8, 256, 8
    rng = np.random.default_rng(0)
    if routing == "uniform":
        ids = np.stack([rng.permutation(e)[:k] for _ in range(t)])
    else:
        ids = np.stack([rng.permutation(e // peers)[:k] for _ in range(t)])
    b = sp.make_budget(t, k, e, peers, 2.0)
    plan = sp.make_plan(jnp.asarray(ids, jnp.int32), peers, e // peers, b)
    base, per_entry, per_round = b.units
    entries = np.stack([(ids // (e // peers) == p).sum(1) for p in range(peers)], 1)
    cost = np.where(entries > 0, np.maximum(base, entries.astype(np.int64) * per_entry), 0)
    cum = np.cumsum(cost, axis=0)
    assert cum.max() < 2**31
    np.testing.assert_array_equal(np.asarray(plan.cost_P), cum[-1])
    rounds = np.where(entries > 0, (cum - 1) // per_round, 0)
    np.testing.assert_array_equal(np.asarray(plan.round_TP), rounds)
    assert rounds.max() < b.max_rounds
    hit = entries > 0
    for r in range(rounds.max() + 1):
        here = hit & (rounds == r)
        assert (here.sum(0) <= b.row_chunk).all()
        assert (np.where(here, entries, 0).sum(0) <= b.entry_chunk).all()


@settings(max_examples=12, deadline=None)
@given(st.data())
def test_every_choice_travels_exactly_once_within_buffers(data):
    # few distinct shapes, so the eager ops compile a handful of times (CI time)
    peers = data.draw(st.sampled_from([1, 4]))
    el = data.draw(st.sampled_from([1, 3]))
    e = peers * el
    k = data.draw(st.sampled_from([1, min(e, 3)]))
    t = data.draw(st.sampled_from([1, 7]))
    factor = data.draw(st.sampled_from([0.3, 1.0, 2.0]))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    ids = np.stack([rng.permutation(e)[:k] for _ in range(t)])
    b = sp.make_budget(t, k, e, peers, factor)
    plan = sp.make_plan(jnp.asarray(ids), peers, el, b)
    rounds = int(sp.rounds_needed(plan))
    assert rounds <= b.max_rounds
    seen, pairs = [], []
    for r in range(rounds):
        s = sp.round_slots(plan, r, b, el)
        src = np.asarray(s.src_S).reshape(peers, b.row_chunk)
        for q, (row, lid, tok, kk) in enumerate(zip(*(np.asarray(a) for a in (
                s.erow_Q, s.elid_Q, s.etok_Q, s.ek_Q)))):
            peer = q // b.entry_chunk
            if row == b.row_chunk:
                assert lid == el and tok == t
                continue
            assert src[peer, row] == tok                       # the entry's row is its token's
            assert ids[tok, kk] == peer * el + lid
            seen.append((tok, kk))
        pairs += [(tok, p) for p in range(peers) for tok in src[p] if tok < t]
    assert sorted(seen) == [(a, c) for a in range(t) for c in range(k)]  # nothing dropped
    assert len(pairs) == len(set(pairs)) == int(np.sum(plan.counts_P))   # deduplicated


@functools.lru_cache(maxsize=None)
def _mesh8():
    return make_mesh(MeshConfig(expert=8))


@pytest.mark.parametrize("which", ["send", "return", "gather", "sum"])
def test_fused_exchange_vjp_equals_autodiff(which):
    """The hand-written transposes of send_rows/return_rows against autodiff of the plain ops."""
    mesh, t, c, d = _mesh8(), 3, 2, 4
    rng = np.random.default_rng(0)
    src = jnp.asarray(rng.integers(0, t + 1, size=(8 * 8 * c,)), jnp.int32)  # T = empty slot
    if which == "send":
        fast = lambda x, s: fused.send_rows(x, s, "expert")
        slow = lambda x, s: fused.exchange(fused.pack(x, s), "expert")
        x = jnp.asarray(rng.normal(size=(8 * t, d)), jnp.float32)
        out_rows = 8 * c
    elif which == "gather":
        fast = lambda x, s: fused.gather_rows(x, s)
        slow = lambda x, s: fused.pack(x, s)
        x = jnp.asarray(rng.normal(size=(8 * t, d)), jnp.float32)
        out_rows = 8 * c
    elif which == "sum":
        fast = lambda y, s: fused.sum_rows(y, s, t)
        slow = lambda y, s: fused.unpack(y, s, t)
        x = jnp.asarray(rng.normal(size=(8 * 8 * c, d)), jnp.float32)
        out_rows = t
    else:
        fast = lambda y, s: fused.return_rows(y, s, t, "expert")
        slow = lambda y, s: fused.unpack(fused.exchange(y, "expert"), s, t)
        x = jnp.asarray(rng.normal(size=(8 * 8 * c, d)), jnp.float32)
        out_rows = t
    ct = jnp.asarray(rng.normal(size=(8 * out_rows, d)), jnp.float32)

    def vjp_of(f):
        def local(x, s, ct):
            out, vjp = jax.vjp(lambda x: f(x, s), x)
            return out, vjp(ct)[0]
        return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("expert"),) * 3,
                                     out_specs=(P("expert"), P("expert")), check_vma=False))
    out_f, g_f = vjp_of(fast)(x, src, ct)
    out_s, g_s = vjp_of(slow)(x, src, ct)
    np.testing.assert_allclose(out_f, out_s, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(g_f, g_s, rtol=1e-6, atol=1e-6)


@functools.lru_cache(maxsize=None)
def _two_device_case():
    """The routing of the test below, its inputs, and the single-device experts' output on them
    (the same for every node size: computed once)."""
    cfg = MoEConfig(num_experts=4, top_k=2, d_model=4, d_ff=8, gmm_backend="ragged_dot",
                    dispatcher="a2a", ragged_buffer_factor=2.0)
    ids = jnp.asarray([[2, 3], [1, 2], [0, 1], [3, 0]], jnp.int32)
    w = jnp.asarray([[0.5, 0.5], [0.9, 0.1], [0.2, 0.8], [0.7, 0.3]], jnp.float32)
    routing = Routing(w, ids, jnp.zeros((4, 4)), jnp.zeros((4, 4)))
    experts = init_params(jax.random.key(0), cfg)["experts"]
    x = jax.random.normal(jax.random.key(1), (4, 4), jnp.float32)
    ref = jax.jit(lambda x: dropless_experts(x, routing, experts, cfg))(x)
    return cfg, routing, experts, x, ref


@pytest.mark.parametrize("devices_per_node", [1, 2])
def test_two_devices_two_experts_token_travels_once(devices_per_node):
    """2 devices x 2 experts (0,1 on device 0; 2,3 on device 1), K=2, 4 tokens, 2 per device:
      device 0: token 0 -> experts 2,3 (both on device 1): ONE row to device 1, not two
                token 1 -> experts 1,2: one row to device 0 (itself), one to device 1
      device 1: token 2 -> experts 0,1: ONE row to device 0; token 3 -> 3,0: one row each.
    Rows: 6 sent (8 routed); crossing devices: 4 (6 without dedup)."""
    cfg, routing, experts, x, (y_ref, sizes_ref) = _two_device_case()
    mesh = NodeMesh(make_mesh(MeshConfig(expert=2), devices=jax.devices()[:2]),
                    devices_per_node=devices_per_node)
    y, sizes, aux = jax.jit(lambda x: expert_parallel_experts(
        x, routing, experts, cfg, mesh))(x)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(sizes, sizes_ref)
    assert float(aux["rows_sent"]) == 6 and float(aux["rows_routed"]) == 8
    crossing = float(aux["rows_intra_node"]) + float(aux["rows_inter_node"])
    crossing_no_dedup = (float(aux["rows_intra_node_no_dedup"])
                         + float(aux["rows_inter_node_no_dedup"]))
    assert (crossing, crossing_no_dedup) == (4, 6)
    inter = 4 if devices_per_node == 1 else 0
    assert float(aux["rows_inter_node"]) == inter
    assert float(aux["bytes_inter_node"]) == inter * 4 * 4
    assert int(aux["rounds"]) == 1 and float(aux["padding_rows"]) == 2 * 2 * 2 - 6
