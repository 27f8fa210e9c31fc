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
from dropless.moe import dispatch_a2a as fused
from dropless.moe import dispatch_plan as dp
from dropless.moe.dispatch import expert_parallel_experts
from dropless.moe.layer import dropless_experts, init_params
from dropless.moe.router import Routing
from dropless.parallel import make_mesh


def test_plan_hand_worked():
    # the module docstring's example: P=2, El=2, K=2, T=3
    plan = dp.make_plan(jnp.asarray([[0, 1], [1, 2], [3, 2]]), num_peers=2, experts_per_peer=2)
    np.testing.assert_array_equal(plan.hit_TP, [[1, 0], [1, 1], [0, 1]])
    np.testing.assert_array_equal(plan.counts_P, [2, 2])   # 4 rows, not 6
    np.testing.assert_array_equal(plan.routed_P, [3, 3])
    np.testing.assert_array_equal(np.where(plan.hit_TP, plan.rank_TP, -1), [[0, -1], [1, 0],
                                                                             [-1, 1]])
    s = dp.round_slots(plan, 0, chunk=2, experts_per_peer=2, row_slots=2)
    np.testing.assert_array_equal(s.src_S, [0, 1, 1, 2])
    # token 0 carries both local experts of peer 0; token 1 on peer 0 only expert 1
    np.testing.assert_array_equal(s.lid_SJ, [[0, 1], [1, 2], [0, 2], [1, 0]])
    # C=1: two rounds, [[0], [1]] then [[1], [2]]
    assert int(dp.rounds_needed(plan.counts_P, 1)) == 2
    np.testing.assert_array_equal(dp.round_slots(plan, 0, 1, 2, 2).src_S, [0, 1])
    np.testing.assert_array_equal(dp.round_slots(plan, 1, 1, 2, 2).src_S, [1, 2])


def test_plan_empty_peer_and_weights():
    # P=3, El=1: nobody picks expert 2, so peer 2 gets only empty slots (src = T = 2)
    plan = dp.make_plan(jnp.asarray([[1, 0], [0, 1]]), num_peers=3, experts_per_peer=1)
    np.testing.assert_array_equal(plan.counts_P, [2, 2, 0])
    s = dp.round_slots(plan, 0, chunk=2, experts_per_peer=1, row_slots=1)
    np.testing.assert_array_equal(s.src_S, [0, 1, 0, 1, 2, 2])
    w = dp.slot_weights(jnp.asarray([[0.7, 0.3], [0.6, 0.4]]), s, 1)
    np.testing.assert_allclose(w[:, 0], [0.3, 0.6, 0.7, 0.4, 0.0, 0.0])


def test_chunk_rows():
    assert dp.chunk_rows(num_tokens=8, top_k=2, num_peers=8, factor=1.0) == 2
    assert dp.chunk_rows(8, 2, 8, 1.3) == 3        # ceil
    assert dp.chunk_rows(8, 8, 8, 2.0) == 8        # capped at T: one round always suffices
    assert dp.chunk_rows(1, 1, 64, 1.0) == 1       # at least one row


@settings(max_examples=12, deadline=None)
@given(st.data())
def test_every_choice_travels_exactly_once(data):
    peers = data.draw(st.sampled_from([1, 2, 4]))
    el = data.draw(st.integers(1, 3))
    e = peers * el
    k = data.draw(st.integers(1, min(e, 4)))
    t = data.draw(st.integers(1, 9))
    chunk = data.draw(st.integers(1, t))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    ids = np.stack([rng.permutation(e)[:k] for _ in range(t)])
    plan = dp.make_plan(jnp.asarray(ids), peers, el)
    j = dp.slots_per_row(k, el)
    seen, pairs = [], []
    for r in range(int(dp.rounds_needed(plan.counts_P, chunk))):
        s = dp.round_slots(plan, r, chunk, el, j)
        for slot, (tok, lids, ks) in enumerate(zip(np.asarray(s.src_S), np.asarray(s.lid_SJ),
                                                   np.asarray(s.k_SJ))):
            if tok == t:
                assert (lids == el).all()
                continue
            peer = slot // chunk
            pairs.append((tok, peer))
            for lid, kk in zip(lids, ks):
                if lid < el:
                    assert ids[tok, kk] == peer * el + lid
                    seen.append((tok, kk))
    assert sorted(seen) == [(a, b) for a in range(t) for b in range(k)]
    assert len(pairs) == len(set(pairs)) == int(np.sum(plan.counts_P))


@functools.lru_cache(maxsize=None)
def _mesh8():
    return make_mesh(MeshConfig(expert=8))


@pytest.mark.parametrize("which", ["send", "return"])
def test_fused_exchange_vjp_equals_autodiff(which):
    """The hand-written transposes of send_rows/return_rows against autodiff of the plain ops."""
    mesh, t, c, d = _mesh8(), 3, 2, 4
    rng = np.random.default_rng(0)
    src = jnp.asarray(rng.integers(0, t + 1, size=(8 * 8 * c,)), jnp.int32)  # T = empty slot
    if which == "send":
        fast = lambda x, s: fused.send_rows(x, s, "expert")
        slow = lambda x, s: fused._a2a(fused._pack(x, s), "expert")
        x = jnp.asarray(rng.normal(size=(8 * t, d)), jnp.float32)
        out_rows = 8 * c
    else:
        fast = lambda y, s: fused.return_rows(y, s, t, "expert")
        slow = lambda y, s: fused._unpack(fused._a2a(y, "expert"), s, t)
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


@pytest.mark.parametrize("devices_per_node", [1, 2])
def test_two_devices_two_experts_token_travels_once(devices_per_node):
    """2 devices x 2 experts (0,1 on device 0; 2,3 on device 1), K=2, 4 tokens, 2 per device:
      device 0: token 0 -> experts 2,3 (both on device 1): ONE row to device 1, not two
                token 1 -> experts 1,2: one row to device 0 (itself), one to device 1
      device 1: token 2 -> experts 0,1: ONE row to device 0; token 3 -> 3,0: one row each.
    Rows: 6 sent (8 routed); crossing devices: 4 (6 without dedup)."""
    cfg = MoEConfig(num_experts=4, top_k=2, d_model=4, d_ff=8, gmm_backend="ragged_dot",
                    dispatcher="a2a", ragged_buffer_factor=1.0,
                    devices_per_node=devices_per_node)
    mesh = make_mesh(MeshConfig(expert=2), devices=jax.devices()[:2])
    ids = jnp.asarray([[2, 3], [1, 2], [0, 1], [3, 0]], jnp.int32)
    w = jnp.asarray([[0.5, 0.5], [0.9, 0.1], [0.2, 0.8], [0.7, 0.3]], jnp.float32)
    routing = Routing(w, ids, jnp.zeros((4, 4)), jnp.zeros((4, 4)))
    experts = init_params(jax.random.key(0), cfg)["experts"]
    x = jax.random.normal(jax.random.key(1), (4, 4), jnp.float32)
    y, sizes, aux = jax.jit(lambda x: expert_parallel_experts(x, routing, experts, cfg, mesh))(x)
    y_ref, sizes_ref = dropless_experts(x, routing, experts, cfg)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(sizes, sizes_ref)
    assert float(aux["rows_sent"]) == 6 and float(aux["rows_routed"]) == 8
    crossing = float(aux["rows_intra_node"]) + float(aux["rows_inter_node"])
    crossing_no_dedup = (float(aux["rows_intra_node_no_dedup"])
                         + float(aux["rows_inter_node_no_dedup"]))
    assert (crossing, crossing_no_dedup) == (4, 6)
    inter = 4 if devices_per_node == 1 else 0
    assert float(aux["rows_inter_node"]) == inter
    assert float(aux["bytes_inter_node"]) == inter * (4 * 4 + 8 * 2)
    assert int(aux["rounds"]) == 1 and float(aux["padding_rows"]) == 2 * 2 * 2 - 6
