"""Training metrics arithmetic: throughput and MFU, expert-load summaries. FLOPs per token
(model and executed) come from the arithmetic model, `dropless.models.arithmetic`; the peak
MFU divides by from `dropless.machine` (`peak_flops_per_device`: the GPU table, the cached CPU
peak).
"""
from __future__ import annotations

import numpy as np


def expert_load_summary(tokens_per_expert_LE) -> dict[str, float]:
    """max/mean load per MoE layer: the worst layer and the mean over layers (1.0 = balanced)."""
    t = np.asarray(tokens_per_expert_LE, np.float64)
    if t.size == 0:
        return {}
    ratio_L = t.max(axis=-1) / np.maximum(t.mean(axis=-1), 1e-9)
    return {"expert_load_max_over_mean": float(ratio_L.max()),
            "expert_load_max_over_mean_avg": float(ratio_L.mean())}


def throughput(*, step_time_s: float, tokens: int, flops_per_token: float, num_devices: int,
               peak_flops_per_device: float | None, real_tokens: int | None = None
               ) -> dict[str, float | None]:
    """A step's rates. `tokens`: the positions it computed (global batch x seq_len, padding
    included); `real_tokens`: those that hold a document's token (not padding; None: all).
    "tokens_per_s" is the real tokens a second (what the data gives; padding is no throughput),
    "padded_tokens_per_s" every computed position a second (MaxText's tokens/s counts these);
    "tflops_per_device" and "mfu" (None when the peak is unknown) are the FLOPs computed, so
    they count the padding, which the step computes like any token."""
    real = tokens if real_tokens is None else real_tokens
    tflops = tokens * flops_per_token / step_time_s / num_devices / 1e12
    mfu = None if not peak_flops_per_device else tflops * 1e12 / peak_flops_per_device
    return {"tokens_per_s": real / step_time_s, "padded_tokens_per_s": tokens / step_time_s,
            "tflops_per_device": tflops, "mfu": mfu}
