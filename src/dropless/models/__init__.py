"""Models built from the MoE layer: the DeepSeek-V3 / Mixtral / Qwen3-MoE decoder."""
from dropless.models.count import param_counts
from dropless.models.deepseek import forward, init_params

__all__ = ["forward", "init_params", "param_counts"]
