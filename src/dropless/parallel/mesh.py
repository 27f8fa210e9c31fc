"""Mesh construction from a MeshConfig (the builder of the trainer, benches and tests), the mesh
with its node size (`NodeMesh`), and the logical-axis -> mesh-axis rules.

Math code names logical axes only ("batch", "expert", "embed", "mlp"); this module is the
place that says which mesh axes carry them. Meshes use `AxisType.Auto` axes, so jit may
reshard around the single `shard_map` boundary in the dispatcher (jax 0.10 `make_mesh`
defaults to Explicit axes, which would make every array's sharding part of its type).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from dropless.config import MESH_AXES, MeshConfig

# ZeRO-3 over fsdp x expert, as MaxText's default logical_axis_rules shard `embed`, `q_lora`
# and `kv_lora` over [..., 'fsdp', ..., 'expert'] (AI-Hypercomputer/maxtext,
# src/MaxText/configs/base.yml): every weight's FSDP dim is split over fsdp x expert, so no
# expert rank holds a whole copy of the attention, dense FFN, shared experts, embedding, head or
# MTP. A routed expert [E, D, F] keeps `expert` on dim E, and `logical_to_spec` uses each mesh
# axis once, so its D dim is split over fsdp alone. The gradients of the others are
# reduce-scattered over fsdp x expert and all-reduced over `data` only.
_FSDP = ("fsdp", "expert")
# logical axis -> mesh axes carrying it (in order); axes absent from a mesh are skipped.
LOGICAL_RULES: dict[str, tuple[str, ...]] = {
    "batch": MESH_AXES,                    # tokens are split over every axis (batch_axes)
    "expert": ("expert",),                 # expert weights: one slice of experts per EP rank
    "embed": _FSDP,                        # model dim of weights: ZeRO-3 over fsdp x expert
    "vocab": _FSDP,                        # vocabulary dim of the embedding / head
    "q_lora": _FSDP,                       # MLA query latent dim (of wq_b)
    "kv_lora": _FSDP,                      # MLA key/value latent dim (of wkv_b)
    "mlp": (),                             # hidden dim: not sharded (no tensor parallel)
    "heads": (),                           # attention heads: not sharded (no tensor parallel)
    "router": (),                          # router columns: replicated
    "layers": (),                          # scan-stacked layer dim: each scan step takes one
}


@dataclasses.dataclass(frozen=True)
class NodeMesh:
    """A device mesh and the node size of its devices: a device's node (ICI domain) is its id //
    `devices_per_node`; None puts every device on one node. The value every `mesh=` argument
    of the MoE layer, the model and the trainer takes (a plain Mesh or AbstractMesh passed
    there is one node, `node_mesh`); hashable, so it may be a static argument.
    """

    mesh: Mesh | AbstractMesh
    _: dataclasses.KW_ONLY
    devices_per_node: int | None = None

    def device_ids(self) -> np.ndarray:
        """Device ids in mesh order (an int array shaped like the mesh); an abstract mesh
        (cross-lowering) numbers its positions instead."""
        devices = getattr(self.mesh, "devices", None)
        if devices is None:
            sizes = tuple(self.mesh.axis_sizes)
            return np.arange(math.prod(sizes)).reshape(sizes)
        return np.vectorize(lambda d: int(d.id), otypes=[np.int64])(devices)

    def node_ids(self) -> np.ndarray:
        """Node of each mesh position: device id // devices_per_node; all 0 for one node."""
        ids = self.device_ids()
        n = self.devices_per_node
        return np.zeros_like(ids) if n is None else ids // n


AnyMesh = Mesh | AbstractMesh | NodeMesh   # what a `mesh=` argument takes


def node_mesh(mesh: AnyMesh) -> NodeMesh:
    """`mesh` with its node size: a NodeMesh as it is, a plain Mesh or AbstractMesh as one
    node."""
    return mesh if isinstance(mesh, NodeMesh) else NodeMesh(mesh)


def jax_mesh(mesh: AnyMesh | None) -> Mesh | AbstractMesh | None:
    """The jax mesh of `mesh` (a NodeMesh's `mesh`, a plain mesh as it is; None stays None)."""
    return mesh.mesh if isinstance(mesh, NodeMesh) else mesh


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A Mesh with axes MESH_AXES (data, fsdp, expert) of the configured sizes over `devices`.

    `devices` defaults to all of `jax.devices()` (every process's, under jax.distributed), in
    their global order; `expert` varies fastest so an EP group spans neighbouring devices. With
    a dcn_* size > 1 the mesh is built over nodes (`make_hybrid_mesh`: nodes of
    cfg.devices_per_node consecutive device ids). Raises ValueError when the product of the
    axis sizes differs from the device count.
    """
    devices = list(jax.devices() if devices is None else devices)
    if cfg.num_devices != len(devices):
        raise ValueError(
            f"MeshConfig(data={cfg.data}, fsdp={cfg.fsdp}, expert={cfg.expert}) needs "
            f"{cfg.num_devices} devices (data*fsdp*expert) but {len(devices)} are available")
    if cfg.num_nodes > 1:
        return make_hybrid_mesh(cfg.ici_shape, cfg.dcn_shape, devices)
    grid = np.asarray(devices, dtype=object).reshape(cfg.shape)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def train_mesh(cfg: MeshConfig) -> NodeMesh | None:
    """The trainer's mesh: None for one device (plain jit), else `make_mesh` over the first
    cfg.num_devices of `jax.devices()`, with cfg.devices_per_node as its node size. Any mesh of
    more than one device goes to the MoE layer too: with an expert axis of 1 the dispatcher
    still runs each device's tokens shard-locally (left to GSPMD, every device's routed rows
    were gathered and all-reduced: an 8-device step measured 1.7x its shard-local time).
    Raises ValueError when JAX sees fewer devices."""
    if cfg.num_devices == 1:
        return None
    have = jax.device_count()
    if cfg.num_devices > have:
        raise ValueError(f"mesh data*fsdp*expert parallelism = {cfg.num_devices} but JAX sees "
                         f"{have} devices (on a CPU, try xla_recipe=cpu8)")
    return NodeMesh(make_mesh(cfg, jax.devices()[:cfg.num_devices]),
                    devices_per_node=cfg.devices_per_node)


def batch_sharding(mesh: AnyMesh | None) -> NamedSharding | None:
    """The batch's placement: its first (batch) dim split over every mesh axis (`batch_axes`);
    None without a mesh."""
    mesh = jax_mesh(mesh)
    return None if mesh is None else NamedSharding(mesh, PartitionSpec(batch_axes(mesh)))


def make_hybrid_mesh(ici_shape: Sequence[int], dcn_shape: Sequence[int],
                     devices: Sequence[jax.Device] | None = None,
                     axis_names: Sequence[str] = MESH_AXES) -> Mesh:
    """A mesh over nodes (MaxText's ICI x DCN): axis i has size ici_shape[i] * dcn_shape[i].

    Devices are grouped into nodes of prod(ici_shape) consecutive device ids (`NodeMesh`), the
    grouping the dispatcher's node accounting uses. Along each axis the node index varies
    slowest (position = dcn index * ici size + ici index), so every ICI sub-block of the mesh is
    one node and only the dcn parts of the axes cross nodes. Raises ValueError when the device
    count is not prod(ici) * prod(dcn).
    """
    ici, dcn = tuple(int(v) for v in ici_shape), tuple(int(v) for v in dcn_shape)
    if len(ici) != len(axis_names) or len(dcn) != len(axis_names):
        raise ValueError(f"ici_shape={ici} and dcn_shape={dcn} need one size per axis "
                         f"{tuple(axis_names)}")
    devices = sorted(jax.devices() if devices is None else devices, key=lambda d: d.id)
    per_node, nodes = math.prod(ici), math.prod(dcn)
    if per_node * nodes != len(devices):
        raise ValueError(f"ici {ici} x dcn {dcn} needs {per_node * nodes} devices "
                         f"({nodes} nodes of {per_node}) but {len(devices)} are given")
    grid = np.asarray(devices, dtype=object).reshape(dcn + ici)   # node-major, then in-node
    n = len(axis_names)
    order = [k for i in range(n) for k in (i, n + i)]              # (dcn_0, ici_0, dcn_1, ...)
    grid = grid.transpose(order).reshape(tuple(a * b for a, b in zip(dcn, ici)))
    return Mesh(grid, tuple(axis_names), axis_types=(AxisType.Auto,) * n)


def mesh_axis_size(mesh: AnyMesh, axis: str) -> int:
    """Size of `axis` in `mesh`, 1 if the mesh has no such axis."""
    mesh = jax_mesh(mesh)
    return int(mesh.shape[axis]) if axis in mesh.axis_names else 1


def batch_axes(mesh: AnyMesh) -> tuple[str, ...]:
    """Mesh axes the token dim is split over: every axis of the mesh, in mesh order.

    A user-built mesh may have axes beyond (data, fsdp, expert); tokens are split over those too,
    so every device holds distinct tokens.
    """
    return tuple(jax_mesh(mesh).axis_names)


def split_axes(axes: Sequence[str], sizes: dict[str, int], length: int | None,
               used: set[str]) -> tuple[str, ...]:
    """The mesh axes (of `axes`, in order) one array dim of `length` is split over: each axis
    not in `used` (an array uses a mesh axis once) that divides what the axes kept before it
    leave of the dim (any, for length None). THE rule for a dim a mesh axis does not divide:
    `logical_to_spec` places parameters by it, and the planner counts their shards by it."""
    kept, size = [], 1
    for a in axes:
        n = sizes[a]
        if a in used or (length is not None and length % (size * n)):
            continue
        kept.append(a)
        size *= n
    return tuple(kept)


def logical_to_spec(logical: Sequence[str | None], mesh: AnyMesh,
                    shape: Sequence[int] | None = None) -> PartitionSpec:
    """PartitionSpec for an array whose dims have these logical axis names (None: replicated).

    With `shape`, a mesh axis that does not divide its dim (after the axes before it on that
    dim) is dropped, so that dim is replicated over it instead of failing to place; a mesh axis
    an earlier dim already carries is dropped too (an array uses each mesh axis once).
    Raises ValueError for a logical name missing from LOGICAL_RULES.
    """
    mesh = jax_mesh(mesh)
    dims, used = [], set()
    for i, name in enumerate(logical):
        if name is None:
            dims.append(None)
            continue
        if name not in LOGICAL_RULES:
            raise ValueError(f"logical axis {name!r} has no rule; known: {sorted(LOGICAL_RULES)}")
        axes = tuple(batch_axes(mesh)) if name == "batch" else tuple(
            a for a in LOGICAL_RULES[name] if a in mesh.axis_names)
        kept = split_axes(axes, {a: int(n) for a, n in mesh.shape.items()},
                          None if shape is None else shape[i], used)
        used.update(kept)
        dims.append(tuple(kept) if len(kept) > 1 else (kept[0] if kept else None))
    return PartitionSpec(*dims)
