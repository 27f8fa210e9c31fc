"""The released Hugging Face configs (tests/fixtures/hf/released/*/config.json, copies of the hub
files: see SOURCES.md there) against `transformers` and our presets: each loads to a ModelConfig
whose parameter count is the one transformers 4.57.6, 5.24.0 and 5.25.0 report on the meta device
(released/param_counts.json, written by tools/make_hf_fixtures.py; DeepSeek-V3's router bias is
a buffer there, so not counted), and the presets named after them are the same model."""
import dataclasses
import json

import pytest

from dropless.hf import config_map as cm
from dropless.models.arithmetic import param_counts
from dropless.presets import get_preset
from tests._support.paths import HF_FIXTURES

RELEASED = HF_FIXTURES / "released"
COUNTS = json.loads((RELEASED / "param_counts.json").read_text())
NAMES = sorted(p.parent.name for p in RELEASED.glob("*/config.json"))
PRESETS = {"deepseek3-671b": "deepseek-v3", "mixtral-8x7b": "mixtral-8x7b",
           "qwen3-30b-a3b": "qwen3-30b-a3b"}
# training-only settings where the preset follows the paper rather than config.json
# (DeepSeek-V3's report uses a 1e-4 sequence-wise loss; config.json says aux_loss_alpha=0.001)
TRAINING_ONLY = {"seq_aux_coef", "load_balance_coef", "bias_update_speed"}


def released(name: str):
    conf = json.loads((RELEASED / name / "config.json").read_text())
    depth = int(conf.get("num_nextn_predict_layers") or 0)
    return cm.model_config(conf, mtp_depth=depth)[0]


def test_every_released_config_has_counts_from_both_versions():
    assert NAMES and set(NAMES) == set(COUNTS)
    for name in NAMES:
        assert set(COUNTS[name]) == {"4.57.6", "5.24.0", "5.25.0"}, name


@pytest.mark.parametrize("name", NAMES)
def test_released_config_parameter_count_equals_transformers(name):
    counts = param_counts(released(name))
    # our router bias (bias_E) exists for every MoE layer; transformers counts none of it
    for version, n in COUNTS[name].items():
        assert counts["total"] - counts["router_bias"] == n, version


def test_both_formats_of_one_release_are_one_model():
    a = released("qwen3-235b-a22b-instruct-2507")
    b = released("qwen3-235b-a22b-instruct-2507.tf5")
    assert a == b and a.rope_theta == 5e6 and a.moe.num_experts == 128


def test_released_configs_read_the_right_values():
    ds = released("deepseek-v3")
    assert (ds.rope_type, ds.rope_factor, ds.rope_original_max_position) == ("yarn", 40.0, 4096)
    assert ds.mtp_depth == 1 and ds.first_k_dense == 3 and ds.weight_dtype == "bfloat16"
    assert (ds.moe.n_groups, ds.moe.topk_groups, ds.moe.routed_scaling_factor) == (8, 4, 2.5)
    big = released("mixtral-8x22b")   # leaves sliding_window out: transformers' default None
    assert big.rope_theta == 1e6 and big.moe.num_experts == 8 and big.num_layers == 56
    thinking = released("qwen3-30b-a3b-thinking-2507.tf5")
    assert thinking.rope_theta == 1e7 and thinking.moe.num_experts == 128


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_is_the_released_config(preset):
    ours = released(PRESETS[preset])
    want = get_preset(preset)
    assert ours.mha_head_dim == want.mha_head_dim and ours.kv_heads == want.kv_heads
    ours = ours.replace(head_dim=want.head_dim, num_kv_heads=want.num_kv_heads)
    moe_diff = {f.name for f in dataclasses.fields(want.moe)
                if getattr(ours.moe, f.name) != getattr(want.moe, f.name)}
    assert moe_diff <= TRAINING_ONLY
    assert ours.replace(moe=want.moe) == want
    assert param_counts(ours)["total"] == param_counts(want)["total"]


def test_the_yarn_table_reads_back_what_it_writes():
    """Every field of YARN_FIELDS survives ModelConfig -> rope_scaling -> ModelConfig, written
    only where it differs from what its absence means (beyond the always-written keys)."""
    import dataclasses

    from dropless.hf import config_map as cm
    from dropless.presets import get_preset
    base = get_preset("deepseek3-test")
    cfg = dataclasses.replace(base, rope_type="yarn", rope_factor=40.0,
                              rope_original_max_position=4096, rope_beta_fast=16.0,
                              rope_beta_slow=2.0, rope_mscale=1.0, rope_mscale_all_dim=0.0)
    d = cm._yarn_dict(cfg)
    assert d == {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                 "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 1.0}
    assert set(d) <= cm.YARN_KEYS
    f = cm.Fields({"rope_theta": 1e4, "rope_scaling": d, "max_position_embeddings": 163840},
                  cm.DEEPSEEK)
    back = cm._rope(f)
    for _, field, _, _ in cm.YARN_FIELDS:
        assert back[field] == getattr(cfg, field), field
