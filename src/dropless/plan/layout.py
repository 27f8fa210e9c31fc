"""What is being planned: the cluster layout (data x FSDP x EP) and the training settings.

Mesh axes are laid out innermost first: `expert` (stride 1), then `fsdp`, then `data`, so the
EP group of a device is its nearest neighbours and stays inside one NVLink domain whenever
`ep <= devices_per_node`. Non-expert weights are FSDP-sharded over fsdp x expert (MaxText's
rules put the `expert` mesh axis into the FSDP axes of non-MoE weights); expert weights are
split over `expert` by expert and over `fsdp` within each expert.
"""
from __future__ import annotations

import dataclasses
import math

from dropless.machine import HardwareProfile
from dropless.config import GMM_QUANTIZATIONS, REMAT_POLICIES, ModelConfig  # the trainer's

DISPATCHERS = ("a2a", "ragged_a2a", "allgather")
OVERLAPS = ("none", "fsdp", "full")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
OFFLOADABLE = ("query", "key", "value")
ATTENTION_IMPLS = ("flash", "naive")


def _fail(field: str, value, why: str) -> None:
    raise ValueError(f"PlanConfig.{field}={value!r} {why}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanConfig:
    """One training configuration on one cluster. `data=0` means gpus // (fsdp * ep).

    remat: none (save everything) | minimal (save matmul outputs) | full (save layer inputs)
      | offload (save layer inputs, keep `offload` tensors in host memory, recompute the rest).
    dispatcher: ragged_a2a (only real rows move; default, as `auto` on GPUs) | a2a (static
      per-peer chunks of buffer factor x the balanced load) | allgather.
    overlap: none (every part serial) | fsdp (FSDP/data collectives hidden behind compute)
      | full (EP dispatch/combine also overlapped, e.g. two micro-batches).
    attention_impl: flash (fused, causal half computed) | naive (the S x S scores and
      probabilities materialised and the full square computed, as plain XLA on CPU does).
    """

    gpus: int
    fsdp: int = 1
    ep: int = 1
    data: int = 0
    per_device_batch: int = 1
    seq_len: int = 4096
    remat: str = "full"
    offload: tuple[str, ...] | None = None   # None: ("query", "value") when remat=offload
    gmm_quantization: str = "none"
    dispatcher: str = "ragged_a2a"   # what `auto` picks on GPUs
    dedup: bool = True
    ragged_buffer_factor: float = 2.0
    overlap: str = "fsdp"
    weight_dtype: str = "bfloat16"
    optimizer_dtype: str = "float32"
    activation_dtype: str = "bfloat16"
    master_weights: bool = False     # an extra float32 copy of the weights in the optimizer
    devices_per_node: int = 0        # 0: the hardware's NVLink domain, fitted to `gpus`
    gmm_tile: int = 128              # rows per grouped-GEMM tile (per-expert padding)
    shard_non_expert_over_ep: bool = True
    attention_impl: str = "flash"    # naive: full S x S scores materialised, half masked away

    def __post_init__(self) -> None:
        for f in ("gpus", "fsdp", "ep", "per_device_batch", "seq_len", "gmm_tile"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                _fail(f, v, "must be a positive int")
        for f in ("data", "devices_per_node"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 0:
                _fail(f, v, "must be an int >= 0")
        used = self.fsdp * self.ep * (self.data or 1)
        if self.data == 0 and self.gpus % (self.fsdp * self.ep):
            _fail("gpus", self.gpus, f"is not a multiple of fsdp={self.fsdp} x ep={self.ep} "
                  f"= {self.fsdp * self.ep}")
        if self.data and used != self.gpus:
            _fail("gpus", self.gpus, f"differs from the layout data={self.data} x fsdp="
                  f"{self.fsdp} x ep={self.ep} = {used} devices")
        checks = (("remat", REMAT_POLICIES), ("dispatcher", DISPATCHERS),
                  ("overlap", OVERLAPS), ("gmm_quantization", GMM_QUANTIZATIONS),
                  ("attention_impl", ATTENTION_IMPLS))
        for f, allowed in checks:
            if getattr(self, f) not in allowed:
                _fail(f, getattr(self, f), f"must be one of {allowed}")
        for f in ("weight_dtype", "optimizer_dtype", "activation_dtype"):
            if getattr(self, f) not in DTYPE_BYTES:
                _fail(f, getattr(self, f), f"must be one of {tuple(DTYPE_BYTES)}")
        if not self.ragged_buffer_factor >= 1.0:
            _fail("ragged_buffer_factor", self.ragged_buffer_factor, "must be >= 1.0")
        for name in self.offload or ():
            if name not in OFFLOADABLE:
                _fail("offload", self.offload, f"may only name {OFFLOADABLE}")

    def replace(self, **changes) -> "PlanConfig":
        return dataclasses.replace(self, **changes)

    @property
    def replicas(self) -> int:
        return self.data or self.gpus // (self.fsdp * self.ep)

    @property
    def tokens_per_device(self) -> int:
        return self.per_device_batch * self.seq_len

    @property
    def offloaded(self) -> tuple[str, ...]:
        if self.offload is not None:
            return self.offload
        return ("query", "value") if self.remat == "offload" else ()


def check_fits_model(cfg: PlanConfig, shape: ModelConfig, name: str = "the model") -> None:
    """Errors for layouts the model cannot take (EP must divide the experts)."""
    if shape.moe is not None and shape.moe.num_experts % cfg.ep:
        raise ValueError(f"PlanConfig.ep={cfg.ep} does not divide num_experts="
                         f"{shape.moe.num_experts} of {name}")
    if shape.moe is None and cfg.ep > 1:
        raise ValueError(f"PlanConfig.ep={cfg.ep} needs an MoE model; {name} is dense")


def node_size(cfg: PlanConfig, hw: HardwareProfile) -> int:
    """Devices per node: the largest divisor of `gpus` that fits in one NVLink domain
    (72-GPU NVL72 racks run power-of-two meshes on 64 of them)."""
    limit = cfg.devices_per_node or hw.gpus_per_domain
    return max(d for d in range(1, min(limit, cfg.gpus) + 1) if cfg.gpus % d == 0)


@dataclasses.dataclass(frozen=True)
class Group:
    """A collective group: `size` devices `stride` apart, `inner` of them in one node."""

    size: int
    stride: int
    inner: int

    @property
    def outer(self) -> int:
        return self.size // self.inner


def group(size: int, stride: int, node: int) -> Group:
    """How a group of `size` devices spaced `stride` apart splits over nodes of `node`."""
    per_node = max(1, node // stride) if stride <= node else 1
    return Group(size, stride, math.gcd(size, per_node))


def groups(cfg: PlanConfig, hw: HardwareProfile) -> dict[str, Group]:
    """The collective groups of the layout: expert, fsdp (expert weights), fsdp_all (non-expert
    weights), data (gradient all-reduce across replicas)."""
    node = node_size(cfg, hw)
    fsdp_all = cfg.fsdp * cfg.ep if cfg.shard_non_expert_over_ep else cfg.fsdp
    return {"expert": group(cfg.ep, 1, node),
            "fsdp": group(cfg.fsdp, cfg.ep, node),
            "fsdp_all": group(fsdp_all, 1 if cfg.shard_non_expert_over_ep else cfg.ep, node),
            "data": group(cfg.replicas, cfg.ep * cfg.fsdp, node)}
