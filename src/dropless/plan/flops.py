"""The planner's executed-FLOP terms beyond the model's: grouped-GEMM tile padding. Model FLOPs
per token, by kind (`gemm` dense matmuls, `gmm` routed-expert grouped matmuls, `attention` the
score/value products), are the arithmetic model's (`dropless.models.arithmetic`); the
planner adds rematerialisation (plan/model.py) and the padding below.
"""
from __future__ import annotations

from dropless.config import ModelConfig


def padding_fraction(s: ModelConfig, tokens_per_device: int, ep: int, tile: int) -> float:
    """Expected grouped-GEMM rows added by padding each local expert's group to a tile, as a
    fraction of real rows: half a tile per local expert that receives rows."""
    if s.moe is None:
        return 0.0
    local_experts = s.moe.num_experts // ep
    rows = tokens_per_device * s.moe.top_k   # balanced: each device's experts get T*K rows
    return local_experts * (tile / 2) / rows
