"""Model features real checkpoints need: YaRN rope scaling, a general dense/MoE layer pattern,
MLA's latent-norm epsilon, and the router-bias update default per score function."""
import math

import jax
import numpy as np
import pytest

from dropless.config import ModelConfig, MoEConfig
from dropless.models import attention as att
from dropless.models import decoder


def yarn_cfg(**kw):
    base = dict(vocab_size=32, d_model=16, num_layers=2, num_heads=2, d_ff=16,
                kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=16, v_head_dim=8,
                rope_type="yarn", rope_factor=40.0, rope_original_max_position=4096,
                rope_mscale=1.0, rope_mscale_all_dim=1.0)
    base.update(kw)
    return ModelConfig(**base)


def test_yarn_frequencies_by_hand():
    """DeepSeek-V3's numbers, dim 16: the ramp runs over the dims whose wavelength sees between
    32 and 1 turns in 4096 positions; faster dims keep theta^(-2i/d), slower ones are / 40."""
    cfg = yarn_cfg()
    d, base = 16, 10000.0
    turns = lambda r: d * math.log(4096 / (r * 2 * math.pi)) / (2 * math.log(base))
    low, high = math.floor(turns(32)), math.ceil(turns(1))     # 2.6 -> 2, 5.6 -> 6
    assert (low, high) == (2, 6)
    freq = base ** (-np.arange(0, d, 2) / d)
    want = []
    for i, f in enumerate(freq):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)    # 0: keep, 1: interpolate
        want.append(f * (1 - ramp) + f / 40 * ramp)
    np.testing.assert_allclose(att.yarn_inv_freq(d, cfg), want, rtol=1e-6)


def test_yarn_attention_factors():
    m = 0.1 * math.log(40) + 1
    cfg = yarn_cfg()
    assert att.mla_softmax_scale(cfg) == pytest.approx(m * m / math.sqrt(24))
    cos, sin = att.rope_tables(3, cfg.rope_dim, cfg.rope_theta, cfg)   # mscale == all_dim: 1
    np.testing.assert_allclose(np.asarray(cos[0]), 1.0, rtol=1e-6)
    cos2, _ = att.rope_tables(3, cfg.rope_dim, cfg.rope_theta,
                              cfg.replace(rope_mscale=0.0))   # mscale(40) on cos/sin
    np.testing.assert_allclose(np.asarray(cos2[0]), m, rtol=1e-6)
    plain = cfg.replace(rope_type="default")
    assert att.mla_softmax_scale(plain) == pytest.approx(1 / math.sqrt(24))


@pytest.mark.parametrize("field,value,match", [
    ("rope_type", "linear", "rope_type='linear'"),
    ("rope_factor", 0.5, "rope_factor=0.5"),
    ("rope_beta_slow", 64.0, "rope_beta_slow=64.0"),
    ("mla_norm_eps", 0.0, "mla_norm_eps=0.0"),
])
def test_rope_and_eps_validation(field, value, match):
    with pytest.raises(ValueError, match=match):
        yarn_cfg(**{field: value})


def moe_cfg(**kw):
    moe = MoEConfig(num_experts=4, top_k=2, d_model=16, d_ff=8)
    return ModelConfig(vocab_size=32, d_model=16, num_layers=4, num_heads=2, d_ff=16,
                       kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                       moe=moe, **kw)


def test_layer_pattern_drives_init_and_counts():
    cfg = moe_cfg(layer_pattern="DMDM")
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    assert cfg.num_moe_layers == 2
    shapes = jax.eval_shape(lambda k: decoder.init_params(k, cfg), jax.random.key(0))
    assert ["moe" in b for b in shapes["layers"]] == [False, True, False, True]
    # first_k_dense keeps working, and means the dense-prefix pattern
    assert [moe_cfg(first_k_dense=1).is_moe_layer(i) for i in range(4)] == \
        [moe_cfg(layer_pattern="DMMM").is_moe_layer(i) for i in range(4)]


@pytest.mark.parametrize("kw,match", [
    ({"layer_pattern": "DM"}, "layer_pattern='DM' must be 4 letters"),
    ({"layer_pattern": "DXMM"}, "layer_pattern='DXMM'"),
    ({"layer_pattern": "DMMM", "first_k_dense": 1}, "first_k_dense=1 must be 0"),
])
def test_layer_pattern_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        moe_cfg(**kw)


def test_mla_norm_eps_is_used():
    cfg = moe_cfg(q_lora_rank=8).replace(moe=None)
    p = att.init_mla(jax.random.key(0), cfg)
    x = 1e-3 * jax.random.normal(jax.random.key(1), (1, 3, 16))   # tiny: eps matters
    cos, sin = att.rope_tables(3, cfg.rope_dim, cfg.rope_theta, cfg)
    mla = jax.jit(att.mla, static_argnums=2)
    a = mla(p, x, cfg, cos, sin)
    b = mla(p, x, cfg.replace(mla_norm_eps=1e-2), cos, sin)
    c = mla(p, x, cfg.replace(norm_eps=1e-2), cos, sin)    # not the latent norms' eps
    assert not np.allclose(a, b)
    np.testing.assert_array_equal(a, c)


def test_bias_update_speed_default_follows_score_func():
    kw = dict(num_experts=4, top_k=2, d_model=8, d_ff=8)
    assert MoEConfig(score_func="sigmoid", **kw).bias_update_speed == 0.001
    assert MoEConfig(score_func="softmax", **kw).bias_update_speed == 0.0
    assert MoEConfig(score_func="softmax", bias_update_speed=0.01, **kw).bias_update_speed == 0.01
