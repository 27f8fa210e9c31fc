"""The arithmetic model (dropless.models.arithmetic) against its oracle, the shapes `init_params`
creates (tests/_support/param_count.py), part by part; its FLOPs against hand counts; the published
counts quoted once (presets.PUBLISHED_COUNTS) and equal in the README; parameter counts by
hand, against the real arrays of the MoE layer and against published big-model counts."""
import dataclasses
import math

import jax
import pytest

from dropless.config import ModelConfig, MoEConfig
from dropless.models import arithmetic as ar
from tests._support import param_count as count
from dropless.models.arithmetic import attention_params, layer_params, param_counts
from dropless.presets import PRESETS, PUBLISHED_COUNTS, get_preset
from tests._support.model_configs import model_config
from tests._support.paths import ROOT


def _moe(d, **kw):
    return MoEConfig(**{"num_experts": 4, "top_k": 2, "d_model": d, "d_ff": 6, **kw})


BASE = dict(vocab_size=10, d_model=8, num_layers=3, num_heads=2, d_ff=16)
VARIANTS = {
    "dense_only": ModelConfig(**BASE, kv_lora_rank=4, qk_nope_head_dim=2, qk_rope_head_dim=2,
                              v_head_dim=2),
    "mha_gqa_qk_norm": ModelConfig(**BASE, attention="mha", num_kv_heads=1, head_dim=4,
                                   qk_norm=True, first_k_dense=1, moe=_moe(8)),
    "mha_tied": ModelConfig(**BASE, attention="mha", tie_embeddings=True, moe=_moe(8)),
    "mla_q_lora_mtp": ModelConfig(**BASE, q_lora_rank=4, kv_lora_rank=4, qk_nope_head_dim=2,
                                  qk_rope_head_dim=2, v_head_dim=3, mtp_depth=2,
                                  first_k_dense=1, moe=_moe(8)),
    "shared_experts": ModelConfig(**BASE, attention="mha", moe=_moe(8, num_shared_experts=2)),
    "dense_mtp": ModelConfig(**BASE, attention="mha", mtp_depth=1),
    "pattern": ModelConfig(**BASE, attention="mha", layer_pattern="MDM", moe=_moe(8)),
}
CONFIGS = {**{n: get_preset(n) for n in PRESETS}, **VARIANTS}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_counts_equal_the_init_params_shapes_part_by_part(name):
    cfg = CONFIGS[name]
    mine, theirs = ar.param_counts(cfg), count.param_counts(cfg)
    assert mine == theirs
    assert set(ar.PARTS) <= set(mine)


def test_layer_parts_add_up_and_use_the_same_keys():
    cfg = get_preset("deepseek3-test")
    c = ar.param_counts(cfg)
    for moe in (False, True):
        assert set(ar.layer_params(cfg, moe)) <= set(ar.PARTS)
    assert c["total"] == sum(c[p] for p in ar.PARTS if p != "mtp")


def test_the_layer_pattern_is_asked_of_the_config_only():
    """Which layers are MoE comes from ModelConfig.is_moe_layer(i) alone."""
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class EveryOther(ModelConfig):
        def is_moe_layer(self, layer: int) -> bool:
            return self.moe is not None and layer % 2 == 1

    base = get_preset("deepseek3-test")
    cfg = EveryOther(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)})
    cfg = cfg.replace(num_layers=5, first_k_dense=0)
    assert cfg.num_moe_layers == 2
    assert ar.param_counts(cfg) == count.param_counts(cfg)


def test_matmul_params_and_flops_are_one_description():
    """Model FLOPs = 6 x active matmul weights + attention (3 x 2 x H x (dqk + dv) x S/2 per
    attention layer, MTP included), for every preset."""
    for name in PRESETS:
        cfg = get_preset(name)
        seq = 4096
        w = ar.matmul_params(cfg)
        layers = cfg.num_layers + cfg.mtp_depth
        attention = 3 * layers * 2 * cfg.num_heads * (cfg.qk_head_dim + cfg.v_dim) * seq / 2
        want = 6 * (w["main"] + w["mtp"]) + attention
        assert ar.flops_per_token(cfg, seq)["model"] == pytest.approx(want, rel=1e-12), name


def test_capacity_padding_scales_every_routed_expert_matmul_mtp_included():
    cfg = get_preset("deepseek3-test")       # MTP module with an MoE block
    f = ar.flops_per_token(cfg, 64, capacity_factor=1.25)
    gmm = ar.forward_flops(cfg, 64)["gmm"]
    moe_blocks = cfg.num_moe_layers + cfg.mtp_depth
    assert gmm == moe_blocks * 2 * 3 * cfg.d_model * cfg.moe.d_ff * cfg.moe.top_k
    assert f["executed"] - f["model"] == pytest.approx(3 * gmm * 0.25)
    assert ar.flops_per_token(cfg.replace(moe=None, first_k_dense=0), 64,
                              capacity_factor=1.25)["executed"] == \
        ar.flops_per_token(cfg.replace(moe=None, first_k_dense=0), 64)["model"]


@pytest.mark.parametrize("name", sorted(PUBLISHED_COUNTS))
def test_published_counts_match_to_their_rounding_and_the_readme_quotes_them(name):
    total, active = PUBLISHED_COUNTS[name]
    c = ar.param_counts(get_preset(name))
    assert abs(c["total"] - total) / total < 0.01
    assert abs(c["active"] - active) / active < 0.03   # published actives are rounded
    readme = " ".join((ROOT / "README.md").read_text().split())
    fmt = lambda n: f"{n / 1e9:g}B"   # noqa: E731
    assert f"{fmt(total)} / {fmt(active)}" in readme, name
    assert f"{c['total'] / 1e9:.2f}B / {c['active'] / 1e9:.2f}B" in readme, name


def test_format_counts():
    assert ar.format_counts(ar.param_counts(get_preset("deepseek3-671b"))).startswith(
        "total 671.03B, active 37.55B per token, MTP 11.")


def test_big_presets_match_published_counts():
    for name, (total, active) in PUBLISHED_COUNTS.items():
        c = param_counts(get_preset(name))
        # published figures are rounded to 2-3 significant digits
        assert abs(c["total"] - total) / total < 0.01, (name, c["total"])
        assert abs(c["active"] - active) / active < 0.03, (name, c["active"])


def test_deepseek_v3_with_mtp_is_about_685b():
    # The released checkpoint is 685B: 671B main model + 14B MTP module (which, by the report,
    # counts the shared embedding and output head again: 2 x 129280 x 7168 = 1.85B).
    c = param_counts(get_preset("deepseek3-671b"))
    assert abs(c["mtp"] + c["embedding"] + c["lm_head"] - 14e9) / 14e9 < 0.05
    assert 682e9 < c["total"] + c["mtp"] + c["embedding"] + c["lm_head"] < 687e9


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
    assert p == {"q_down": 16 * 4, "q_norm": 4, "query": 4 * 2 * 5, "kv_down": 16 * 8,
                 "kv_norm": 6, "key": 6 * 2 * 3, "value": 6 * 2 * 5, "out": 2 * 5 * 16}


def test_moe_layer_counts_match_real_arrays():
    from dropless.moe import init_params
    s = get_preset("deepseek3-test")
    params = init_params(jax.random.key(0), s.moe)
    real = {k: sum(math.prod(a.shape) for a in v.values()) for k, v in params.items()}
    p = layer_params(s, True)
    assert real == {"router": p["router"], "experts": p["routed_experts"],
                    "shared": p["shared_experts"]}


def test_every_preset_builds():
    for name in PRESETS:
        c = param_counts(get_preset(name))
        assert 0 < c["active"] <= c["total"]


def test_model_settings_are_the_trainers_dotted_keys():
    """The planner's model settings go through config_file, as `dropless train`'s do (the
    planner's own flat names and `plan.shape.model_config` are gone)."""
    from dropless.plan.from_train import train_config
    base = [("preset", "deepseek3-test")]
    wider = train_config(base + [("model.d_model", 32), ("model.moe.top_k", 4)]).model
    assert (wider.moe.d_model, wider.moe.top_k, wider.moe.num_experts) == (32, 4, 8)
    dense = train_config(base + [("model.moe", None)]).model
    assert dense.moe is None and dense.num_moe_layers == 0
    with pytest.raises(ValueError, match="unknown config key 'model.moe.dff'"):
        train_config(base + [("model.moe.dff", 3)])


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
        get_preset("gpt5")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_counts_agree_with_the_trainers_model(name):
    """Two independent counts: the planner's arithmetic vs the shapes of the trainer's
    `init_params` (tests/_support/param_count.py)."""
    from tests._support.param_count import param_counts as model_counts
    cfg = get_preset(name)
    mine = param_counts(cfg)
    theirs = model_counts(cfg)
    assert mine["total"] == theirs["total"]
    assert mine["active"] == theirs["active"]
    assert mine["mtp"] == theirs["mtp"]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_the_planners_model_flops_are_the_trainers(name):
    """One FLOP model: the planner's model FLOPs per token are exactly the trainer's metric."""
    from dropless.machine import get_profile
    from dropless.models.arithmetic import flops_per_token
    from dropless.config import MeshConfig, TrainConfig
    from dropless.plan import PlanConfig, predict
    cfg = get_preset(name)
    seq = 4096
    ep = 8 if cfg.moe is not None else 1
    run = TrainConfig(model=cfg, mesh=MeshConfig(expert=ep), seq_len=seq)
    r = predict(PlanConfig(run=run), get_profile("h200"))
    assert r["flops"]["model_per_token"] == pytest.approx(flops_per_token(cfg, seq)["model"],
                                                          rel=1e-12)
