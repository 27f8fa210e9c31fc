"""`MoEConfig`: one MoE layer's routing, experts, grouped-matmul backend and dispatcher."""
from __future__ import annotations

import dataclasses
from typing import Any

from dropless.config.fields import (_check_dtype, _check_types, _fail, _one_of,
                                    _positive_ints, _sizes, described)
from dropless.config.names import (DISPATCHERS, GMM_QUANTIZATIONS, MAX_EXPERTS, OVERFLOW_POLICIES,
                                   SCORE_FUNCS)
from dropless.ops.gmm.aliases import canonical_backend
from dropless.ops.gmm.names import check_backend_name


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """One MoE layer: routing, experts, the grouped-matmul backend and the dispatcher.

    `capacity_factor=None` (the default) is dropless. A number selects the capacity baseline:
    each expert takes at most ceil(T * top_k / num_experts * capacity_factor) rows and the rest
    are dropped (counted in `aux["dropped_tokens"]`), as Switch Transformer and MaxText's dense
    path do.
    """

    num_experts: int = described(doc="routed experts in the layer")
    top_k: int = described(doc="experts each token is routed to")
    d_model: int = described(doc="the layer's input and output width; must equal model.d_model, "
                                 "which sets it too")
    d_ff: int = described(doc="hidden width of each expert's SwiGLU")
    num_shared_experts: int = described(
        0, doc="experts every token passes through beside its top_k, run as one SwiGLU of "
               "width num_shared_experts x d_ff")
    score_func: str = described(
        "softmax", doc="router scores: softmax over the experts (Mixtral, Qwen3-MoE) or an "
                       "independent sigmoid per expert (DeepSeek-V3)")
    norm_topk_prob: bool = described(
        True, doc="renormalise the chosen experts' weights to sum to one")
    routed_scaling_factor: float = described(
        1.0, doc="multiplies the routed experts' combine weights (DeepSeek-V3: 2.5)")
    n_groups: int = described(
        1, doc="expert groups for group-limited routing (DeepSeek-V3: 8); 1 = no groups")
    topk_groups: int = described(
        1, doc="groups a token may choose experts from: those whose two best scores sum highest")
    capacity_factor: float | None = described(
        None, doc="null = dropless; a number = the capacity baseline: each expert keeps at most "
                  "ceil(tokens x top_k / num_experts x capacity_factor) rows, the rest dropped")
    gmm_backend: str = described(
        "auto", doc="grouped-matmul backend: auto (chosen per platform when lowered) or a name "
                    "in the ops.gmm registry (an unknown name's error lists them)")
    align_expert_rows: int = described(
        0, doc="each expert's rows start at a multiple of this many (zero rows between), so no "
               "grouped-matmul tile straddles two experts; 0 = off (docs/moe_layer.md)")
    gmm_quantization: str = described(
        "none", doc="expert matmuls in low precision: none, mxfp8 (docs/mxfp8.md) or nvfp4 "
                    "(docs/nvfp4.md)")
    mx_scale_rounding: str = described(
        "floor", doc="MXFP8 block scales rounded floor (the OCP spec) or up (never saturates)")
    mx_grad_elem: str = described("e4m3", doc="MXFP8 element format of gradients: e4m3 or e5m2")
    # NVFP4 recipe pieces (gmm_quantization="nvfp4"; docs/nvfp4.md)
    nvfp4_weight_blocks: str = described(
        "2d", doc="NVFP4 weight scale blocks: 2d (16x16) or 1d (1x16)")
    nvfp4_tensor_scale: bool = described(
        True, doc="NVFP4: an FP32 per-tensor scale above the block scales")
    nvfp4_rht: bool = described(
        True, doc="NVFP4: a random Hadamard transform on the weight-gradient matmul's inputs")
    nvfp4_stochastic_rounding: bool = described(
        True, doc="NVFP4: gradients quantized with stochastic rounding")
    nvfp4_seed: int = described(
        0, doc="NVFP4: seed of the Hadamard signs and of the rounding key (< 2^32)")
    # rows travel as 1x32 E4M3 blocks with E8M0 scales; the combine stays in `dtype`
    dispatch_quantization: str = described(
        "none", doc="none, or mxfp8: routed rows quantized once before the dispatch, sent so "
                    "and fed to the MXFP8 grouped matmul (needs gmm_quantization=mxfp8; "
                    "docs/fp8_dispatch.md)")
    dtype: str = described("float32", doc="activations and the expert matmuls' inputs")
    weight_dtype: str = described(
        "float32", doc="stored expert and shared-expert weights (the router stays float32)")
    prefuse_moe_weights: bool = described(
        False, doc="experts hold one [E, D, 2F] gate+up weight instead of two")
    load_balance_coef: float = described(
        0.0, doc="weight of the Switch/Mixtral load-balance loss (Mixtral: 0.02)")
    seq_aux_coef: float = described(
        0.0, doc="weight of DeepSeek-V3's sequence-wise balance loss (V3: 1e-4)")
    z_loss_coef: float = described(0.0, doc="weight of the ST-MoE router z-loss (1e-3 there)")
    # None = by score function: 0.001 for sigmoid (DeepSeek-V3), 0.0 for softmax: Mixtral and
    # Qwen3-MoE have no routing bias, and updating one would make a fine-tuned model's routing
    # drift from the reference it was loaded from.
    bias_update_speed: float | None = described(
        None, doc="DeepSeek-V3's gamma, the update speed of the aux-loss-free routing bias; "
                  "null = 0.001 for sigmoid, 0.0 for softmax")
    # expert parallelism (used only when a mesh with an `expert` axis is given)
    dispatcher: str = described(
        "auto", doc="how routed rows reach their experts' devices: auto (by mesh and "
                    "platform), local (no dispatcher), allgather, a2a, ragged_a2a or node_a2a")
    ragged_buffer_factor: float = described(
        2.0, doc="expert-parallel send/receive buffers hold this x the rows a balanced routing "
                 "sends each peer (>= 1)")
    overflow: str = described(
        "rounds", doc="rows past a full buffer: rounds (sent in extra rounds, none dropped) or "
                      "error (dropped; the run stops at the last good step)")
    overflow_check_every_n_steps: int = described(
        1, doc="with overflow=error: steps between the loop's reads of the overflow flag (each "
               "read is a host sync)")
    # each chunk is its own dispatch -> experts -> combine, so chunk i+1's dispatch and chunk
    # i-1's combine can run while chunk i computes (moe/dispatch/overlap.py). Megatron-Core's
    # nearest is overlap_moe_expert_parallel_comm (two micro-batches); Tutel / DeepSpeed call
    # this number a2a_ffn_overlap_degree.
    ep_comm_overlap_chunks: int = described(
        1, doc="each device's tokens in this many chunks so the dispatch overlaps the expert "
               "matmuls (docs/overlap.md); 1 = off")

    def __post_init__(self) -> None:
        c = "MoEConfig"
        _check_types(self)
        _positive_ints(c, self, ("num_experts", "top_k", "d_model", "d_ff", "n_groups",
                                 "overflow_check_every_n_steps", "ep_comm_overlap_chunks"))
        _positive_ints(c, self, ("num_shared_experts", "align_expert_rows"), allow_zero=True)
        _sizes(c, self, ("top_k", "d_model", "d_ff", "num_shared_experts", "n_groups",
                         "align_expert_rows", "ep_comm_overlap_chunks"))
        if self.num_experts > MAX_EXPERTS:
            _fail(c, "num_experts", self.num_experts, f"is more than {MAX_EXPERTS:,} experts (the "
                  "largest published mixture has about a million); a typo?")
        if self.top_k > self.num_experts:
            _fail(c, "top_k", self.top_k, f"must be <= num_experts={self.num_experts}")
        _one_of(c, self, "score_func", SCORE_FUNCS)
        if not self.routed_scaling_factor > 0:
            _fail(c, "routed_scaling_factor", self.routed_scaling_factor, "must be > 0")
        if self.num_experts % self.n_groups:
            _fail(c, "n_groups", self.n_groups,
                  f"must divide num_experts={self.num_experts}")
        if not isinstance(self.topk_groups, int) or not 0 < self.topk_groups <= self.n_groups:
            _fail(c, "topk_groups", self.topk_groups, f"must be in [1, n_groups={self.n_groups}]")
        if self.n_groups > 1:
            reachable = self.topk_groups * (self.num_experts // self.n_groups)
            if reachable < self.top_k:
                _fail(c, "topk_groups", self.topk_groups,
                      f"leaves {reachable} selectable experts, fewer than top_k={self.top_k}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            _fail(c, "capacity_factor", self.capacity_factor, "must be > 0, or None for dropless")
        _one_of(c, self, "gmm_quantization", GMM_QUANTIZATIONS)
        _one_of(c, self, "mx_scale_rounding", ("floor", "up"))
        _one_of(c, self, "mx_grad_elem", ("e4m3", "e5m2"))
        _one_of(c, self, "nvfp4_weight_blocks", ("2d", "1d"))
        _positive_ints(c, self, ("nvfp4_seed",), allow_zero=True)
        if self.nvfp4_seed >= 2 ** 32:
            _fail(c, "nvfp4_seed", self.nvfp4_seed, "must be < 2**32")
        _one_of(c, self, "dispatch_quantization", ("none", "mxfp8"))
        if self.dispatch_quantization == "mxfp8" and self.gmm_quantization != "mxfp8":
            _fail(c, "dispatch_quantization", self.dispatch_quantization,
                  f"needs gmm_quantization='mxfp8' (got {self.gmm_quantization!r}): the MXFP8 "
                  f"grouped matmul is what consumes the dispatched rows")
        if self.align_expert_rows > 1 and self.dispatch_quantization != "none":
            _fail(c, "align_expert_rows", self.align_expert_rows,
                  "needs dispatch_quantization='none' (quantized rows are not re-laid out)")
        if not isinstance(self.prefuse_moe_weights, bool):
            _fail(c, "prefuse_moe_weights", self.prefuse_moe_weights, "must be a bool")
        _check_dtype(c, "dtype", self.dtype)
        _check_dtype(c, "weight_dtype", self.weight_dtype)
        if self.bias_update_speed is None:
            object.__setattr__(self, "bias_update_speed",
                               0.001 if self.score_func == "sigmoid" else 0.0)
        for name in ("load_balance_coef", "seq_aux_coef", "z_loss_coef", "bias_update_speed"):
            if getattr(self, name) < 0:
                _fail(c, name, getattr(self, name), "must be >= 0")
        if not self.ragged_buffer_factor >= 1.0:
            _fail(c, "ragged_buffer_factor", self.ragged_buffer_factor, "must be >= 1.0")
        _one_of(c, self, "overflow", OVERFLOW_POLICIES)
        # ops' list of backend names (below config): the registry's when it is loaded, else the
        # built-in names, checked without loading a backend (and JAX) for `dropless config show`
        check_backend_name(self.gmm_backend, where="MoEConfig.gmm_backend")
        object.__setattr__(self, "gmm_backend", canonical_backend(self.gmm_backend))
        _one_of(c, self, "dispatcher", DISPATCHERS)

    def replace(self, **changes: Any) -> "MoEConfig":
        return dataclasses.replace(self, **changes)

    @property
    def experts_per_group(self) -> int:
        return self.num_experts // self.n_groups
