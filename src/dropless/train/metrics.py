"""Training metrics arithmetic: model FLOPs per token (active parameters + attention), executed
FLOPs (with capacity padding), throughput and MFU, expert-load summaries. The peak MFU divides
by comes from `dropless.machine` (`peak_flops_per_device`: the GPU table, the cached CPU peak).

Conventions (MaxText-style): a matmul with P weights costs 2 P FLOPs per token forward and
4 P backward, so 6 P per trained token. Only weights used in matmuls count: the embedding lookup
and norm weights do not, the output head and the router do; routed experts count top_k of E.
Causal attention: per layer and token, QK^T and AV each cost 2 * H * d * (S + 1) / 2 forward
(d = qk and v head dims), times 3 for training.
"""
from __future__ import annotations

import math

import numpy as np

from dropless.config import ModelConfig
from dropless.models.count import param_counts


def matmul_params(cfg: ModelConfig) -> dict[str, float]:
    """Active weights used in matmuls per token: {"main", "mtp"} (MTP includes the shared head
    once per depth). Excluded: embedding lookup, norm weights, router biases."""
    c = param_counts(cfg)
    attn_norms = sum(math.prod(s) for s in _attention_norm_shapes(cfg)) * cfg.num_layers
    main = c["active"] - c["embedding"] - c["norms"] - c["router_bias"] - attn_norms
    head = c["embedding"] if cfg.tie_embeddings else c["lm_head"]
    if cfg.tie_embeddings:
        main += head
    mtp = (c["mtp_matmul_active"] + head * cfg.mtp_depth) if cfg.mtp_depth else 0
    return {"main": float(main), "mtp": float(mtp)}


def _attention_norm_shapes(cfg: ModelConfig) -> list[tuple[int, ...]]:
    if cfg.attention == "mla":
        return [(cfg.kv_lora_rank,)] + ([(cfg.q_lora_rank,)] if cfg.q_lora_rank else [])
    return [(cfg.mha_head_dim,)] * 2 if cfg.qk_norm else []


def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token of QK^T and AV over all attention layers (causal)."""
    layers = cfg.num_layers + cfg.mtp_depth
    fwd = 2 * cfg.num_heads * (cfg.qk_head_dim + cfg.v_dim) * (seq_len + 1) / 2
    return 3.0 * layers * fwd


def flops_per_token(cfg: ModelConfig, seq_len: int, *, capacity_factor: float | None = None
                    ) -> dict[str, float]:
    """{"model": useful training FLOPs per token, "executed": with capacity padding}.

    With a capacity factor every expert computes E * C rows instead of T * K, so the routed
    expert FLOPs scale by capacity_factor (dropless: executed == model).
    """
    mp = matmul_params(cfg)
    model = 6.0 * (mp["main"] + mp["mtp"]) + attention_flops_per_token(cfg, seq_len)
    executed = model
    if cfg.moe is not None and capacity_factor is not None:
        c = param_counts(cfg)
        routed_active = c["routed_experts"] * cfg.moe.top_k / cfg.moe.num_experts
        executed = model + 6.0 * routed_active * (capacity_factor - 1.0)
    return {"model": model, "executed": executed}


def expert_load_summary(tokens_per_expert_LE) -> dict[str, float]:
    """max/mean load per MoE layer: the worst layer and the mean over layers (1.0 = balanced)."""
    t = np.asarray(tokens_per_expert_LE, np.float64)
    if t.size == 0:
        return {}
    ratio_L = t.max(axis=-1) / np.maximum(t.mean(axis=-1), 1e-9)
    return {"expert_load_max_over_mean": float(ratio_L.max()),
            "expert_load_max_over_mean_avg": float(ratio_L.mean())}


def throughput(*, step_time_s: float, tokens: int, flops_per_token: float, num_devices: int,
               peak_flops_per_device: float | None) -> dict[str, float | None]:
    """tokens/s, model TFLOPS per device and MFU (None when the peak is unknown)."""
    tflops = tokens * flops_per_token / step_time_s / num_devices / 1e12
    mfu = None if not peak_flops_per_device else tflops * 1e12 / peak_flops_per_device
    return {"tokens_per_s": tokens / step_time_s, "tflops_per_device": tflops, "mfu": mfu}
