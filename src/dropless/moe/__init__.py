"""The MoE layer and its parts: routing, permutation, the functional layer."""
from dropless.moe.experts import (SAVED_NAMES, convert_expert_weights, expert_layout,
                                  fuse_expert_weights, unfuse_expert_weights)
from dropless.moe.layer import apply, capacity, init_params
from dropless.moe.router import update_bias

__all__ = ["apply", "init_params", "capacity", "update_bias", "fuse_expert_weights",
           "unfuse_expert_weights", "convert_expert_weights", "expert_layout", "SAVED_NAMES"]
