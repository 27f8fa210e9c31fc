"""Routing: hand-worked cases, invariants (hypothesis), losses and the bias update; the native
top-k against jax.lax.top_k (NaNs, zeros, ties), and its XLA fallbacks."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dropless import MoEConfig
from dropless.moe import router as rt


def cfg(**kw):
    base = dict(num_experts=4, top_k=2, d_model=4, d_ff=4)
    base.update(kw)
    return MoEConfig(**base)


def test_softmax_topk_renormalised():
    logits = jnp.log(jnp.array([[0.1, 0.2, 0.3, 0.4]]))
    r = rt.route(logits, jnp.zeros(4), cfg())
    assert r.ids_TK.tolist() == [[3, 2]]
    np.testing.assert_allclose(r.weights_TK, [[0.4 / 0.7, 0.3 / 0.7]], rtol=1e-6)
    r = rt.route(logits, jnp.zeros(4), cfg(norm_topk_prob=False, routed_scaling_factor=2.0))
    np.testing.assert_allclose(r.weights_TK, [[0.8, 0.6]], rtol=1e-6)


def test_sigmoid_bias_changes_choice_not_weights():
    # scores sigmoid(l) = [0.9, 0.8, 0.3, 0.2]; bias lifts expert 3 above expert 1 for selection
    scores = np.array([0.9, 0.8, 0.3, 0.2])
    logits = jnp.asarray(np.log(scores / (1 - scores)))[None]
    c = cfg(score_func="sigmoid", norm_topk_prob=False, routed_scaling_factor=2.5)
    r = rt.route(logits, jnp.array([0.0, 0.0, 0.0, 0.7]), c)
    assert r.ids_TK.tolist() == [[0, 3]]
    np.testing.assert_allclose(r.weights_TK, [[0.9 * 2.5, 0.2 * 2.5]], rtol=1e-5)
    r = rt.route(logits, jnp.array([0.0, 0.0, 0.0, 0.7]), c.replace(norm_topk_prob=True))
    np.testing.assert_allclose(r.weights_TK, [[0.9 / 1.1 * 2.5, 0.2 / 1.1 * 2.5]], rtol=1e-5)


def test_group_limited_hand_worked():
    # 8 experts in 4 groups of 2; scores per group: g0 [.9,.1] sum 1.0; g1 [.6,.6] sum 1.2;
    # g2 [.95,.0] sum .95; g3 [.5,.5] sum 1.0. topk_groups=1 -> only g1 -> experts 2 and 3,
    # although expert 4 (0.95) and 0 (0.9) have the highest single scores.
    scores = np.array([0.9, 0.1, 0.6, 0.6, 0.95, 0.001, 0.5, 0.5])
    logits = jnp.asarray(np.log(scores / (1 - scores)))[None]
    c = MoEConfig(num_experts=8, top_k=2, d_model=4, d_ff=4, score_func="sigmoid",
                  n_groups=4, topk_groups=1)
    r = rt.route(logits, jnp.zeros(8), c)
    assert sorted(r.ids_TK[0].tolist()) == [2, 3]
    r = rt.route(logits, jnp.zeros(8), c.replace(topk_groups=2))  # g1 and one of g0/g3 (1.0)
    assert 2 in r.ids_TK[0].tolist() or 3 in r.ids_TK[0].tolist()


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from(["softmax", "sigmoid"]),
       st.sampled_from([(8, 1, 1, 1), (8, 3, 4, 2), (16, 4, 8, 3), (6, 6, 1, 1)]))
def test_routing_invariants(seed, score_func, shape):
    e, k, groups, topk_groups = shape
    c = MoEConfig(num_experts=e, top_k=k, d_model=4, d_ff=4, score_func=score_func,
                  n_groups=groups, topk_groups=topk_groups)
    key1, key2 = jax.random.split(jax.random.key(seed))
    logits = jax.random.normal(key1, (7, e)) * 3
    bias = jax.random.normal(key2, (e,)) * 0.1
    r = rt.route(logits, bias, c)
    ids = np.asarray(r.ids_TK)
    assert all(len(set(row)) == k for row in ids), "experts must be distinct per token"
    np.testing.assert_allclose(np.asarray(r.weights_TK).sum(-1), 1.0, rtol=1e-5)
    if groups > 1:  # every pick lies in one of the topk_groups best groups
        sel = np.asarray(jax.nn.sigmoid(logits) if score_func == "sigmoid"
                         else jax.nn.softmax(logits)) + np.asarray(bias)
        per = e // groups
        gscore = np.sort(sel.reshape(7, groups, per), -1)[..., -min(2, per):].sum(-1)
        for t in range(7):
            allowed = set(np.argsort(-gscore[t], kind="stable")[:topk_groups])
            assert {i // per for i in ids[t]} <= allowed


def test_load_balance_loss_uniform_is_one_and_skew_is_larger():
    probs = jnp.full((8, 4), 0.25)
    ids = jnp.array([[0, 1], [2, 3]] * 4)
    assert float(rt.load_balance_loss(probs, ids)) == pytest.approx(1.0)
    skew = jnp.array([[0, 1]] * 8)
    probs = jnp.tile(jnp.array([[0.4, 0.4, 0.1, 0.1]]), (8, 1))
    # f = [.5, .5, 0, 0], P = [.4, .4, .1, .1] -> 4 * (.2 + .2) = 1.6
    assert float(rt.load_balance_loss(probs, skew)) == pytest.approx(1.6)


def test_seq_aux_loss_hand_count():
    # one sequence, S=2, E=2, K=1: both tokens pick expert 0 -> f = [2*2/(1*2), 0] = [2, 0]
    probs = jnp.array([[[0.75, 0.25], [0.25, 0.75]]])
    ids = jnp.array([[[0], [0]]])
    assert float(rt.seq_aux_loss(probs, ids)) == pytest.approx(2 * 0.5)


def test_z_loss_and_bias_update():
    logits = jnp.zeros((3, 4))
    assert float(rt.z_loss(logits)) == pytest.approx(np.log(4) ** 2, rel=1e-6)
    bias = rt.update_bias(jnp.zeros(4), jnp.array([5, 1, 3, 3]), 0.01)
    np.testing.assert_allclose(bias, [-0.01, 0.01, 0.0, 0.0])


def test_config_errors_name_field_and_value():
    with pytest.raises(ValueError, match=r"MoEConfig.top_k=9 must be <= num_experts=8"):
        MoEConfig(num_experts=8, top_k=9, d_model=4, d_ff=4)
    with pytest.raises(ValueError, match=r"MoEConfig.n_groups=3 must divide num_experts=8"):
        MoEConfig(num_experts=8, top_k=2, d_model=4, d_ff=4, n_groups=3)
    with pytest.raises(ValueError, match=r"MoEConfig.topk_groups=1 leaves 2 selectable"):
        MoEConfig(num_experts=8, top_k=3, d_model=4, d_ff=4, n_groups=4, topk_groups=1)
    with pytest.raises(ValueError, match=r"MoEConfig.score_func='relu'"):
        MoEConfig(num_experts=8, top_k=2, d_model=4, d_ff=4, score_func="relu")
    with pytest.raises(ValueError, match=r"MoEConfig.gmm_backend='fast'.*tiled"):
        MoEConfig(num_experts=8, top_k=2, d_model=4, d_ff=4, gmm_backend="fast")
    with pytest.raises(ValueError, match=r"MoEConfig.d_ff=0 must be a positive int"):
        MoEConfig(num_experts=8, top_k=2, d_model=4, d_ff=0)
    with pytest.raises(ValueError, match=r"MoEConfig.capacity_factor=0"):
        MoEConfig(num_experts=8, top_k=2, d_model=4, d_ff=4, capacity_factor=0)


# ---- the native top-k (float32 on CPU) against jax.lax.top_k ----

def _hlo_targets(fn, *args):
    import re
    return set(re.findall(r'custom_call_target="([^"]+)"',
                          jax.jit(fn).lower(*args).compile().as_text()))


def _special_rows():
    """Rows that test the order: NaNs of both signs, infinities, both zeros, and ties."""
    neg_nan = np.array([0xFFC00000], np.uint32).view(np.float32)[0]
    return np.array([
        [1.0, np.nan, 3.0, neg_nan, 3.0, -0.0, 0.0, -np.inf, np.inf, 2.0],
        [0.0, -0.0, 0.0, -0.0, 0.0, -0.0, 0.0, -0.0, 0.0, -0.0],
        [5.0] * 10,
        [neg_nan] * 5 + [-np.inf] * 5,
        [np.nan, 1.0, np.nan, 2.0, np.nan, -1.0, 0.5, np.nan, 7.0, -7.0],
    ], np.float32)


@pytest.mark.parametrize("k", [1, 3, 8, 10])
def test_native_top_k_ids_equal_laxs(k):
    rng = np.random.default_rng(0)
    x = np.concatenate([_special_rows(), rng.standard_normal((40, 10)).astype(np.float32),
                        np.round(rng.standard_normal((40, 10)), 1).astype(np.float32)])
    x = jnp.asarray(x)
    got = jax.jit(lambda s: rt.top_k_ids(s, k))(x)
    want = jax.lax.top_k(x, k)[1]
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(got, want)
    assert "dropless_top_k" in _hlo_targets(lambda s: rt.top_k_ids(s, k), x)


def test_native_top_k_at_the_256_expert_shape_and_under_vmap_and_grad():
    x = jax.random.normal(jax.random.key(0), (1024, 256))
    np.testing.assert_array_equal(jax.jit(lambda s: rt.top_k_ids(s, 8))(x),
                                  jax.lax.top_k(x, 8)[1])
    xb = x.reshape(4, 256, 256)
    np.testing.assert_array_equal(jax.vmap(lambda s: rt.top_k_ids(s, 8))(xb),
                                  jax.lax.top_k(xb, 8)[1])
    # the weights' gradient flows through take_along_axis, not through the ids
    f = lambda s: jnp.sum(jnp.take_along_axis(s, rt.top_k_ids(s, 8), axis=-1) ** 2)
    g = lambda s: jnp.sum(jnp.take_along_axis(s, jax.lax.top_k(s, 8)[1], axis=-1) ** 2)
    np.testing.assert_array_equal(jax.grad(f)(x), jax.grad(g)(x))


def test_top_k_ids_takes_xlas_path_for_other_dtypes_and_elsewhere(monkeypatch):
    x = jax.random.normal(jax.random.key(1), (16, 12))
    for xx in (x.astype(jnp.bfloat16), x[None]):
        assert "dropless_top_k" not in _hlo_targets(lambda s: rt.top_k_ids(s, 4), xx)
        np.testing.assert_array_equal(rt.top_k_ids(xx, 4), jax.lax.top_k(xx, 4)[1])
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert "dropless_top_k" not in _hlo_targets(lambda s: rt.top_k_ids(s, 4), x)
