"""The full-size presets against the released Hugging Face configs: the same model, and the same
parameter count as `transformers` reports (counted on the meta device by
tools/make_hf_fixtures.py; DeepSeek-V3's router bias is a buffer there, so not counted)."""
import dataclasses
import json
from pathlib import Path

import pytest

from dropless.hf import config_map as cm
from dropless.models.count import param_counts
from dropless.presets import get_preset

REF = json.loads((Path(__file__).parent / "fixtures" / "hf" / "reference_param_counts.json"
                  ).read_text())
# training-only settings where the preset follows the paper rather than config.json
# (DeepSeek-V3's report uses a 1e-4 sequence-wise loss; config.json says aux_loss_alpha=0.001)
TRAINING_ONLY = {"seq_aux_coef", "load_balance_coef", "bias_update_speed"}


@pytest.mark.parametrize("preset", sorted(REF))
def test_preset_parameter_count_equals_transformers(preset):
    counts = param_counts(get_preset(preset))
    # our router bias (bias_E) exists for every MoE layer; transformers counts none of it
    assert counts["total"] - counts["router_bias"] == REF[preset]["parameters"]


@pytest.mark.parametrize("preset", sorted(REF))
def test_preset_is_the_released_config(preset):
    ref = REF[preset]["config"]
    depth = int(ref.get("num_nextn_predict_layers") or 0)
    ours, _ = cm.model_config(ref, mtp_depth=depth)
    want = get_preset(preset)
    assert ours.mha_head_dim == want.mha_head_dim and ours.kv_heads == want.kv_heads
    ours = ours.replace(head_dim=want.head_dim, num_kv_heads=want.num_kv_heads)
    moe_diff = {f.name for f in dataclasses.fields(want.moe)
                if getattr(ours.moe, f.name) != getattr(want.moe, f.name)}
    assert moe_diff <= TRAINING_ONLY
    assert ours.replace(moe=want.moe) == want
    assert param_counts(ours)["total"] == param_counts(want)["total"]
