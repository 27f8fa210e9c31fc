"""Attention pieces against plain references: softmax attention vs a per-query loop, RoPE vs
complex multiplication, RMSNorm vs its formula, MLA/GQA shapes, causality through gradients,
remat policies equal to no remat."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.config import ATTENTION_KINDS, REMAT_POLICIES, ModelConfig, MoEConfig
from dropless.models import attention as att
from dropless.models import decoder


def naive_attention(q, k, v, scale):
    """Per batch, head and query position: softmax over keys 0..i, written as loops."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b, s, h, _ = q.shape
    out = np.zeros(q.shape[:3] + (v.shape[-1],))
    for bi in range(b):
        for hi in range(h):
            for i in range(s):
                logits = np.array([q[bi, i, hi] @ k[bi, j, hi] * scale for j in range(i + 1)])
                p = np.exp(logits - logits.max())
                p /= p.sum()
                out[bi, i, hi] = sum(p[j] * v[bi, j, hi] for j in range(i + 1))
    return out


def test_causal_attention_matches_loop():
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (2, 5, 3, 4))
    k = jax.random.normal(kk, (2, 5, 3, 4))
    v = jax.random.normal(kv, (2, 5, 3, 6))
    got = att.causal_attention(q, k, v, 0.5)
    np.testing.assert_allclose(got, naive_attention(q, k, v, 0.5), rtol=1e-5, atol=1e-5)


def test_rope_is_complex_rotation():
    x = jax.random.normal(jax.random.key(1), (1, 6, 2, 8))
    cos, sin = att.rope_tables(6, 8, 10000.0)
    got = np.asarray(att.apply_rope(x, cos, sin))
    xn = np.asarray(x, np.float64)
    z = xn[..., :4] + 1j * xn[..., 4:]             # (first half, second half) pairs
    freqs = 10000.0 ** (-np.arange(0, 8, 2) / 8)
    rot = np.exp(1j * np.arange(6)[:, None] * freqs[None, :])[None, :, None, :]
    want = np.concatenate([(z * rot).real, (z * rot).imag], axis=-1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_rms_norm_formula():
    x = jnp.array([[3.0, 4.0]])
    w = jnp.array([1.0, 2.0])
    rms = math.sqrt((9 + 16) / 2)
    np.testing.assert_allclose(att.rms_norm(x, w, 0.0), [[3 / rms, 8 / rms]], rtol=1e-6)


def small_cfg(attention="mla", **kw):
    moe = MoEConfig(num_experts=4, top_k=2, d_model=16, d_ff=8, num_shared_experts=1,
                    score_func="sigmoid", gmm_backend="ragged_dot")  # quick to compile
    base = dict(vocab_size=32, d_model=16, num_layers=2, num_heads=2, d_ff=24,
                attention=attention, first_k_dense=1, moe=moe, kv_lora_rank=8,
                qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6, num_kv_heads=1)
    base.update(kw)
    return ModelConfig(**base)


@pytest.mark.parametrize("q_lora", [0, 8])
def test_mla_shapes(q_lora):
    cfg = small_cfg(q_lora_rank=q_lora)
    p = att.init_mla(jax.random.key(0), cfg)
    assert ("wq_a_DQ" in p) == bool(q_lora)
    assert p["wkv_a_DL"].shape == (16, 8 + 4)
    assert p["wkv_b_LHN"].shape == (8, 2, 4 + 6)
    assert p["wo_HVD"].shape == (2, 6, 16)
    cos, sin = att.rope_tables(5, 4, 1e4)
    y = att.mla(p, jnp.ones((3, 5, 16)), cfg, cos, sin)
    assert y.shape == (3, 5, 16)


def test_gqa_matches_naive_with_repeated_heads():
    cfg = small_cfg("mha", num_heads=4, num_kv_heads=2, head_dim=4, qk_norm=False)
    p = att.init_mha(jax.random.key(2), cfg)
    x = jax.random.normal(jax.random.key(3), (1, 4, 16))
    cos, sin = att.rope_tables(4, 4, 1e4)
    got = att.mha(p, x, cfg, cos, sin)
    q = att.apply_rope(jnp.einsum("bsd,dhk->bshk", x, p["wq_DHK"]), cos, sin)
    k = att.apply_rope(jnp.einsum("bsd,dgk->bsgk", x, p["wk_DGK"]), cos, sin)
    v = jnp.einsum("bsd,dgk->bsgk", x, p["wv_DGK"])
    # query head h uses kv head h // 2
    o = naive_attention(q, np.repeat(k, 2, axis=2), np.repeat(v, 2, axis=2), 0.5)
    want = np.einsum("bshk,hkd->bsd", o, np.asarray(p["wo_HKD"], np.float64))
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("attention", ["mla", "mha"])
def test_causality_through_gradients(attention):
    """d logits[:, i] / d embedding of token j must be zero for every j > i."""
    cfg = small_cfg(attention, mtp_depth=0)
    params = decoder.init_params(jax.random.key(0), cfg)
    tokens = jnp.arange(6, dtype=jnp.int32)[None] % cfg.vocab_size
    x0 = params["embed"]["w_VD"][tokens]

    def logit_at(x, i):
        # an identity lookup: token t's embedding is row t of x, so d/dx is d/d(embeddings)
        p = dict(params, embed={"w_VD": x})
        out, _, _ = decoder.forward(p, jnp.arange(6, dtype=jnp.int32)[None], cfg)
        return out[0, i].sum()

    grad_at = jax.jit(jax.grad(logit_at))      # one compile; i is traced
    for i in range(6):
        norms = np.linalg.norm(np.asarray(grad_at(x0[0], i)), axis=-1)
        assert np.all(norms[i + 1:] == 0), (i, norms)
        assert norms[i] > 0


@pytest.fixture(scope="module")
def remat_case():
    cfg = small_cfg()
    params = decoder.init_params(jax.random.key(0), cfg)
    tokens = (jnp.arange(12, dtype=jnp.int32).reshape(2, 6) * 7) % cfg.vocab_size

    def grads(r):
        return jax.jit(jax.grad(lambda p: decoder.forward(p, tokens, cfg, remat=r)[0].mean())
                       )(params)
    return grads, grads("none")


@pytest.mark.parametrize("remat", [r for r in REMAT_POLICIES if r != "none"])
def test_remat_equals_no_remat(remat, remat_case):
    grads, g0 = remat_case
    g1 = grads(remat)
    for a, b in zip(jax.tree_util.tree_leaves(g0), jax.tree_util.tree_leaves(g1)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_every_attention_kind_has_a_spec():
    """config names the kinds; models/attention.ATTENTION holds one named spec per kind."""
    assert tuple(att.ATTENTION) == ATTENTION_KINDS
    for spec in att.ATTENTION.values():
        assert callable(spec.init) and callable(spec.apply) and spec.offloaded


def test_forward_rejects_bad_tokens():
    cfg = small_cfg()
    params = decoder.init_params(jax.random.key(0), cfg)
    with pytest.raises(ValueError, match="tokens must be an int array"):
        decoder.forward(params, jnp.zeros((2, 3)), cfg)
    with pytest.raises(ValueError, match="remat='bogus'"):
        decoder.forward(params, jnp.zeros((1, 3), jnp.int32), cfg, remat="bogus")


def test_model_config_errors():
    with pytest.raises(ValueError, match="ModelConfig.attention='gqa'"):
        small_cfg("gqa")
    with pytest.raises(ValueError, match="ModelConfig.moe.d_model=16 must equal d_model=32"):
        small_cfg(d_model=32)
    with pytest.raises(ValueError, match="ModelConfig.first_k_dense=3"):
        small_cfg(first_k_dense=3)
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        small_cfg("mha", num_kv_heads=3)


def test_mtp_sees_exactly_one_token_ahead():
    """MTP depth 1 at position i may use tokens 0..i+1 (it predicts i+2), never later ones."""
    cfg = small_cfg(mtp_depth=1)
    params = decoder.init_params(jax.random.key(0), cfg)
    x0 = params["embed"]["w_VD"][jnp.arange(6)]

    def mtp_logit_at(x, i):
        p = dict(params, embed={"w_VD": x})
        toks = jnp.arange(6, dtype=jnp.int32)[None]
        _, h, _ = decoder.forward(p, toks, cfg)
        return decoder.mtp_logits(p, h, toks, cfg)[0][0][0, i].sum()

    grad_at = jax.jit(jax.grad(mtp_logit_at))
    for i in range(5):                     # position 5 sees a wrapped token; the loss masks it
        norms = np.linalg.norm(np.asarray(grad_at(x0, i)), axis=-1)
        assert np.all(norms[i + 2:] == 0), (i, norms)
        assert norms[i + 1] > 0


def test_masked_cross_entropy_hand_worked():
    from dropless.train.cross_entropy import cross_entropy
    logits = jnp.log(jnp.array([[[0.5, 0.5], [0.9, 0.1]]]))
    targets = jnp.array([[0, 1]])
    np.testing.assert_allclose(cross_entropy(logits, targets), (np.log(2) + np.log(10)) / 2,
                               rtol=1e-6)
    np.testing.assert_allclose(cross_entropy(logits, targets, jnp.array([[1.0, 0.0]])),
                               np.log(2), rtol=1e-6)
