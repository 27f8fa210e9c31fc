"""Typed, frozen, keyword-only configs, validated on construction.

Every error names the field and the value, e.g. `MoEConfig.top_k=9 must be <= num_experts=8`.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

SCORE_FUNCS = ("softmax", "sigmoid")
GMM_QUANTIZATIONS = ("none", "mxfp8")
DISPATCHERS = ("auto", "local", "allgather", "a2a", "ragged_a2a")
OVERFLOW_POLICIES = ("rounds", "error")


def _fail(cls: str, field: str, value: Any, why: str) -> None:
    raise ValueError(f"{cls}.{field}={value!r} {why}")


def _check_dtype(cls: str, field: str, value: str) -> None:
    try:
        dt = jnp.dtype(value)
    except TypeError:
        _fail(cls, field, value, "is not a dtype name (try 'float32' or 'bfloat16')")
    if not jnp.issubdtype(dt, jnp.floating):
        _fail(cls, field, value, "must be a floating dtype")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """One MoE layer: routing, experts, the grouped-matmul backend and the dispatcher.

    `capacity_factor=None` (the default) is dropless. A number selects the capacity baseline:
    each expert takes at most ceil(T * top_k / num_experts * capacity_factor) rows and the rest
    are dropped (counted in `aux["dropped_tokens"]`), as Switch Transformer and MaxText's dense
    path do.
    """

    num_experts: int
    top_k: int
    d_model: int
    d_ff: int
    num_shared_experts: int = 0
    score_func: str = "softmax"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    n_groups: int = 1
    topk_groups: int = 1
    capacity_factor: float | None = None
    gmm_backend: str = "auto"
    gmm_quantization: str = "none"
    mx_scale_rounding: str = "floor"  # MXFP8 scales: "floor" (OCP spec) or "up" (never saturates)
    mx_grad_elem: str = "e4m3"        # MXFP8 element format of gradients: "e4m3" or "e5m2"
    dtype: str = "float32"           # activations and expert matmul inputs
    weight_dtype: str = "float32"    # stored expert / shared weights (router stays float32)
    load_balance_coef: float = 0.0   # Switch/Mixtral loss; Mixtral uses 0.02
    seq_aux_coef: float = 0.0        # DeepSeek-V3 sequence-wise loss; V3 uses 1e-4
    z_loss_coef: float = 0.0         # ST-MoE router z-loss; 1e-3 there
    bias_update_speed: float = 0.001  # DeepSeek-V3 gamma for the aux-loss-free bias
    # expert parallelism (used only when a mesh with an `expert` axis is given)
    dispatcher: str = "auto"
    ragged_buffer_factor: float = 2.0
    overflow: str = "rounds"
    overflow_check_every_n_steps: int = 1
    devices_per_node: int = 8

    def __post_init__(self) -> None:
        c = "MoEConfig"
        for name in ("num_experts", "top_k", "d_model", "d_ff"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                _fail(c, name, v, "must be a positive int")
        if self.top_k > self.num_experts:
            _fail(c, "top_k", self.top_k, f"must be <= num_experts={self.num_experts}")
        if not isinstance(self.num_shared_experts, int) or self.num_shared_experts < 0:
            _fail(c, "num_shared_experts", self.num_shared_experts, "must be an int >= 0")
        if self.score_func not in SCORE_FUNCS:
            _fail(c, "score_func", self.score_func, f"must be one of {SCORE_FUNCS}")
        if not self.routed_scaling_factor > 0:
            _fail(c, "routed_scaling_factor", self.routed_scaling_factor, "must be > 0")
        if not isinstance(self.n_groups, int) or self.n_groups <= 0:
            _fail(c, "n_groups", self.n_groups, "must be a positive int")
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
        if self.gmm_quantization not in GMM_QUANTIZATIONS:
            _fail(c, "gmm_quantization", self.gmm_quantization,
                  f"must be one of {GMM_QUANTIZATIONS}")
        if self.mx_scale_rounding not in ("floor", "up"):
            _fail(c, "mx_scale_rounding", self.mx_scale_rounding, "must be 'floor' or 'up'")
        if self.mx_grad_elem not in ("e4m3", "e5m2"):
            _fail(c, "mx_grad_elem", self.mx_grad_elem, "must be 'e4m3' or 'e5m2'")
        _check_dtype(c, "dtype", self.dtype)
        _check_dtype(c, "weight_dtype", self.weight_dtype)
        for name in ("load_balance_coef", "seq_aux_coef", "z_loss_coef", "bias_update_speed"):
            if getattr(self, name) < 0:
                _fail(c, name, getattr(self, name), "must be >= 0")
        if self.dispatcher not in DISPATCHERS:
            _fail(c, "dispatcher", self.dispatcher, f"must be one of {DISPATCHERS}")
        if not self.ragged_buffer_factor >= 1.0:
            _fail(c, "ragged_buffer_factor", self.ragged_buffer_factor, "must be >= 1.0")
        if self.overflow not in OVERFLOW_POLICIES:
            _fail(c, "overflow", self.overflow, f"must be one of {OVERFLOW_POLICIES}")
        if self.overflow_check_every_n_steps <= 0:
            _fail(c, "overflow_check_every_n_steps", self.overflow_check_every_n_steps,
                  "must be >= 1")
        if self.devices_per_node <= 0:
            _fail(c, "devices_per_node", self.devices_per_node, "must be >= 1")
        # the backend name is checked against the registry lazily (backends register on import)
        from dropless.ops.gmm.registry import check_backend_name
        check_backend_name(self.gmm_backend, where="MoEConfig.gmm_backend")

    def replace(self, **changes: Any) -> "MoEConfig":
        return dataclasses.replace(self, **changes)

    @property
    def experts_per_group(self) -> int:
        return self.num_experts // self.n_groups


MESH_AXES = ("data", "fsdp", "expert")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """The device mesh: sizes of the `data`, `fsdp` and `expert` axes (product = device count).

    Tokens are sharded over all three axes; expert weights over `expert` (their first dim) and,
    with fsdp > 1, over `fsdp` (their model dim). `devices_per_node` only informs byte accounting
    and the order devices are laid out in (the expert axis varies fastest, so an expert group
    stays inside a node when expert <= devices_per_node).
    """

    data: int = 1
    fsdp: int = 1
    expert: int = 1

    def __post_init__(self) -> None:
        for name in MESH_AXES:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                _fail("MeshConfig", name, v, "must be a positive int")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, a) for a in MESH_AXES)

    @property
    def num_devices(self) -> int:
        return self.data * self.fsdp * self.expert

    def replace(self, **changes: Any) -> "MeshConfig":
        return dataclasses.replace(self, **changes)
