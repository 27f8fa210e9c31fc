"""What is being planned: a training run (`config.TrainConfig`: the model, the mesh, the batch,
the remat policy) on a cluster, and the settings only the planner has.

Mesh axes are laid out innermost first: `expert` (stride 1), then `fsdp`, then `data`, so the
EP group of a device is its nearest neighbours and stays inside one NVLink domain whenever
`expert <= node size`. Weights are placed as the trainer places them (`weight_shards`, read
from `parallel.mesh.LOGICAL_RULES`): the routed experts split over `expert` by expert and over
`fsdp` within each expert, the other matrices over fsdp x expert (ZeRO-3, as MaxText), norms
and the router whole everywhere; the `data` axis replicates them all. The collective groups
(`groups`) follow from the same rule: a layer all-gathers (and its gradient reduce-scatters)
a weight over the mesh axes of its FSDP dim, and the gradient shards are all-reduced over the
mesh axes that split none of its dims.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

from dropless.config import (DISPATCHERS, MESH_AXES, REMAT_POLICIES, MeshConfig, MoEConfig,
                             ModelConfig, TrainConfig, scalar_fields, scalar_type_error)
from dropless.machine import HardwareProfile
from dropless.parallel.mesh import LOGICAL_RULES, split_axes

# The trainer's dispatcher (config.DISPATCHERS) -> the planner's model of it: "auto" is
# ragged_a2a on GPUs; "local" (no expert axis) moves nothing, so any model will do; node_a2a's
# two hops are planned as a2a (static per-peer chunks, one hop).
PLANNED_DISPATCHER = {"auto": "ragged_a2a", "local": "ragged_a2a", "a2a": "a2a",
                      "ragged_a2a": "ragged_a2a", "allgather": "allgather", "node_a2a": "a2a"}
# The dispatchers the planner models, each the model of itself.
MODELLED_DISPATCHERS = tuple(d for d in DISPATCHERS if PLANNED_DISPATCHER.get(d) == d)


class RematModel(NamedTuple):
    """What a remat policy keeps for the backward pass and whether it recomputes matmuls."""

    keeps: frozenset[str] | None   # tensor kinds kept (plan/memory.Tensor.kind); None: all
    recomputes_layer: bool         # the layer's forward runs again in the backward pass
    recomputes_attention: bool     # the attention core's forward runs again (implied by the above)


# Each remat policy (config.REMAT_POLICIES): none saves everything; minimal keeps layer inputs
# and the outputs of the projections and the experts' grouped matmuls (elementwise results are
# recomputed, and so is the attention core: its products have batch dims and cuDNN's is a
# custom call, neither of which the policy keeps, and a custom call's own residuals are never
# kept, so its forward runs again in the backward pass); full keeps layer inputs and recomputes
# the layer; offload is full plus the `offload` tensors in host memory.
REMAT = {"none": RematModel(None, False, False),
         "minimal": RematModel(frozenset({"input", "dot", "expert_dot"}), False, True),
         "full": RematModel(frozenset({"input"}), True, True),
         "offload": RematModel(frozenset({"input"}), True, True)}

if set(PLANNED_DISPATCHER) != set(DISPATCHERS) or set(REMAT) != set(REMAT_POLICIES):
    raise ImportError(f"plan/layout.py models the dispatchers {tuple(PLANNED_DISPATCHER)} and "
                      f"remat policies {tuple(REMAT)}; config accepts {DISPATCHERS} and "
                      f"{REMAT_POLICIES}: make them equal")

OVERLAPS = ("none", "fsdp", "full")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
OFFLOADABLE = ("query", "key", "value")
ATTENTION_IMPLS = ("flash", "naive")
BUFFER_FACTOR_WITHOUT_MOE = 2.0   # what a dense model's layout shows (MoEConfig's default)
# the most devices a plan has (over a million GPUs, more than any cluster): the layout search
# and the node sizes walk the device count's divisors, work that grows with it
MAX_DEVICES = 2 ** 20


def _fail(field: str, value, why: str) -> None:
    raise ValueError(f"PlanConfig.{field}={value!r} {why}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanConfig:
    """One training run (`run`) on one cluster, with the planner's own settings.

    A step is `accumulation` (the run's `gradient_accumulation_steps`) forward and backward
    passes of `micro_tokens_per_device` tokens each, their gradients added up, then one optimizer
    update (`step_tokens_per_device` tokens in all).
    The run's `remat` (config.REMAT_POLICIES, `REMAT`) decides what is kept for backward;
    `offload` names the tensors kept in host memory (None: query and value with remat=offload).
    The MoE layer's dispatcher is planned as `PLANNED_DISPATCHER` says: ragged_a2a (only real
    rows move) | a2a (static per-peer chunks of buffer factor x the balanced load) | allgather.
    overlap: none (every part serial) | fsdp (FSDP/data collectives hidden behind compute)
      | full (EP dispatch/combine also overlapped, e.g. two micro-batches).
    attention_impl: flash (fused, causal half computed) | naive (the S x S scores and
      probabilities materialised and the full square computed, as plain XLA on CPU does).
    devices_per_node: the node size; 0 takes the mesh's when it spans several nodes (dcn_*),
      else the hardware's NVLink domain, fitted to the device count (`node_size`).
    Raises ValueError naming the field for a bad setting, for more than MAX_DEVICES devices and
    for MoE chunks (`ep_chunks`) that do not split a device's tokens.
    """

    run: TrainConfig
    offload: tuple[str, ...] | None = None
    dedup: bool = True
    overlap: str = "fsdp"
    optimizer_dtype: str = "float32"
    master_weights: bool = False     # an extra float32 copy of the weights in the optimizer
    devices_per_node: int = 0
    gmm_tile: int = 128              # rows per grouped-GEMM tile (per-expert padding)
    attention_impl: str = "flash"    # naive: full S x S scores materialised, half masked away

    def __post_init__(self) -> None:
        if not isinstance(self.run, TrainConfig):
            _fail("run", type(self.run).__name__, "must be a TrainConfig")
        for name, kind in scalar_fields(PlanConfig).items():
            why = scalar_type_error(getattr(self, name), *kind)
            if why:
                _fail(name, getattr(self, name), why)
        if self.gmm_tile <= 0:
            _fail("gmm_tile", self.gmm_tile, "must be a positive int")
        if self.devices_per_node < 0:
            _fail("devices_per_node", self.devices_per_node, "must be an int >= 0")
        for f, allowed in (("overlap", OVERLAPS), ("attention_impl", ATTENTION_IMPLS),
                           ("optimizer_dtype", tuple(DTYPE_BYTES))):
            if getattr(self, f) not in allowed:
                _fail(f, getattr(self, f), f"must be one of {allowed}")
        for f in ("dtype", "weight_dtype"):
            if getattr(self.model, f) not in DTYPE_BYTES:
                _fail(f"run.model.{f}", getattr(self.model, f),
                      f"must be one of {tuple(DTYPE_BYTES)}")
        for name in self.offload or ():
            if name not in OFFLOADABLE:
                _fail("offload", self.offload, f"may only name {OFFLOADABLE}")
        if self.model.moe is None and self.mesh.expert > 1:
            _fail("run.mesh.expert", self.mesh.expert, "needs an MoE model; the model is dense")
        k = self.ep_chunks
        if self.micro_tokens_per_device % k:   # as the trainer's overlap.chunk_tokens refuses
            _fail("run.model.moe.ep_comm_overlap_chunks", k,
                  f"does not divide the {self.micro_tokens_per_device} tokens a device holds "
                  "(per_device_batch_size x seq_len); use a divisor of them")
        if self.mesh.num_devices > MAX_DEVICES:
            _fail("run.mesh", self.mesh.shape, f"has {self.mesh.num_devices} devices (gpus), more "
                  f"than the planner plans ({MAX_DEVICES}, 2**20); plan fewer GPUs")

    def replace(self, **changes: Any) -> "PlanConfig":
        return dataclasses.replace(self, **changes)

    def replace_run(self, **changes: Any) -> "PlanConfig":
        """This plan with `run` changed (`TrainConfig.replace`)."""
        return self.replace(run=self.run.replace(**changes))

    def replace_moe(self, **changes: Any) -> "PlanConfig":
        """This plan with the run's MoE layer changed (`MoEConfig.replace`)."""
        return self.replace_run(model=self.model.replace(moe=self.model.moe.replace(**changes)))

    @property
    def model(self) -> ModelConfig:
        return self.run.model

    @property
    def mesh(self) -> MeshConfig:
        return self.run.mesh

    @property
    def moe(self) -> MoEConfig | None:
        return self.run.model.moe

    @property
    def accumulation(self) -> int:
        """Forward and backward passes (micro-batches) in one optimizer step: the run's
        `gradient_accumulation_steps`."""
        return self.run.gradient_accumulation_steps

    @property
    def micro_tokens_per_device(self) -> int:
        """Tokens one forward and backward pass sees on one device (per_device_batch_size x
        seq_len): what activations, buffers and every per-pass transfer scale with."""
        return self.run.per_device_batch_size * self.run.seq_len

    @property
    def step_tokens_per_device(self) -> int:
        """Tokens one optimizer step trains on per device: `accumulation` micro-batches."""
        return self.micro_tokens_per_device * self.accumulation

    @property
    def ep_chunks(self) -> int:
        """The chunks each device's tokens of an MoE layer run in: the MoE layer's
        `ep_comm_overlap_chunks` where the trainer runs it on a mesh through a dispatcher (more
        than one device: `parallel.mesh.train_mesh`; a dispatcher other than local), else 1."""
        moe = self.moe
        if moe is None or self.mesh.num_devices == 1 or moe.dispatcher == "local":
            return 1
        return moe.ep_comm_overlap_chunks

    @property
    def offloaded(self) -> tuple[str, ...]:
        if self.offload is not None:
            return self.offload
        return ("query", "value") if self.run.remat == "offload" else ()

    @property
    def planned_dispatcher(self) -> str:
        """The dispatcher as planned: a2a | ragged_a2a | allgather (`PLANNED_DISPATCHER`)."""
        return PLANNED_DISPATCHER[self.moe.dispatcher] if self.moe is not None else "ragged_a2a"

    @property
    def mxfp8(self) -> bool:
        """Whether the routed experts' grouped matmuls run in MXFP8."""
        return self.moe is not None and self.moe.gmm_quantization == "mxfp8"

    @property
    def activation_bytes(self) -> int:
        return DTYPE_BYTES[self.model.dtype]

    @property
    def weight_bytes(self) -> int:
        return DTYPE_BYTES[self.model.weight_dtype]

    @property
    def optimizer_bytes(self) -> int:
        return DTYPE_BYTES[self.optimizer_dtype]



# The planner's parameter groups -> the logical axes their dims carry in the trainer's
# placement table (parallel/sharding.py PARAM_AXES): the routed experts' `expert` and `embed`
# dims; the other matrices' one FSDP dim (`embed`, `vocab`, `q_lora` or `kv_lora`, all one
# rule); norm vectors and the router none. A dim that a mesh axis does not divide is replicated
# over it by the trainer (`parallel.mesh.split_axes`); given the dim's length, `weight_shards`
# (memory) and `weight_collective_groups` (collectives) count it so.
WEIGHT_GROUPS: dict[str, tuple[str, ...]] = {"experts": ("expert", "embed"),
                                              "sharded": ("embed",), "replicated": ()}
FSDP_LOGICAL = "embed"   # the dim a layer all-gathers before it computes


def weight_axes(group: str, mesh: MeshConfig | None = None,
                length: int | None = None) -> dict[str, tuple[str, ...]]:
    """The mesh axes each logical dim of a weight of `group` (`WEIGHT_GROUPS`) is split over, as
    `parallel.mesh.logical_to_spec` assigns them from LOGICAL_RULES: earlier dims first, each
    mesh axis once (the routed experts' `embed` dim: fsdp, `expert` being dim E's). With `mesh`
    and `length` (of the FSDP dim), an axis that does not divide it is dropped, as the trainer
    drops it (`parallel.mesh.split_axes`; E always divides: make_context refuses a mesh it
    does not). Raises KeyError for an unknown group."""
    sizes = dict(zip(MESH_AXES, mesh.shape)) if mesh is not None else dict.fromkeys(MESH_AXES, 1)
    used: set[str] = set()
    out = {}
    for a in WEIGHT_GROUPS[group]:
        rule = tuple(m for m in LOGICAL_RULES[a] if m in MESH_AXES)
        out[a] = split_axes(rule, sizes, length if a == FSDP_LOGICAL else None, used)
        used.update(out[a])
    return out


def weight_shards(mesh: MeshConfig, group: str, *, gathered: bool = False,
                  length: int | None = None) -> int:
    """Devices one weight of `group` (`WEIGHT_GROUPS`) is split over on `mesh`: the product of
    the sizes of the mesh axes `weight_axes` gives, as `parallel.sharding.state_shardings`
    places parameters, gradients and Adam moments; `length`: its FSDP dim's, so that an axis
    that does not divide it is not counted (None: every axis divides). With `gathered`, the
    layer's all-gathered copy: its FSDP dim whole. Raises KeyError for an unknown group."""
    return _weight_shards(mesh, group, gathered, length)


@functools.lru_cache(maxsize=1024)   # a plan asks once a weight kind, a search once a candidate
def _weight_shards(mesh: MeshConfig, group: str, gathered: bool, length: int | None) -> int:
    sizes = dict(zip(MESH_AXES, mesh.shape))
    return math.prod(sizes[m] for a, axes in weight_axes(group, mesh, length).items()
                     if not (gathered and a == FSDP_LOGICAL) for m in axes)


def node_limit(cfg: PlanConfig) -> int:
    """The node size `cfg` sets (its `devices_per_node`, else its mesh's when the mesh spans
    several nodes), or 0 when the hardware decides."""
    mesh = cfg.mesh
    return cfg.devices_per_node or (mesh.devices_per_node if mesh.num_nodes > 1 else 0)


@functools.lru_cache(maxsize=64)
def divisors(n: int) -> tuple[int, ...]:
    """The divisors of `n` > 0, ascending, in sqrt(n) steps (remembered: a plan asks for its
    device count's at every collective group)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return tuple(small + [n // d for d in reversed(small) if d * d != n])


def check_node_size(cfg: PlanConfig) -> None:
    """Raise ValueError when the node size the user set (`devices_per_node`) and the device
    count contradict each other: more than one node, and the devices do not fill whole nodes
    (`node_size` would otherwise plan smaller nodes than asked for). The hardware's own domain
    (72 GPUs, run as 64) is no contradiction: no one asked for it."""
    n, asked = cfg.mesh.num_devices, cfg.devices_per_node
    if asked and asked < n and n % asked:
        fits = [d for d in divisors(n) if d <= asked]
        raise ValueError(f"devices_per_node={asked} does not divide the {n} devices (gpus / the "
                         f"mesh): {n} devices cannot fill nodes of {asked}; set devices_per_node "
                         f"to a divisor of {n} (the largest below {asked}: {fits[-1]}) or gpus "
                         f"to a multiple of {asked}")


def node_size(cfg: PlanConfig, hw: HardwareProfile) -> int:
    """Devices per node: the largest divisor of the device count that fits in one node of
    `node_limit`, or of the hardware's NVLink domain (72-GPU NVL72 racks run power-of-two
    meshes on 64 of them)."""
    return _largest_divisor(cfg.mesh.num_devices, node_limit(cfg) or hw.gpus_per_domain)


@functools.lru_cache(maxsize=256)
def _largest_divisor(n: int, limit: int) -> int:
    return max(d for d in divisors(n) if d <= limit)


def on_mesh(cfg: PlanConfig, *, data: int, fsdp: int, expert: int) -> PlanConfig:
    """`cfg` on the mesh data x fsdp x expert (one of `dropless plan --sweep-gpus / --suggest`'s
    variants), in nodes of `cfg`'s size: `node_limit(cfg)` becomes the plan's
    `devices_per_node`."""
    mesh = MeshConfig(data=data, fsdp=fsdp, expert=expert)
    return cfg.replace(run=cfg.run.replace(mesh=mesh), devices_per_node=node_limit(cfg))


def mesh_on_devices(mesh: MeshConfig, gpus: int) -> MeshConfig:
    """`mesh` on `gpus` devices (the planner's `gpus` setting): `mesh` itself when it has that
    many; with a data axis of 1, the data axis fills the rest (gpus / (fsdp x expert)), one
    node per replica group when the mesh spans several nodes. Raises ValueError when `gpus` is
    not positive, not a multiple of fsdp x expert, or differs from a mesh whose data axis is
    set."""
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus <= 0:
        raise ValueError(f"gpus={gpus!r} must be a positive int")
    if gpus == mesh.num_devices:
        return mesh
    inner = mesh.fsdp * mesh.expert
    if mesh.data != 1:
        raise ValueError(f"gpus={gpus} differs from the layout data={mesh.data} x fsdp="
                         f"{mesh.fsdp} x ep={mesh.expert} = {mesh.num_devices} devices")
    if gpus % inner:
        raise ValueError(f"gpus={gpus} is not a multiple of fsdp={mesh.fsdp} x ep="
                         f"{mesh.expert} = {inner}")
    data = gpus // inner
    return mesh.replace(data=data, dcn_data=data if mesh.num_nodes > 1 else 1)


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


def axes_group(mesh: MeshConfig, axes: tuple[str, ...], node: int) -> Group:
    """The collective group of the devices that differ only in their index along `axes` (mesh
    axes laid out innermost last, `expert` at stride 1): its size, its smallest stride and how
    many of its devices share a node of `node` (each axis's own share, multiplied)."""
    strides = {a: math.prod(mesh.shape[i + 1:]) for i, a in enumerate(MESH_AXES)}
    sizes = dict(zip(MESH_AXES, mesh.shape))
    parts = [group(sizes[a], strides[a], node) for a in axes]
    return Group(math.prod(p.size for p in parts), min((p.stride for p in parts), default=1),
                 math.prod(p.inner for p in parts))


def weight_collective_groups(cfg: PlanConfig, hw: HardwareProfile, group: str,
                             length: int | None = None) -> tuple[Group, Group]:
    """(gather, replicas) of a weight of `group` (`WEIGHT_GROUPS`) whose FSDP dim has `length`
    (None: every axis divides it), from the trainer's placement (`weight_axes`): `gather`, the
    mesh axes of its FSDP dim (the layer's all-gathers and its gradient's reduce-scatter: fsdp
    for the experts, fsdp x expert for the others, an axis that does not divide the dim
    dropped; none for the replicated weights), `replicas`, the mesh axes splitting none of its
    dims (its gradient shard's all-reduce: data, plus any axis dropped from its FSDP dim; every
    axis for the replicated weights)."""
    return _collective_groups(cfg.mesh, node_size(cfg, hw), group, length)


# remembered by mesh, node size, group and length: a plan asks once a layer kind and part
@functools.lru_cache(maxsize=1024)
def _collective_groups(m: MeshConfig, node: int, group: str, length: int | None
                       ) -> tuple[Group, Group]:
    dims = weight_axes(group, m, length)
    split = {a for axes in dims.values() for a in axes}
    return (axes_group(m, dims.get(FSDP_LOGICAL, ()), node),
            axes_group(m, tuple(a for a in MESH_AXES if a not in split), node))


def groups(cfg: PlanConfig, hw: HardwareProfile) -> dict[str, Group]:
    """The collective groups of the layout: `expert` (dispatch and combine) and, for the
    routed experts (`experts_`) and the other matrices (`sharded_`) whose FSDP dim every axis
    divides, `*_gather` and `*_replicas` (`weight_collective_groups`)."""
    out = {"expert": axes_group(cfg.mesh, ("expert",), node_size(cfg, hw))}
    for w in ("experts", "sharded"):
        out[f"{w}_gather"], out[f"{w}_replicas"] = weight_collective_groups(cfg, hw, w)
    return out


def flat_settings(cfg: PlanConfig) -> dict[str, Any]:
    """The plan under the names `dropless plan` shows (its flags and the `layout` of its JSON):
    gpus, fsdp, ep, data, per_device_batch, seq_len, gradient_accumulation_steps, remat, the
    MoE layer's gmm_quantization, dispatcher (as planned), ragged_buffer_factor and
    ep_comm_overlap_chunks, the dtypes, scan_layers (the layer layout, which the memory model
    follows) and the planner's settings."""
    m, moe, model = cfg.mesh, cfg.moe, cfg.model
    return {"gpus": m.num_devices, "fsdp": m.fsdp, "ep": m.expert, "data": m.data,
            "per_device_batch": cfg.run.per_device_batch_size, "seq_len": cfg.run.seq_len,
            "gradient_accumulation_steps": cfg.accumulation,
            "remat": cfg.run.remat, "offload": cfg.offload,
            "gmm_quantization": moe.gmm_quantization if moe is not None else "none",
            "dispatcher": cfg.planned_dispatcher, "dedup": cfg.dedup,
            "ragged_buffer_factor": (moe.ragged_buffer_factor if moe is not None
                                     else BUFFER_FACTOR_WITHOUT_MOE),
            "overlap": cfg.overlap,
            "ep_comm_overlap_chunks": moe.ep_comm_overlap_chunks if moe is not None else 1,
            "weight_dtype": model.weight_dtype,
            "optimizer_dtype": cfg.optimizer_dtype, "activation_dtype": model.dtype,
            "master_weights": cfg.master_weights, "scan_layers": model.scan_layers,
            "devices_per_node": cfg.devices_per_node,
            "gmm_tile": cfg.gmm_tile, "attention_impl": cfg.attention_impl}
