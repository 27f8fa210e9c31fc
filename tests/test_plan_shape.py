"""Parameter counts: hand counts, the real arrays of the MoE layer, published big-model counts."""
import math

import jax
import pytest

from dropless.plan.presets import PRESETS, PUBLISHED_PARAMS, get_shape, shape_of
from dropless.plan.shape import ModelShape, attention_params, layer_params, param_counts


def test_big_presets_match_published_counts():
    for name, (total, active) in PUBLISHED_PARAMS.items():
        c = param_counts(get_shape(name, prefer_trainer=False))
        # published figures are rounded to 2-3 significant digits
        assert abs(c["total"] - total) / total < 0.01, (name, c["total"])
        assert abs(c["active"] - active) / active < 0.03, (name, c["active"])


def test_deepseek_v3_with_mtp_is_about_685b():
    # The released checkpoint is 685B: 671B main model + 14B MTP module (which, by the report,
    # counts the shared embedding and output head again: 2 x 129280 x 7168 = 1.85B).
    c = param_counts(get_shape("deepseek3-671b", prefer_trainer=False))
    assert abs(c["mtp"] + c["embedding"] + c["head"] - 14e9) / 14e9 < 0.05
    assert 682e9 < c["total_with_mtp"] + c["embedding"] + c["head"] < 687e9


def test_hand_count_mha_moe():
    # D=8, V=10, L=2 (1 dense), H=2, G=1, Kh=4, Fd=16, E=4, K=2, F=6, 1 shared, untied.
    s = ModelShape(vocab_size=10, d_model=8, num_layers=2, num_heads=2, num_kv_heads=1,
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
    s = ModelShape(vocab_size=4, d_model=16, num_layers=1, num_heads=2, d_ff=8,
                   attention="mla", q_lora_rank=4, kv_lora_rank=6, qk_nope_head_dim=3,
                   qk_rope_head_dim=2, v_head_dim=5)
    p = attention_params(s)
    assert p == {"q_down": 16 * 4 + 4, "query": 4 * 2 * 5, "kv_down": 16 * 8 + 6,
                 "key": 6 * 2 * 3, "value": 6 * 2 * 5, "out": 2 * 5 * 16}


def test_moe_layer_counts_match_real_arrays():
    from dropless.config import MoEConfig
    from dropless.moe import init_params
    s = get_shape("deepseek3-test", prefer_trainer=False)
    cfg = MoEConfig(num_experts=s.num_experts, top_k=s.top_k, d_model=s.d_model,
                    d_ff=s.moe_d_ff, num_shared_experts=s.num_shared_experts,
                    n_groups=s.n_groups, topk_groups=s.topk_groups)
    params = init_params(jax.random.key(0), cfg)
    real = {k: sum(math.prod(a.shape) for a in v.values()) for k, v in params.items()}
    p = layer_params(s, True)
    assert real == {"router": p["router"], "experts": p["experts"], "shared": p["shared"]}


def test_every_preset_builds():
    for name in PRESETS:
        c = param_counts(get_shape(name))
        assert 0 < c["active"] <= c["total"]


def test_shape_of_reads_model_config_fields():
    class Moe:
        num_experts, top_k, d_ff, num_shared_experts, n_groups, topk_groups = 8, 2, 32, 1, 1, 1

    class Model:
        vocab_size, d_model, num_layers, num_heads, d_ff, attention = 100, 16, 2, 2, 64, "mha"
        first_k_dense, num_kv_heads, head_dim, qk_norm, q_lora_rank = 1, 0, 0, False, 0
        kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim = 512, 128, 64, 128
        tie_embeddings, mtp_depth, moe = True, 0, Moe()

    s = shape_of(Model(), "x")
    assert (s.num_experts, s.moe_d_ff, s.tie_embeddings, s.num_moe_layers) == (8, 32, True, 1)


@pytest.mark.parametrize("kw, match", [
    ({"d_model": 0}, "ModelShape.d_model=0"),
    ({"attention": "linear"}, "ModelShape.attention='linear'"),
    ({"num_experts": 8, "top_k": 9, "moe_d_ff": 4}, "ModelShape.top_k=9"),
    ({"num_experts": 8, "top_k": 2, "moe_d_ff": 4, "n_groups": 3}, "ModelShape.n_groups=3"),
    ({"first_k_dense": 5}, "ModelShape.first_k_dense=5"),
])
def test_bad_shapes_name_field_and_value(kw, match):
    base = dict(vocab_size=10, d_model=8, num_layers=2, num_heads=2, d_ff=16)
    with pytest.raises(ValueError, match=match.replace("(", r"\(")):
        ModelShape(**{**base, **kw})


def test_unknown_preset_lists_known():
    with pytest.raises(ValueError, match="preset='gpt5' is unknown; known presets"):
        get_shape("gpt5")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_counts_agree_with_the_trainers_model(name):
    """Two independent counts: the planner's arithmetic vs the shapes of the trainer's
    `init_params` (dropless.models.count)."""
    presets = pytest.importorskip("dropless.presets")
    from dropless.models.count import param_counts as model_counts
    cfg = presets.get_preset(name)
    mine = param_counts(shape_of(cfg, name))
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
    mine = model_flops_per_token(shape_of(cfg, name), seq)
    # the trainer counts causal attention over (S + 1) / 2 keys, the planner over S / 2
    assert mine == pytest.approx(theirs, rel=2e-3)
