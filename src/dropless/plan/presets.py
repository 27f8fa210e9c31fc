"""Model shapes by preset name.

The big presets are written out here from the models' published configurations so that
planning needs no JAX; when the trainer's presets (`dropless.presets`) are importable, a name
found there is converted with `shape_of` instead, so the two never drift apart silently
(tests/test_plan_shape.py compares them).
"""
from __future__ import annotations

from typing import Any, Callable

from dropless.plan.shape import ModelShape


def deepseek3_671b() -> ModelShape:
    """DeepSeek-V3 (huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json)."""
    return ModelShape(name="deepseek3-671b", vocab_size=129280, d_model=7168, num_layers=61,
                      num_heads=128, d_ff=18432, attention="mla", first_k_dense=3,
                      q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                      qk_rope_head_dim=64, v_head_dim=128, mtp_depth=1, num_experts=256,
                      top_k=8, moe_d_ff=2048, num_shared_experts=1, n_groups=8, topk_groups=4)


def mixtral_8x7b() -> ModelShape:
    """Mixtral 8x7B (huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json)."""
    return ModelShape(name="mixtral-8x7b", vocab_size=32000, d_model=4096, num_layers=32,
                      num_heads=32, num_kv_heads=8, head_dim=128, d_ff=14336, attention="mha",
                      num_experts=8, top_k=2, moe_d_ff=14336)


def qwen3_30b_a3b() -> ModelShape:
    """Qwen3-30B-A3B (huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json)."""
    return ModelShape(name="qwen3-30b-a3b", vocab_size=151936, d_model=2048, num_layers=48,
                      num_heads=32, num_kv_heads=4, head_dim=128, qk_norm=True, d_ff=6144,
                      attention="mha", num_experts=128, top_k=8, moe_d_ff=768)


def deepseek3_test() -> ModelShape:
    """A small DeepSeek-V3-shaped model with every feature on (used when the trainer's preset
    of the same name is not importable)."""
    return ModelShape(name="deepseek3-test", vocab_size=256, d_model=64, num_layers=3,
                      num_heads=4, d_ff=128, attention="mla", first_k_dense=1, q_lora_rank=32,
                      kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                      mtp_depth=1, num_experts=16, top_k=4, moe_d_ff=32, num_shared_experts=1,
                      n_groups=4, topk_groups=2)


def tiny() -> ModelShape:
    """A few-million-parameter MoE (used when the trainer's `tiny` is not importable)."""
    return ModelShape(name="tiny", vocab_size=256, d_model=128, num_layers=4, num_heads=4,
                      d_ff=512, attention="mla", first_k_dense=1, kv_lora_rank=64,
                      qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, num_experts=8,
                      top_k=2, moe_d_ff=256, num_shared_experts=1)


PRESETS: dict[str, Callable[[], ModelShape]] = {
    "tiny": tiny,
    "deepseek3-test": deepseek3_test,
    "deepseek3-671b": deepseek3_671b,
    "mixtral-8x7b": mixtral_8x7b,
    "qwen3-30b-a3b": qwen3_30b_a3b,
}

# Published parameter counts (total, active per token), main model without MTP modules.
PUBLISHED_PARAMS = {
    "deepseek3-671b": (671e9, 37e9),   # DeepSeek-V3 technical report, arXiv:2412.19437
    "mixtral-8x7b": (46.7e9, 12.9e9),  # Mixtral of Experts, arXiv:2401.04088
    "qwen3-30b-a3b": (30.5e9, 3.3e9),  # Qwen3 model card / technical report, arXiv:2505.09388
}


def shape_of(model: Any, name: str = "custom") -> ModelShape:
    """A ModelShape from anything with the trainer's `ModelConfig` fields (`moe` may be None)."""
    moe = getattr(model, "moe", None)
    fields = {f: getattr(model, f) for f in (
        "vocab_size", "d_model", "num_layers", "num_heads", "d_ff", "attention",
        "first_k_dense", "num_kv_heads", "head_dim", "qk_norm", "q_lora_rank", "kv_lora_rank",
        "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "tie_embeddings", "mtp_depth")}
    if moe is not None:
        fields.update(num_experts=moe.num_experts, top_k=moe.top_k, moe_d_ff=moe.d_ff,
                      num_shared_experts=moe.num_shared_experts, n_groups=moe.n_groups,
                      topk_groups=moe.topk_groups)
    return ModelShape(name=name, **fields)


def _trainer_preset(name: str) -> ModelShape | None:
    try:
        from dropless import presets as trainer_presets  # the trainer's table, when merged
    except ImportError:
        return None
    get = getattr(trainer_presets, "get_preset", None) or getattr(trainer_presets, "get", None)
    table = getattr(trainer_presets, "PRESETS", {})
    if get is None and name not in table:
        return None
    try:
        obj = get(name) if get is not None else table[name]()
    except (KeyError, ValueError):
        return None
    model = getattr(obj, "model", obj)   # a TrainConfig or a ModelConfig
    return shape_of(model, name)


def get_shape(name: str, *, prefer_trainer: bool = True) -> ModelShape:
    """The shape of preset `name`; raises ValueError listing the known names."""
    if prefer_trainer:
        found = _trainer_preset(name)
        if found is not None:
            return found
    if name not in PRESETS:
        raise ValueError(f"preset={name!r} is unknown; known presets: {sorted(PRESETS)}")
    return PRESETS[name]()
