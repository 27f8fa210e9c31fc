"""The MoE layer against a per-token MoE written as plainly as possible."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dropless import MoEConfig, moe
from dropless.moe.nnx import MoE


def np_route(x, params, cfg):
    """Routing from the definitions, in float64, token by token."""
    logits = np.asarray(x, np.float64) @ np.asarray(params["router"]["w_DE"], np.float64)
    if cfg.score_func == "softmax":
        scores = np.exp(logits - logits.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
    else:
        scores = 1 / (1 + np.exp(-logits))
    sel = scores + np.asarray(params["router"]["bias_E"], np.float64)
    ids = np.zeros((x.shape[0], cfg.top_k), int)
    for t in range(x.shape[0]):
        s = sel[t].copy()
        if cfg.n_groups > 1:
            per = cfg.num_experts // cfg.n_groups
            gs = [np.sort(s[g * per:(g + 1) * per])[-min(2, per):].sum()
                  for g in range(cfg.n_groups)]
            keep = np.argsort(-np.array(gs), kind="stable")[:cfg.topk_groups]
            for g in range(cfg.n_groups):
                if g not in keep:
                    s[g * per:(g + 1) * per] = -np.inf
        ids[t] = np.argsort(-s, kind="stable")[:cfg.top_k]
    return ids, scores


def plain_moe(params, x, cfg, ids, keep=None):
    """jnp, differentiable: y_t = sum_k w_tk * ffn_{e_tk}(x_t); `keep` zeroes dropped choices."""
    logits = jnp.dot(x, params["router"]["w_DE"], precision="highest")
    scores = jax.nn.softmax(logits) if cfg.score_func == "softmax" else jax.nn.sigmoid(logits)
    w = jnp.take_along_axis(scores, ids, axis=1)
    if cfg.norm_topk_prob:
        w = w / w.sum(-1, keepdims=True)
    w = w * cfg.routed_scaling_factor
    if keep is not None:
        w = w * keep
    ex = params["experts"]
    g = jnp.einsum("td,tkdf->tkf", x, ex["w_gate_EDF"][ids], precision="highest")
    u = jnp.einsum("td,tkdf->tkf", x, ex["w_up_EDF"][ids], precision="highest")
    y = jnp.einsum("tkf,tkfd->tkd", jax.nn.silu(g) * u, ex["w_down_EFD"][ids],
                   precision="highest")
    out = jnp.einsum("tkd,tk->td", y, w)
    if cfg.num_shared_experts:
        sh = params["shared"]
        out = out + (jax.nn.silu(x @ sh["w_gate_DF"]) * (x @ sh["w_up_DF"])) @ sh["w_down_FD"]
    return out


@functools.partial(jax.jit, static_argnums=4)
def plain_moe_grads(params, x, ids, dy, cfg):
    """d params, d x of <plain_moe(params, x), dy>; the routing `ids` is an argument, so one
    program serves every backend of a config (plain_moe never reads the backend)."""
    return jax.grad(lambda p, x: jnp.vdot(plain_moe(p, x, cfg, ids), dy), (0, 1))(params, x)


@functools.partial(jax.jit, static_argnums=2)
def apply_jit(params, x, cfg):
    """moe.apply compiled once per config and shape; op by op, every size of the tiled kernel's
    loops was a compile of its own."""
    return moe.apply(params, x, cfg)


CONFIGS = {
    "mixtral": dict(num_experts=8, top_k=2),
    "deepseek": dict(num_experts=8, top_k=3, score_func="sigmoid", n_groups=4, topk_groups=2,
                     num_shared_experts=1, routed_scaling_factor=2.5),
    "topk_is_all": dict(num_experts=4, top_k=4, norm_topk_prob=False),
}


def make(name, t=13, backend="tiled", seed=0, **kw):
    cfg = MoEConfig(d_model=8, d_ff=6, gmm_backend=backend, **CONFIGS[name], **kw)
    params = moe.init_params(jax.random.key(seed), cfg)
    params["router"]["bias_E"] = 0.05 * jax.random.normal(jax.random.key(seed + 7),
                                                          (cfg.num_experts,))
    x = jax.random.normal(jax.random.key(seed + 1), (t, cfg.d_model))
    return cfg, params, x


@pytest.mark.parametrize("backend", ["tiled", "reference", "ragged_dot", "padded"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_forward_and_grads_match_plain_moe(name, backend):
    cfg, params, x = make(name, backend=backend)
    ids, _ = np_route(x, params, cfg)
    y, aux = jax.jit(lambda p, x: moe.apply(p, x, cfg))(params, x)
    np.testing.assert_allclose(y, plain_moe(params, x, cfg, jnp.asarray(ids)), rtol=1e-4,
                               atol=1e-5)
    np.testing.assert_array_equal(aux["tokens_per_expert"],
                                  np.bincount(ids.ravel(), minlength=cfg.num_experts))
    assert int(aux["dropped_tokens"]) == 0
    dy = jax.random.normal(jax.random.key(5), y.shape)
    g1 = jax.jit(jax.grad(lambda p, x: jnp.vdot(moe.apply(p, x, cfg)[0], dy), (0, 1)))(
        params, x)
    g2 = plain_moe_grads(params, x, jnp.asarray(ids), dy, cfg.replace(gmm_backend="reference"))
    flat1, flat2 = jax.tree.leaves_with_path(g1), jax.tree.leaves_with_path(g2)
    for (path, a), (_, b) in zip(flat1, flat2):
        if "bias_E" in jax.tree_util.keystr(path):
            continue  # the bias only selects; neither side differentiates through selection
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=jax.tree_util.keystr(path))


def test_unjitted_loop_backend_and_batched_input():
    cfg, params, x = make("mixtral", backend="loop")
    xb = x[:12].reshape(3, 4, cfg.d_model)
    y, _ = moe.apply(params, xb, cfg)
    ids, _ = np_route(xb.reshape(12, -1), params, cfg)
    np.testing.assert_allclose(y.reshape(12, -1),
                               plain_moe(params, xb.reshape(12, -1), cfg, jnp.asarray(ids)),
                               rtol=1e-4, atol=1e-5)


def test_all_tokens_on_one_expert_pair():
    cfg, params, x = make("mixtral", t=40)
    params["router"]["w_DE"] = jnp.zeros_like(params["router"]["w_DE"])
    params["router"]["bias_E"] = jnp.zeros(8).at[5].set(1.0).at[2].set(0.5)
    y, aux = apply_jit(params, x, cfg)
    assert aux["tokens_per_expert"].tolist() == [0, 0, 40, 0, 0, 40, 0, 0]
    ids = jnp.tile(jnp.array([[5, 2]]), (40, 1))
    np.testing.assert_allclose(y, plain_moe(params, x, cfg, ids), rtol=1e-4, atol=1e-5)


def test_bf16_layer_close_to_f32():
    cfg, params, x = make("deepseek", t=64)
    y32, _ = apply_jit(params, x, cfg)
    cfg16 = cfg.replace(dtype="bfloat16", weight_dtype="bfloat16")
    y16, _ = jax.jit(lambda p, x: moe.apply(p, x, cfg16))(params, x.astype(jnp.bfloat16))
    assert y16.dtype == jnp.bfloat16
    rel = np.linalg.norm(np.asarray(y16, np.float32) - y32) / np.linalg.norm(y32)
    assert rel < 2e-2


def np_capacity_keep(ids, num_experts, cap):
    """Capacity semantics: rows in (token, choice) order; each expert keeps its first `cap`."""
    ids_flat = ids.ravel()
    kept = np.zeros(ids_flat.shape, bool)
    seen = np.zeros(num_experts, int)
    for j, e in enumerate(ids_flat):
        kept[j] = seen[e] < cap
        seen[e] += 1
    return kept.reshape(ids.shape)


@pytest.mark.parametrize("cf", [0.5, 1.0, 8.0])
def test_capacity_baseline_drops_exactly_the_overflow(cf):
    cfg, params, x = make("mixtral", t=24, capacity_factor=cf)
    ids, _ = np_route(x, params, cfg)
    cap = moe.capacity(cfg, 24)
    kept = np_capacity_keep(ids, cfg.num_experts, cap)
    y, aux = moe.apply(params, x, cfg)
    assert int(aux["dropped_tokens"]) == int((~kept).sum())
    expected = plain_moe(params, x, cfg, jnp.asarray(ids), keep=jnp.asarray(kept))
    np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-5)
    full = plain_moe(params, x, cfg, jnp.asarray(ids))
    if cf == 0.5:
        assert (~kept).sum() > 0  # the case really drops
    if cf == 8.0:
        np.testing.assert_allclose(y, full, rtol=1e-4, atol=1e-5)


def test_losses_in_aux_and_weighted_total():
    cfg, params, x = make("deepseek", load_balance_coef=0.01, seq_aux_coef=1e-4,
                          z_loss_coef=1e-3)
    _, aux = moe.apply(params, x, cfg)
    total = 0.01 * aux["load_balance_loss"] + 1e-4 * aux["seq_aux_loss"] + 1e-3 * aux["z_loss"]
    assert float(aux["loss"]) == pytest.approx(float(total), rel=1e-6)


def test_bad_input_shape():
    cfg, params, x = make("mixtral")
    with pytest.raises(ValueError, match=r"x must have shape \[T, d_model=8\]"):
        moe.apply(params, x[:, :5], cfg)


def test_nnx_module_matches_functional_and_updates_bias():
    cfg, _, x = make("deepseek")
    m = MoE(cfg, rngs=nnx.Rngs(3))
    y, aux = m(x)
    y2, _ = moe.apply(m.params_dict(), x, cfg)
    np.testing.assert_array_equal(y, y2)
    counts = aux["tokens_per_expert"]
    m.update_bias(counts)
    expected = cfg.bias_update_speed * np.sign(np.mean(counts) - np.asarray(counts))
    np.testing.assert_allclose(m.bias_E[...], expected, rtol=1e-6)
    assert "bias_E" not in nnx.state(m, nnx.Param)


def test_gmm_backend_openblas_is_the_native_backend_under_its_old_name():
    # the config keeps the new name, from the constructor and from a config file's key alike
    from dropless.config_file import build_config
    old = MoEConfig(num_experts=4, top_k=2, d_model=16, d_ff=24, dtype="float32",
                    weight_dtype="float32", gmm_backend="openblas")
    assert old.gmm_backend == "native" and old == old.replace(gmm_backend="native")
    assert build_config([("model.moe.gmm_backend", "openblas")]).model.moe.gmm_backend == "native"
    if jax.default_backend() != "cpu":
        return   # the native backend runs on CPU only
    params = moe.init_params(jax.random.key(0), old)
    x = jax.random.normal(jax.random.key(1), (10, 16))
    loss = lambda p, x: (moe.apply(p, x, old)[0] ** 2).sum()   # noqa: E731
    want = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, x)
    # the same numbers bit for bit as the layer built with the new name
    new = old.replace(gmm_backend="native")
    got = jax.jit(jax.value_and_grad(lambda p, x: (moe.apply(p, x, new)[0] ** 2).sum(),
                                     argnums=(0, 1)))(params, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)
