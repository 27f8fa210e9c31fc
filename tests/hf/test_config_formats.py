"""Both transformers config.json formats (4.x and 5.x, see dropless.hf.config_formats): the
same model either way, contradictions between the two spellings refused naming both keys, every
bad value refused naming file, key and value, defaults equal to transformers' own, and the
config `hf.save` writes loads to the same model in transformers 4.57.6, 5.24.0 and 5.25.0."""
import copy
import json
import os

import pytest

from dropless import hf
from dropless.hf import config_map as cm
from dropless.hf.config_formats import DEFAULTS, BadConfig, UnsupportedCheckpoint, canonical
from dropless.hf.round_trip import exported_config
from tests._support.paths import HF_FIXTURES

FIX = HF_FIXTURES
SAVED = FIX / "saved_configs"
NAMES = ["deepseek_v3_yarn", "deepseek_v3_plain", "mixtral", "qwen3_moe"]


def conf(name: str, version: str = "tf4") -> dict:
    folder = FIX / name if version == "tf4" else FIX / "tf5" / name
    return json.loads((folder / "config.json").read_text())


def model(hf_conf: dict):
    depth = int(hf_conf.get("num_nextn_predict_layers") or 0)
    return cm.model_config(hf_conf, mtp_depth=depth)[0]


def test_defaults_are_transformers_defaults():
    """DEFAULTS (used for keys a config.json leaves out) equal the configuration classes'
    defaults in every version (recorded by tools/make_hf_fixtures.py)."""
    recorded = json.loads((FIX / "transformers_defaults.json").read_text())
    for arch, defaults in DEFAULTS.items():
        assert set(recorded[arch]) == {"4.57.6", "5.24.0", "5.25.0"}
        for version, theirs in recorded[arch].items():
            assert defaults == theirs, (arch, version)


@pytest.mark.parametrize("name", NAMES)
def test_5x_spelling_reads_as_4x(name):
    """The 5.x fixture's config (rope_parameters, num_local_experts, dtype) is the model its
    4.x counterpart describes; the written files really differ in spelling."""
    four, five = conf(name), conf(name, "tf5")
    assert "rope_parameters" in five and "rope_parameters" not in four
    # (5.x writes num_nextn_predict_layers=1, its default, even for a model without MTP
    # tensors: the loader counts the modules the folder holds, so compare without MTP)
    assert cm.model_config(four)[0] == cm.model_config(five)[0]


def test_mixtral_without_rope_keys_takes_its_own_default():
    c = conf("mixtral", "tf5")
    del c["rope_parameters"]
    assert model(c).rope_theta == 1e6   # MixtralConfig.default_theta, not 1e4
    c = conf("qwen3_moe", "tf5")
    del c["rope_parameters"]
    assert model(c).rope_theta == 1e4


def test_same_value_in_both_spellings_is_fine():
    c = conf("mixtral", "tf5")
    c.update(rope_theta=1000000, num_experts=4, torch_dtype="float32")   # int 1e6, as 4.x wrote
    assert model(c) == model(conf("mixtral", "tf5"))


def test_5x_yarn_in_rope_parameters():
    cfg = model(conf("deepseek_v3_yarn", "tf5"))
    assert cfg.rope_type == "yarn" and cfg.rope_factor == 4.0 and cfg.rope_mscale == 0.707


@pytest.mark.parametrize("name,edit,words", [
    ("mixtral", lambda c: c.update(rope_theta=1e4), ("rope_theta=10000.0",
                                                     "rope_parameters.rope_theta=1000000.0")),
    ("deepseek_v3_yarn", lambda c: c.update(rope_scaling={"type": "yarn", "factor": 8.0}),
     ("rope_scaling=", "rope_parameters=")),
    ("qwen3_moe", lambda c: c.update(num_experts=4), ("num_experts=4", "num_local_experts=8")),
    ("mixtral", lambda c: c.update(num_experts=2), ("num_local_experts=4", "num_experts=2")),
    ("deepseek_v3_yarn", lambda c: c.update(num_local_experts=4),
     ("n_routed_experts=8", "num_local_experts=4")),
    ("deepseek_v3_yarn", lambda c: c.update(num_mtp_layers=2),
     ("num_nextn_predict_layers=1", "num_mtp_layers=2")),
    ("mixtral", lambda c: c.update(torch_dtype="bfloat16"), ("torch_dtype='bfloat16'",
                                                             "dtype='float32'")),
    ("mixtral", lambda c: c.update(model_type="qwen3_moe"), ("model_type='qwen3_moe'",
                                                             "architectures=")),
    ("deepseek_v3_yarn", lambda c: c["rope_parameters"].update(rope_type="default"),
     ("rope_parameters.type='yarn'", "rope_parameters.rope_type='default'")),
])
def test_contradicting_spellings_name_both_keys(name, edit, words):
    c = conf(name, "tf5")
    edit(c)
    with pytest.raises(BadConfig) as e:
        model(c)
    for w in words:
        assert w in str(e.value)


def _drop(key):
    return lambda c: c.pop(key)


@pytest.mark.parametrize("name,edit,words", [
    ("mixtral", _drop("hidden_size"), ("hidden_size is missing",)),
    ("deepseek_v3_yarn", _drop("kv_lora_rank"), ("kv_lora_rank is missing",)),
    ("qwen3_moe", lambda c: c.update(num_experts_per_tok=None), ("num_experts_per_tok=None",)),
    ("mixtral", lambda c: c.update(num_hidden_layers="2"), ("num_hidden_layers='2'",)),
    ("mixtral", lambda c: c.update(tie_word_embeddings="false"), ("tie_word_embeddings='false'",)),
    ("mixtral", lambda c: c.update(rms_norm_eps=None), ("rms_norm_eps=None",)),
    ("qwen3_moe", lambda c: c.update(mlp_only_layers="3"), ("mlp_only_layers='3'",)),
    ("deepseek_v3_yarn", lambda c: c.update(rope_scaling="yarn"), ("rope_scaling='yarn'",)),
    ("deepseek_v3_yarn", lambda c: c["rope_scaling"].pop("factor"), ("rope_scaling.factor",)),
    ("deepseek_v3_yarn", lambda c: c["rope_scaling"].update(beta_fast="32"),
     ("rope_scaling.beta_fast='32'",)),
    ("mixtral", lambda c: c.update(dtype="int8"), ("dtype='int8'",)),
])
def test_bad_values_name_key_and_value(name, edit, words, tmp_path):
    c = conf(name)
    edit(c)
    (tmp_path / "config.json").write_text(json.dumps(c))
    with pytest.raises(BadConfig) as e:
        hf.read_config(tmp_path)
    msg = str(e.value)
    assert msg.startswith(str(tmp_path / "config.json")) and "\n" not in msg
    for w in words:
        assert w in msg


def test_non_json_config_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["MixtralForCausalLM"],')
    with pytest.raises(BadConfig, match="config.json: is not valid JSON"):
        hf.read_config(tmp_path)


def test_architecture_from_model_type_alone():
    c = conf("mixtral")
    del c["architectures"]
    assert model(c) == model(conf("mixtral"))


@pytest.mark.parametrize("version", ["tf4", "tf5"])
@pytest.mark.parametrize("name", ["mixtral_sliding", "qwen3_moe_sliding"])
def test_sliding_window_refused(name, version):
    """Config-only fixtures transformers wrote with a sliding window: refused, not ignored."""
    folder = FIX / name if version == "tf4" else FIX / "tf5" / name
    with pytest.raises(UnsupportedCheckpoint, match="sliding_window=8"):
        hf.read_config(folder)


def test_canonical_is_idempotent():
    for name in NAMES:
        once = canonical(conf(name, "tf5"))
        assert canonical(copy.deepcopy(once)) == once


@pytest.mark.parametrize("name", NAMES)
def test_saved_config_is_the_one_checked_with_both_transformers(name):
    """The config.json hf.save writes for each fixture model (with no source keys kept) is
    the one committed under saved_configs/, which tools/make_hf_fixtures.py loaded with the
    fixture weights in transformers 4.57.6, 5.24.0 and 5.25.0 and ran against the reference
    logits (save_compat.json).
    DROPLESS_WRITE_SAVED_CONFIGS=1 rewrites them (then rerun the tool in both venvs)."""
    cfg, lay = hf.read_config(FIX / name)
    ours = json.loads(json.dumps(exported_config(cfg, rope_interleave=lay.rope_interleave)))
    path = SAVED / f"{name}.json"
    if os.environ.get("DROPLESS_WRITE_SAVED_CONFIGS"):
        SAVED.mkdir(exist_ok=True)
        path.write_text(json.dumps(ours, indent=2) + "\n")
    assert json.loads(path.read_text()) == ours
    compat = json.loads((FIX / "save_compat.json").read_text())[name]
    assert set(compat) == {"4.57.6", "5.24.0", "5.25.0"}
    for version, per_weights in compat.items():
        assert set(per_weights) == {"tf4", "tf5"}
        for weights, err in per_weights.items():
            assert err <= 1e-4, (version, weights, err)
