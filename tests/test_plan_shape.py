"""Parameter counts: hand counts, the real arrays of the MoE layer, published big-model counts."""
import math

import jax
import pytest

from dropless.plan.presets import PRESETS, PUBLISHED_PARAMS, get_shape
from dropless.plan.shape import (attention_params, layer_params, model_config, num_moe_layers,
                                 param_counts)


def test_big_presets_match_published_counts():
    for name, (total, active) in PUBLISHED_PARAMS.items():
        c = param_counts(get_shape(name))
        # published figures are rounded to 2-3 significant digits
        assert abs(c["total"] - total) / total < 0.01, (name, c["total"])
        assert abs(c["active"] - active) / active < 0.03, (name, c["active"])


def test_deepseek_v3_with_mtp_is_about_685b():
    # The released checkpoint is 685B: 671B main model + 14B MTP module (which, by the report,
    # counts the shared embedding and output head again: 2 x 129280 x 7168 = 1.85B).
    c = param_counts(get_shape("deepseek3-671b"))
    assert abs(c["mtp"] + c["embedding"] + c["head"] - 14e9) / 14e9 < 0.05
    assert 682e9 < c["total_with_mtp"] + c["embedding"] + c["head"] < 687e9


def test_hand_count_mha_moe():
    # D=8, V=10, L=2 (1 dense), H=2, G=1, Kh=4, Fd=16, E=4, K=2, F=6, 1 shared, untied.
    s = model_config(vocab_size=10, d_model=8, num_layers=2, num_heads=2, num_kv_heads=1,
                   head_dim=4, d_ff=16, attention="mha", first_k_dense=1, num_experts=4,
                   top_k=2, moe_d_ff=6, num_shared_experts=1)
    # attention: q 8*2*4=64, k 8*1*4=32, v 32, o 2*4*8=64 -> 192
    assert sum(attention_params(s).values()) == 192
    # dense layer: 192 + norms 16 + mlp 3*8*16=384 -> 592
    assert sum(layer_params(s, False).values()) == 592
    # moe layer: 192 + 16 + experts 4*3*8*6=576 + shared 144 + router 8*4+4=36 -> 964
    assert sum(layer_params(s, True).values()) == 964
    c = param_counts(s)
    # total: emb 80 + head 80 + final norm 8 + 592 + 964
    assert c["total"] == 80 + 80 + 8 + 592 + 964
    # active: experts 576 -> 2 of 4 = 288
    assert c["active"] == c["total"] - 288


def test_hand_count_mla():
    # D=16, H=2, Qr=4, Lkv=6, N=3, R=2, Vh=5
    s = model_config(vocab_size=4, d_model=16, num_layers=1, num_heads=2, d_ff=8,
                   attention="mla", q_lora_rank=4, kv_lora_rank=6, qk_nope_head_dim=3,
                   qk_rope_head_dim=2, v_head_dim=5)
    p = attention_params(s)
    assert p == {"q_down": 16 * 4 + 4, "query": 4 * 2 * 5, "kv_down": 16 * 8 + 6,
                 "key": 6 * 2 * 3, "value": 6 * 2 * 5, "out": 2 * 5 * 16}


def test_moe_layer_counts_match_real_arrays():
    from dropless.moe import init_params
    s = get_shape("deepseek3-test")
    params = init_params(jax.random.key(0), s.moe)
    real = {k: sum(math.prod(a.shape) for a in v.values()) for k, v in params.items()}
    p = layer_params(s, True)
    assert real == {"router": p["router"], "experts": p["experts"], "shared": p["shared"]}


def test_every_preset_builds():
    for name in PRESETS:
        c = param_counts(get_shape(name))
        assert 0 < c["active"] <= c["total"]


def test_model_config_from_flat_planner_names():
    s = model_config(vocab_size=100, d_model=16, num_layers=2, num_heads=2, d_ff=64,
                     attention="mha", first_k_dense=1, tie_embeddings=True, num_experts=8,
                     top_k=2, moe_d_ff=32)
    assert (s.moe.num_experts, s.moe.d_ff, s.moe.d_model, s.tie_embeddings) == (8, 32, 16, True)
    assert num_moe_layers(s) == 1
    wider = model_config(s, d_model=32, top_k=4)
    assert (wider.moe.d_model, wider.moe.top_k, wider.moe.num_experts) == (32, 4, 8)
    assert model_config(s, num_experts=0).moe is None
    with pytest.raises(ValueError, match="'moe_dff' is not a model setting"):
        model_config(s, moe_dff=3)
    with pytest.raises(ValueError, match=r"no MoE layers: give \['top_k', 'moe_d_ff'\]"):
        model_config(model_config(s, num_experts=0), num_experts=4)


def test_the_layer_pattern_reaches_the_planner():
    """The planner asks ModelConfig.is_moe_layer(i) only: a non-prefix dense/MoE pattern is
    counted as the trainer builds it."""
    import dataclasses

    from dropless.config import ModelConfig
    from dropless.models.count import param_counts as model_counts

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class EveryOther(ModelConfig):
        def is_moe_layer(self, layer: int) -> bool:
            return self.moe is not None and layer % 2 == 1

    base = get_shape("deepseek3-test")
    cfg = EveryOther(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)})
    cfg = cfg.replace(num_layers=5, first_k_dense=0)
    assert num_moe_layers(cfg) == 2
    mine, theirs = param_counts(cfg), model_counts(cfg)
    assert (mine["total"], mine["active"], mine["mtp"]) == (theirs["total"], theirs["active"],
                                                            theirs["mtp"])


@pytest.mark.parametrize("kw, match", [
    ({"d_model": 0}, "ModelConfig.d_model=0"),
    ({"attention": "linear"}, "ModelConfig.attention='linear'"),
    ({"num_experts": 8, "top_k": 9, "moe_d_ff": 4}, "MoEConfig.top_k=9"),
    ({"num_experts": 8, "top_k": 2, "moe_d_ff": 4, "n_groups": 3}, "MoEConfig.n_groups=3"),
    ({"first_k_dense": 5}, "ModelConfig.first_k_dense=5"),
])
def test_bad_shapes_name_field_and_value(kw, match):
    base = dict(vocab_size=10, d_model=8, num_layers=2, num_heads=2, d_ff=16)
    with pytest.raises(ValueError, match=match.replace("(", r"\(")):
        model_config(**{**base, **kw})


def test_unknown_preset_lists_known():
    with pytest.raises(ValueError, match="preset='gpt5' is not known.*; known: "):
        get_shape("gpt5")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_counts_agree_with_the_trainers_model(name):
    """Two independent counts: the planner's arithmetic vs the shapes of the trainer's
    `init_params` (dropless.models.count)."""
    presets = pytest.importorskip("dropless.presets")
    from dropless.models.count import param_counts as model_counts
    cfg = presets.get_preset(name)
    mine = param_counts(cfg)
    theirs = model_counts(cfg)
    assert mine["total"] == theirs["total"]
    assert mine["active"] == theirs["active"]
    assert mine["mtp"] == theirs["mtp"]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_flops_agree_with_the_trainers_metrics(name):
    presets = pytest.importorskip("dropless.presets")
    from dropless.plan.flops import model_flops_per_token
    from dropless.train.metrics import flops_per_token
    cfg = presets.get_preset(name)
    seq = 4096
    theirs = flops_per_token(cfg, seq)["model"]
    mine = model_flops_per_token(cfg, seq)
    # the trainer counts causal attention over (S + 1) / 2 keys, the planner over S / 2
    assert mine == pytest.approx(theirs, rel=2e-3)
