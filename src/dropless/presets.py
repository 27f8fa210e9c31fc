"""Named model configs as Python functions. The big ones are for planning (parameter and FLOP
counts, sharded init on a mesh), not for CPU training.

Sources for the published shapes: DeepSeek-V3 technical report (arXiv:2412.19437) and its
config.json; Mixtral-8x7B-v0.1 config.json; Qwen3-30B-A3B config.json. `get_preset("hf:DIR")`
reads the model config of a local Hugging Face folder (through `dropless.model_dir`, which
imports `dropless.hf` only then).
"""
from __future__ import annotations

from typing import Callable

from dropless import model_dir
from dropless.config import ModelConfig, MoEConfig


def tiny() -> ModelConfig:
    """The CPU default: DeepSeek-V3 shape at ~1M parameters, byte vocabulary; trains in minutes."""
    d = 128
    return ModelConfig(
        vocab_size=256, d_model=d, num_layers=4, num_heads=4, d_ff=384, attention="mla",
        first_k_dense=1, q_lora_rank=0, kv_lora_rank=64, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32,
        moe=MoEConfig(num_experts=8, top_k=2, d_model=d, d_ff=128, num_shared_experts=1,
                      score_func="sigmoid", norm_topk_prob=True, seq_aux_coef=1e-4))


def small() -> ModelConfig:
    """tiny's shape a size up for CPU comparisons (docs/training.md "Initialisation"): d_model
    160, 5 layers (1 dense), 16 routed experts top-2 + 1 shared; 5.0M parameters (1.6M active
    per token), 1.7x tiny's FLOPs per token."""
    d = 160
    return ModelConfig(
        vocab_size=256, d_model=d, num_layers=5, num_heads=5, d_ff=480, attention="mla",
        first_k_dense=1, q_lora_rank=0, kv_lora_rank=80, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32,
        moe=MoEConfig(num_experts=16, top_k=2, d_model=d, d_ff=128, num_shared_experts=1,
                      score_func="sigmoid", norm_topk_prob=True, seq_aux_coef=1e-4))


def deepseek3_test() -> ModelConfig:
    """Small, every DeepSeek-V3 feature on: q low-rank, groups, shared expert, dense-first, MTP."""
    d = 64
    return ModelConfig(
        vocab_size=256, d_model=d, num_layers=3, num_heads=4, d_ff=128, attention="mla",
        first_k_dense=1, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, mtp_depth=1,
        moe=MoEConfig(num_experts=8, top_k=2, d_model=d, d_ff=32, num_shared_experts=1,
                      score_func="sigmoid", routed_scaling_factor=2.5, n_groups=4,
                      topk_groups=2, seq_aux_coef=1e-4))


def deepseek3_671b() -> ModelConfig:
    """DeepSeek-V3: 61 layers (3 dense), 256 routed + 1 shared expert, top-8 in 4 of 8 groups,
    YaRN x40 over a 4096 original context (its config.json)."""
    d = 7168
    return ModelConfig(
        vocab_size=129280, d_model=d, num_layers=61, num_heads=128, d_ff=18432,
        attention="mla", first_k_dense=3, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, mtp_depth=1,
        rope_theta=10000.0, rope_type="yarn", rope_factor=40.0, rope_original_max_position=4096,
        rope_beta_fast=32.0, rope_beta_slow=1.0, rope_mscale=1.0, rope_mscale_all_dim=1.0,
        dtype="bfloat16", weight_dtype="bfloat16",
        moe=MoEConfig(num_experts=256, top_k=8, d_model=d, d_ff=2048, num_shared_experts=1,
                      score_func="sigmoid", routed_scaling_factor=2.5, n_groups=8,
                      topk_groups=4, seq_aux_coef=1e-4, dtype="bfloat16",
                      weight_dtype="bfloat16"))


def deepseek3_1gpu() -> ModelConfig:
    """DeepSeek-V3's shape sized for one 80 GB GPU: 16 layers (1 dense), MLA (q rank 384, kv
    rank 256), 64 routed experts top-8 in 4 of 8 groups + 2 shared, sigmoid routing with the
    aux-loss-free bias, vocabulary 32,768; bfloat16 compute on float32 weights (and so float32
    Adam moments). 1.68B parameters, 0.36B active per token. MTP is off (model.mtp_depth=1 adds
    one module). Its layers are unrolled (`scan_layers=False`): on one GPU nothing is copied
    into and out of a scan's stacked activations, and the step holds less memory, for a longer
    compile (docs/training.md "One GPU"). It is trained as `RUN_SETTINGS["deepseek3-1gpu"]`
    says (sequence 4096), which fits an H100 by the compiled step's memory analysis."""
    d = 1024
    return ModelConfig(
        vocab_size=32768, d_model=d, num_layers=16, num_heads=16, d_ff=4096, attention="mla",
        first_k_dense=1, q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=64,
        qk_rope_head_dim=32, v_head_dim=64, mtp_depth=0, scan_layers=False,
        dtype="bfloat16", weight_dtype="float32",
        moe=MoEConfig(num_experts=64, top_k=8, d_model=d, d_ff=512, num_shared_experts=2,
                      score_func="sigmoid", routed_scaling_factor=2.5, n_groups=8,
                      topk_groups=4, seq_aux_coef=1e-4, dtype="bfloat16",
                      weight_dtype="float32"))


def mixtral_8x7b() -> ModelConfig:
    """Mixtral 8x7B: 32 layers, GQA (32 q / 8 kv heads), 8 experts top-2, softmax routing."""
    d = 4096
    return ModelConfig(
        vocab_size=32000, d_model=d, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
        d_ff=14336, attention="mha", rope_theta=1e6, norm_eps=1e-5,
        dtype="bfloat16", weight_dtype="bfloat16",
        moe=MoEConfig(num_experts=8, top_k=2, d_model=d, d_ff=14336, score_func="softmax",
                      norm_topk_prob=True, load_balance_coef=0.02, bias_update_speed=0.0,
                      dtype="bfloat16",
                      weight_dtype="bfloat16"))


def qwen3_30b_a3b() -> ModelConfig:
    """Qwen3-30B-A3B: 48 layers, GQA (32 q / 4 kv heads, head 128, qk-norm), 128 experts top-8."""
    d = 2048
    return ModelConfig(
        vocab_size=151936, d_model=d, num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
        qk_norm=True, d_ff=6144, attention="mha", rope_theta=1e6,
        dtype="bfloat16", weight_dtype="bfloat16",
        moe=MoEConfig(num_experts=128, top_k=8, d_model=d, d_ff=768, score_func="softmax",
                      norm_topk_prob=True, load_balance_coef=0.001, bias_update_speed=0.0,
                      dtype="bfloat16",
                      weight_dtype="bfloat16"))


PRESETS: dict[str, Callable[[], ModelConfig]] = {
    "tiny": tiny,
    "small": small,
    "deepseek3-test": deepseek3_test,
    "deepseek3-1gpu": deepseek3_1gpu,
    "deepseek3-671b": deepseek3_671b,
    "mixtral-8x7b": mixtral_8x7b,
    "qwen3-30b-a3b": qwen3_30b_a3b,
}

# Published (total, active) parameter counts as their authors state them (rounded), the one
# copy the tests, README and docs/training.md quote: DeepSeek-V3 report (arXiv:2412.19437,
# "671B total parameters with 37B activated"), Mistral's Mixtral-8x7B announcement ("46.7B
# total parameters but only uses 12.9B"), the Qwen3-30B-A3B model card ("30.5B in total and
# 3.3B activated"). Ours (models/arithmetic) are 671.03B / 37.55B, 46.70B / 12.88B, 30.53B / 3.35B.
PUBLISHED_COUNTS = {
    "deepseek3-671b": (671e9, 37e9),
    "mixtral-8x7b": (46.7e9, 12.9e9),
    "qwen3-30b-a3b": (30.5e9, 3.3e9),
}

# How a preset made for one device is trained: the sequence, batch and remat policy it was sized
# with, the defaults `--preset NAME` sets (config_file.build_config; a key the user gives wins).
# deepseek3-1gpu's step compiled for an H100 fits these with room to spare (its compiled
# figures: docs/training.md "One GPU", checked by tests/train/test_preflight_gpu_compile.py).
RUN_SETTINGS = {
    "deepseek3-1gpu": {"seq_len": 4096, "per_device_batch_size": 4, "remat": "minimal"},
}


def get_preset(name: str) -> ModelConfig:
    """The named preset's ModelConfig, or "hf:DIR" for a Hugging Face folder's config; raises
    ValueError listing the known names."""
    if model_dir.is_hf(name):
        return model_dir.hf_model_config(name)
    if name not in PRESETS:
        import difflib
        close = difflib.get_close_matches(name, list(PRESETS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"preset={name!r} is not known{hint}; known: {sorted(PRESETS)}")
    return PRESETS[name]()
