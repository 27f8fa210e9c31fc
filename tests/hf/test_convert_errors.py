"""Unsupported Hugging Face checkpoints and configs: each error names the key and its value."""
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from dropless import hf
from dropless.config import ModelConfig, MoEConfig
from dropless.models.decoder import init_params
from tests._support.paths import HF_FIXTURES

FIX = HF_FIXTURES


def _copy(name: str, tmp_path: Path, **changes) -> Path:
    d = tmp_path / name
    shutil.copytree(FIX / name, d)
    conf = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None and k in conf and k != "rope_scaling":
            del conf[k]
        else:
            conf[k] = v
    (d / "config.json").write_text(json.dumps(conf))
    return d


@pytest.mark.parametrize("name,changes,match", [
    ("mixtral", {"architectures": ["LlamaForCausalLM"]}, "architectures=\\['LlamaForCausalLM'\\]"),
    ("mixtral", {"sliding_window": 4096}, "sliding_window=4096"),
    ("mixtral", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("qwen3_moe", {"attention_bias": True}, "attention_bias=True"),
    ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 128}, "sliding_window=128"),
    ("qwen3_moe", {"rope_scaling": {"type": "linear", "factor": 2.0}},
     "rope_scaling.type='linear'"),
    ("qwen3_moe", {"mlp_only_layers": [9]}, "mlp_only_layers=\\[9\\]"),
    ("deepseek_v3_yarn", {"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ("deepseek_v3_yarn", {"moe_layer_freq": 2}, "moe_layer_freq=2"),
    ("deepseek_v3_yarn", {"rope_scaling": {"type": "yarn", "factor": 4.0,
                                           "attention_factor": 2.0}},
     "rope_scaling.attention_factor=2.0"),
    ("deepseek_v3_yarn", {"rope_scaling": {"type": "yarn", "factor": 4.0, "low_freq": 1}},
     "rope_scaling.low_freq=1"),
    ("deepseek_v3_fp8", {"quantization_config": {"quant_method": "gptq", "bits": 4}},
     "quantization_config="),
])
def test_unsupported_config_names_key(name, changes, match, tmp_path):
    d = _copy(name, tmp_path, **changes)
    with pytest.raises(hf.UnsupportedCheckpoint, match=match):
        hf.load(d)


def test_shape_mismatch_names_tensor(tmp_path):
    d = _copy("mixtral", tmp_path, intermediate_size=32)
    with pytest.raises(ValueError, match="block_sparse_moe.experts.0.w1.weight"):
        hf.load(d)


def test_unmapped_tensor_is_an_error(tmp_path):
    from safetensors.numpy import save_file
    from safetensors.numpy import load_file
    d = _copy("qwen3_moe", tmp_path)
    tensors = load_file(str(d / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_proj.bias"] = np.zeros(32, np.float32)
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match="q_proj.bias"):
        hf.load(d)


def test_missing_folder_or_weights(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        hf.load(tmp_path)
    shutil.copy(FIX / "mixtral" / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        hf.load(tmp_path)


def test_mtp_depth_beyond_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="mtp_depth=2"):
        hf.load(FIX / "deepseek_v3_yarn", mtp_depth=2)


def _zeros(cfg):
    """Zero parameters of cfg's shapes (no compilation: values do not matter here)."""
    shapes = jax.eval_shape(lambda k: init_params(k, cfg), jax.random.key(0))
    return jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)


def _gqa(**moe):
    m = dict(num_experts=4, top_k=2, d_model=16, d_ff=8, score_func="softmax")
    m.update(moe)
    return ModelConfig(vocab_size=32, d_model=16, num_layers=2, num_heads=2, d_ff=8,
                       attention="mha", moe=MoEConfig(**m))


@pytest.mark.parametrize("cfg,match", [
    (_gqa(num_shared_experts=1), "moe.num_shared_experts=1 cannot be saved as Mixtral"),
    (_gqa(score_func="sigmoid"), "moe.score_func='sigmoid'"),
    (_gqa().replace(layer_pattern="DM"), "layer_pattern='DM'"),
    (_gqa().replace(qk_norm=True, mtp_depth=1), "mtp_depth=1"),
])
def test_save_refuses_what_the_architecture_cannot_hold(cfg, match, tmp_path):
    params = _zeros(cfg)
    with pytest.raises(hf.UnsupportedCheckpoint, match=match):
        hf.save(cfg, params, tmp_path)


def test_save_refuses_nonzero_bias_for_softmax(tmp_path):
    cfg = _gqa()
    params = _zeros(cfg)
    params["layers"][1]["moe"]["router"]["bias_E"][0] = 0.5
    with pytest.raises(hf.UnsupportedCheckpoint, match="layers/1/moe/router/bias_E"):
        hf.save(cfg, params, tmp_path)


@pytest.mark.parametrize("name,changes,words", [
    ("mixtral", {"num_experts_per_tok": 8},
     "config.json: num_experts_per_tok=8, num_local_experts=4 do not describe a valid model "
     "(MoEConfig.top_k=8 must be <= num_experts=4); correct config.json"),
    ("mixtral", {"num_key_value_heads": 3}, "config.json: num_key_value_heads=3, "
                                            "num_attention_heads=4 do not describe"),
    ("qwen3_moe", {"num_experts_per_tok": 99}, "num_experts_per_tok=99, num_experts=8 do not"),
    ("deepseek_v3_yarn", {"n_group": 3}, "config.json: n_group=3, n_routed_experts=8 do not"),
    ("deepseek_v3_yarn", {"first_k_dense_replace": 9},
     "first_k_dense_replace=9, num_hidden_layers=3 do not"),
])
def test_keys_that_contradict_each_other_are_named_as_config_json_spells_them(
        name, changes, words, tmp_path):
    """Values each valid alone that together describe no model (top-k above the expert count,
    heads that do not divide): refused naming config.json and its keys, not our field names
    alone, before any tensor is read."""
    d = _copy(name, tmp_path, **changes)
    with pytest.raises(hf.BadConfig) as e:
        hf.read_config(d)
    assert str(e.value).startswith(f"{d / 'config.json'}: ") and words in str(e.value), e.value


def test_tied_embeddings_with_an_lm_head_tensor_name_the_key(tmp_path):
    """tie_word_embeddings=true but the folder holds lm_head.weight: which output layer was
    meant is unknown, so it is refused naming the key and the tensor's file."""
    d = _copy("mixtral", tmp_path, tie_word_embeddings=True)
    with pytest.raises(hf.BadCheckpoint) as e:
        hf.load(d)
    assert str(e.value) == (
        f"{d / 'model-00006-of-00006.safetensors'}: holds tensor 'lm_head.weight' but "
        f"{d / 'config.json'} says tie_word_embeddings=true (the output layer is the "
        "embedding); set it to false to use lm_head.weight, or remove the tensor")


def test_a_bad_checkpoint_is_refused_before_any_tensor_is_read(tmp_path, monkeypatch):
    """An unmapped tensor or the wrong shape of the last tensor is seen in the headers: no
    tensor is read first (a large checkpoint is not streamed through only to be refused)."""
    from safetensors.numpy import load_file, save_file
    from dropless.hf import reader as reader_lib

    def no_read(self, name):
        raise AssertionError(f"read {name} before refusing the checkpoint")
    monkeypatch.setattr(reader_lib.CheckpointReader, "read_raw", no_read)
    d = _copy("qwen3_moe", tmp_path)
    tensors = load_file(str(d / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_proj.bias"] = np.zeros(32, np.float32)
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match="not mapped to any parameter.*q_proj.bias"):
        hf.load(d)
    del tensors["model.layers.0.self_attn.q_proj.bias"]
    tensors["lm_head.weight"] = tensors["lm_head.weight"][:-1]
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(hf.BadCheckpoint, match="tensor 'lm_head.weight' has shape"):
        hf.load(d)
