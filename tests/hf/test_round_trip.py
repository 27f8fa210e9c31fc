"""HF config.json -> dropless -> config.json (dropless.hf.round_trip), on the released configs
and the fixtures of both transformers formats: what the model does not determine comes back
verbatim (context length, token ids, unknown keys), what it determines is written from it and
wins over a kept value, and the keys kept are exactly those the import does not read.

With DROPLESS_TRANSFORMERS_PYTHON (space-separated interpreters that have transformers, e.g.
the venvs of tools/make_hf_fixtures.py), the exported files are also loaded with
`transformers.AutoConfig.from_pretrained` there and their attributes compared."""
import json
import os
import subprocess

import pytest

from dropless.hf import config_map as cm
from dropless.hf import round_trip as rt
from dropless.hf.config_formats import BadConfig
from tests._support.paths import HF_FIXTURES

RELEASED = HF_FIXTURES / "released"
SOURCES = {   # one of each architecture as released, and the 5.x spelling of two
    "mixtral": RELEASED / "mixtral-8x7b", "qwen3": RELEASED / "qwen3-30b-a3b",
    "deepseek": RELEASED / "deepseek-v3",
    "qwen3-tf5": RELEASED / "qwen3-30b-a3b-thinking-2507.tf5",
    "deepseek-yarn-tf5": HF_FIXTURES / "tf5" / "deepseek_v3_yarn",
    "mixtral-tf5": HF_FIXTURES / "tf5" / "mixtral"}
UNKNOWN = {"a_key_of_a_later_release": {"nested": [1, 2.5, None]}}


def raw(name: str) -> dict:
    return json.loads((SOURCES[name] / "config.json").read_text())


def model(conf: dict):
    depth = int(conf.get("num_nextn_predict_layers", conf.get("num_mtp_layers")) or 0)
    return cm.model_config(conf, mtp_depth=depth)[0]


def same(cfg):
    """cfg with a derived head_dim (0) said as its value, which the export writes."""
    return cfg if cfg.attention == "mla" else cfg.replace(head_dim=cfg.mha_head_dim)


def through_dropless(conf: dict) -> dict:
    """What `dropless convert` there and back writes for config.json `conf` (no weights)."""
    return rt.exported_config(model(conf), rt.kept_keys(conf))


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_round_trip_keeps_what_the_model_does_not_determine(name):
    conf = {**raw(name), **UNKNOWN, "initializer_range": 0.0125}
    out = through_dropless(conf)
    for key in ("max_position_embeddings", "bos_token_id", "eos_token_id",
                "initializer_range", *UNKNOWN):
        assert out[key] == conf[key], key
    for key, value in conf.items():   # every key comes back, but the writer's and aliases
        if key not in rt.MODEL_KEYS | rt.WRITER_KEYS:
            assert out[key] == value, key
    assert not set(out) & rt.WRITER_KEYS
    assert same(model(out)) == same(model(conf))   # and describes the same model
    assert through_dropless(out) == out


def test_the_released_context_lengths_come_back():
    """The bug this guards: every non-YaRN export said 4096."""
    assert {n: through_dropless(raw(n))["max_position_embeddings"] for n in
            ("mixtral", "qwen3", "deepseek")} == {"mixtral": 32768, "qwen3": 40960,
                                                   "deepseek": 163840}


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_kept_keys_are_the_ones_the_import_does_not_read(name):
    """Changing or deleting any kept key leaves the model as it was: none is interpreted (so
    none can contradict the model). max_position_embeddings is YaRN's original length only
    when rope_scaling has none; these configs give it."""
    conf = raw(name)
    before = model(conf)
    for key in rt.kept_keys(conf):
        if key in conf:
            assert model({k: v for k, v in conf.items() if k != key}) == before, key
            assert model({**conf, key: "not read"}) == before, key


def test_keys_absent_from_the_source_mean_transformers_defaults():
    conf = raw("mixtral")
    del conf["max_position_embeddings"]
    assert rt.kept_keys(conf)["max_position_embeddings"] == 131072   # MixtralConfig's default


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_every_key_the_model_writes_is_a_model_key(name):
    """hf_config's keys are MODEL_KEYS (never kept), or the one it writes only where the model
    has it: a DeepSeek-V3 with a sequence-wise loss writes seq_aux and aux_loss_alpha."""
    cfg = model(raw(name))
    if cfg.moe.score_func == "sigmoid":
        cfg = cfg.replace(moe=cfg.moe.replace(seq_aux_coef=1e-4))
    written = set(cm.hf_config(cfg, cm.Layout(cm.architecture_for(cfg))))
    assert "aux_loss_alpha" in written or cfg.moe.score_func != "sigmoid"
    assert written <= rt.MODEL_KEYS | rt.MODEL_WHEN_SET, written - rt.MODEL_KEYS


def test_the_model_wins_over_a_kept_key_that_contradicts_it():
    """An edited side file (another vocab_size, another rope_scaling): the model's values are
    written, and `overridden` names each."""
    conf = raw("deepseek")
    cfg = model(conf)
    kept = {**rt.kept_keys(conf), "vocab_size": 7, "rope_scaling": None, "hidden_act": "gelu"}
    out = rt.exported_config(cfg, kept)
    assert out["vocab_size"] == cfg.vocab_size == 129280 and out["hidden_act"] == "silu"
    assert out["rope_scaling"]["factor"] == 40
    assert rt.overridden(cfg, kept) == {"vocab_size": (7, 129280),
                                        "rope_scaling": (None, out["rope_scaling"]),
                                        "hidden_act": ("gelu", "silu")}
    assert rt.overridden(cfg, rt.kept_keys(conf)) == {}


def test_a_yarn_context_is_the_kept_one_else_original_times_factor():
    """Qwen3's YaRN recipe adds rope_scaling (factor 4 over 32768) and leaves
    max_position_embeddings=40960: kept as it was (transformers computes YaRN from factor and
    original_max_position_embeddings, both written). Without one: 32768 x 4, over a run's
    seq_len."""
    conf = {**raw("qwen3"), "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                             "original_max_position_embeddings": 32768}}
    cfg = model(conf)
    assert through_dropless(conf)["max_position_embeddings"] == 40960
    assert rt.exported_config(cfg, fallback={"max_position_embeddings": 512})[
        "max_position_embeddings"] == 131072


def test_initializer_range_is_the_models_init_std():
    cfg = model(raw("qwen3")).replace(init_std=0.006)
    assert rt.exported_config(cfg, {"initializer_range": 0.5})["initializer_range"] == 0.006


def test_fallbacks_fill_only_what_is_kept_nowhere():
    cfg = model(raw("mixtral"))
    assert rt.exported_config(cfg)["max_position_embeddings"] == rt.DEFAULT_MAX_POSITIONS
    assert "bos_token_id" not in rt.exported_config(cfg)
    got = rt.exported_config(cfg, {"eos_token_id": 2},
                             fallback={"max_position_embeddings": 512, "eos_token_id": 9,
                                       "bos_token_id": 8})
    assert (got["max_position_embeddings"], got["eos_token_id"], got["bos_token_id"]) == \
        (512, 2, 8)


def test_the_sequence_wise_loss_goes_both_ways():
    conf = {**raw("deepseek"), "seq_aux": True, "aux_loss_alpha": 1e-4}
    out = through_dropless(conf)
    assert (out["seq_aux"], out["aux_loss_alpha"]) == (True, 1e-4)
    off = {**conf, "seq_aux": False}          # alpha is then unused, and kept as it was
    out = through_dropless(off)
    assert (out["seq_aux"], out["aux_loss_alpha"]) == (False, 1e-4)
    assert model(out).moe.seq_aux_coef == 0


@pytest.mark.parametrize("name", ["mixtral", "qwen3", "deepseek"])
def test_a_sequence_wise_loss_only_deepseek_can_carry_is_named(name):
    cfg = model(raw(name))
    assert rt.not_carried(cfg) == {}
    on = cfg.replace(moe=cfg.moe.replace(seq_aux_coef=1e-3))
    out = rt.exported_config(on)
    if name == "deepseek":
        assert rt.not_carried(on) == {} and out["aux_loss_alpha"] == 1e-3
    else:   # dropped from the file, named for the line the export says
        assert rt.not_carried(on) == {"moe.seq_aux_coef": 1e-3}
        assert not {"seq_aux", "aux_loss_alpha"} & set(out)
        assert out == rt.exported_config(cfg)


def test_what_the_import_turned_into_the_model_is_not_kept():
    """FP8 weights are dequantized on import: the export holds no quantization_config; 5.x's
    spellings come back in the 4.x ones (never both, which would contradict after --dtype)."""
    kept = rt.kept_keys(raw("deepseek"))
    assert not {"quantization_config", "auto_map", "transformers_version"} & set(kept)
    kept5 = rt.kept_keys(raw("qwen3-tf5"))
    assert not {"rope_parameters", "dtype", "num_local_experts", "num_experts"} & set(kept5)
    cfg = model(raw("qwen3-tf5"))
    out = rt.exported_config(cfg.replace(dtype="float16", weight_dtype="float16",
                                         moe=cfg.moe.replace(dtype="float16",
                                                             weight_dtype="float16")), kept5)
    assert out["torch_dtype"] == "float16" and "dtype" not in out


def test_kept_keys_of_an_unsupported_architecture_is_refused():
    with pytest.raises(ValueError, match="architectures"):
        rt.kept_keys({"architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(BadConfig, match="model_type"):
        rt.kept_keys({"architectures": ["MixtralForCausalLM"], "model_type": "qwen3_moe"})


TRANSFORMERS = os.environ.get("DROPLESS_TRANSFORMERS_PYTHON", "").split()
LOAD = """
import json, sys, transformers
c = transformers.AutoConfig.from_pretrained(sys.argv[1])
keys = json.loads(sys.argv[2])
print(json.dumps({"version": transformers.__version__, "class": type(c).__name__,
                  **{k: getattr(c, k, "<absent>") for k in keys}}))
"""


@pytest.mark.skipif(not TRANSFORMERS, reason="DROPLESS_TRANSFORMERS_PYTHON names no "
                                             "interpreter with transformers")
@pytest.mark.parametrize("python", TRANSFORMERS)
@pytest.mark.parametrize("name", sorted(SOURCES))
def test_exported_config_loads_in_transformers_with_the_kept_values(name, python, tmp_path):
    conf = {**raw(name), "pad_token_id": 5, "use_cache": False, "initializer_range": 0.0125}
    out = through_dropless(conf)
    (tmp_path / "config.json").write_text(json.dumps(out))
    keys = ["max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
            "initializer_range", "use_cache", "vocab_size", "num_hidden_layers"]
    got = json.loads(subprocess.run([python, "-c", LOAD, str(tmp_path), json.dumps(keys)],
                                    capture_output=True, text=True, check=True).stdout)
    want = {k: conf[k] for k in keys}
    assert {k: got[k] for k in keys} == want, got["version"]
    assert got["class"] == {"MixtralForCausalLM": "MixtralConfig",
                            "Qwen3MoeForCausalLM": "Qwen3MoeConfig",
                            "DeepseekV3ForCausalLM": "DeepseekV3Config"}[out["architectures"][0]]
