"""Models built from the MoE layer: the DeepSeek-V3 / Mixtral / Qwen3-MoE decoder, and the
arithmetic model of its parameters and FLOPs (`arithmetic`)."""
from dropless.models.arithmetic import flops_per_token, param_counts
from dropless.models.decoder import forward, init_params

__all__ = ["flops_per_token", "forward", "init_params", "param_counts"]
