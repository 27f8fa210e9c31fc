"""The arithmetic model (dropless.models.arithmetic) against its oracle, the shapes `init_params`
creates (dropless.models.count), part by part; its FLOPs against hand counts; the published
counts quoted once (presets.PUBLISHED_COUNTS) and equal in the README."""
import dataclasses
from pathlib import Path

import pytest

from dropless.config import ModelConfig, MoEConfig
from dropless.models import arithmetic as ar
from dropless.models import count
from dropless.presets import PRESETS, PUBLISHED_COUNTS, get_preset

ROOT = Path(__file__).resolve().parent.parent


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
