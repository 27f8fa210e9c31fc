"""The static facts a dispatcher's per-device code needs, checked against the mesh.

Legend: T tokens, K top-k, E experts, P peers on the `expert` mesh axis, El = E/P local experts,
J = min(K, El) entries a row can carry, M nodes an EP group spans, G = P/M peers per node.

Nodes: the mesh arrives as a `parallel.mesh.NodeMesh` (device id // devices_per_node is a
device's node; the trainer's comes from MeshConfig, whose ici/dcn shape the mesh builder used);
a plain Mesh or AbstractMesh is one node. The `expert` axis varies fastest in our meshes, so an
EP group is M blocks of G neighbouring devices. `split_expert_axis` re-expresses the same
devices, in the same order, with the `expert` axis split into (`expert_node`, `expert_local`) so
the two-hop dispatcher (`node_a2a`) can run one collective across nodes and one inside a node.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from dropless.config import MoEConfig
from dropless.moe.dispatch import send_plan as sp
from dropless.parallel.mesh import AnyMesh, NodeMesh, node_mesh

EXPERT_AXIS = "expert"
NODE_AXES = ("expert_node", "expert_local")   # the expert axis split at node boundaries


def node_layout(mesh: AnyMesh) -> tuple[int, int]:
    """(M nodes, G peers per node) of every EP group on `mesh`'s `expert` axis.

    Raises ValueError naming devices_per_node when the groups do not split into equal blocks of
    neighbouring peers that share a node.
    """
    mesh = node_mesh(mesh)
    names = tuple(mesh.mesh.axis_names)
    ax = names.index(EXPERT_AXIS)
    nodes = np.moveaxis(mesh.node_ids(), ax, -1)
    nodes = nodes.reshape(-1, nodes.shape[-1])
    p = nodes.shape[1]
    g = int(np.sum(nodes[0] == nodes[0, 0]))
    blocks = nodes.reshape(nodes.shape[0], p // g, g) if p % g == 0 else None
    if blocks is None or not (blocks == blocks[..., :1]).all():
        raise ValueError(f"devices_per_node={mesh.devices_per_node} (MeshConfig: mesh.dcn_*) "
                         f"does not split the expert axis ({p} peers) into equal blocks of "
                         f"neighbouring devices on one node: node of each peer "
                         f"{nodes[0].tolist()}")
    return p // g, g


def split_expert_axis(mesh: AnyMesh) -> NodeMesh:
    """The same devices, same order and node size, with `expert` split into (`expert_node`,
    `expert_local`)."""
    mesh = node_mesh(mesh)
    m, g = node_layout(mesh)
    devices, names = mesh.mesh.devices, tuple(mesh.mesh.axis_names)
    ax = names.index(EXPERT_AXIS)
    shape = devices.shape[:ax] + (m, g) + devices.shape[ax + 1:]
    new_names = names[:ax] + NODE_AXES + names[ax + 1:]
    split = Mesh(devices.reshape(shape), new_names,
                 axis_types=(jax.sharding.AxisType.Auto,) * len(new_names))
    return NodeMesh(split, devices_per_node=mesh.devices_per_node)


@dataclasses.dataclass(frozen=True)
class EPContext:
    """Static facts the per-device code needs (hashable: it is a custom_vjp static argument)."""

    cfg: MoEConfig
    expert_axis: str | tuple[str, ...]   # `expert`, or NODE_AXES on a split mesh
    all_axes: tuple[str, ...]
    mesh_shape: tuple[int, ...]
    node_of_position: tuple[int, ...]   # node id of each mesh position, row-major
    num_tokens: int                     # local tokens per device
    num_peers: int
    experts_per_peer: int
    row_slots: int
    budget: sp.Budget
    overflow: str
    row_bytes: int                      # one travelling row: D activations
    dispatch_row_bytes: int             # one row in the dispatch direction: row_bytes, or
                                        # D FP8 codes + ceil(D/32) scales (dispatch_quantization)
    entry_bytes: int                    # one travelling entry: (row, expert) code + weight
    num_nodes: int = 1                  # M: nodes of an EP group
    node_size: int = 1                  # G: peers per node

    @property
    def max_rounds(self) -> int:
        """Static bound on the rounds any routing needs."""
        return self.budget.max_rounds


def make_context(cfg: MoEConfig, mesh: AnyMesh, num_tokens: int, dtype) -> EPContext:
    """Validate the mesh against the config and the token count; build the EPContext. The
    nodes are `mesh`'s (a NodeMesh's node size; a plain mesh is one node).

    Raises ValueError when the mesh has no `expert` axis, num_experts is not divisible by it,
    or the tokens do not split evenly over the devices.
    """
    nodes_mesh = node_mesh(mesh)
    mesh = nodes_mesh.mesh
    names = tuple(mesh.axis_names)
    split = all(a in names for a in NODE_AXES)
    if EXPERT_AXIS not in names and not split:
        raise ValueError(f"mesh axes {names} have no {EXPERT_AXIS!r} axis")
    axis = NODE_AXES if split else EXPERT_AXIS
    ep = math.prod(int(mesh.shape[a]) for a in NODE_AXES) if split else int(mesh.shape[axis])
    if cfg.num_experts % ep:
        raise ValueError(f"MoEConfig.num_experts={cfg.num_experts} is not divisible by expert "
                         f"parallelism {ep} (mesh axis {EXPERT_AXIS!r})")
    if num_tokens % mesh.size:
        raise ValueError(f"token count {num_tokens} is not divisible by the {mesh.size} devices "
                         f"of the mesh {dict(mesh.shape)}; pad the batch")
    t_local = num_tokens // mesh.size
    el = cfg.num_experts // ep
    j = sp.slots_per_row(cfg.top_k, el)
    nodes = tuple(int(i) for i in nodes_mesh.node_ids().flat)
    m, g = ((int(mesh.shape[NODE_AXES[0]]), int(mesh.shape[NODE_AXES[1]])) if split
            else node_layout(nodes_mesh) if _aligned(nodes_mesh)
            else (1, ep))
    return EPContext(
        cfg=cfg, expert_axis=axis, all_axes=names,
        mesh_shape=tuple(int(mesh.shape[a]) for a in names), node_of_position=nodes,
        num_tokens=t_local, num_peers=ep, experts_per_peer=el, row_slots=j,
        budget=sp.make_budget(t_local, cfg.top_k, cfg.num_experts, ep, cfg.ragged_buffer_factor),
        overflow=cfg.overflow, row_bytes=cfg.d_model * jnp.dtype(dtype).itemsize,
        dispatch_row_bytes=dispatch_row_bytes(cfg, dtype), entry_bytes=8,
        num_nodes=m, node_size=g)


def dispatch_row_bytes(cfg: MoEConfig, dtype) -> int:
    """Bytes of one row leaving a device in a dispatch: D activations of `dtype`, or with
    dispatch_quantization="mxfp8" D one-byte E4M3 codes and ceil(D/32) one-byte E8M0 scales."""
    if cfg.dispatch_quantization == "mxfp8":
        return cfg.d_model + -(-cfg.d_model // 32)
    return cfg.d_model * jnp.dtype(dtype).itemsize


def multi_node_groups(mesh: AnyMesh) -> int:
    """M when every EP group spans M > 1 nodes of G > 1 devices each (node dedup can help),
    else 1. A mesh without an `expert` axis, not aligned to nodes or of one node gives 1."""
    mesh = node_mesh(mesh)
    if EXPERT_AXIS not in tuple(mesh.mesh.axis_names) or not _aligned(mesh):
        return 1
    m, g = node_layout(mesh)
    return m if g > 1 else 1


def _aligned(mesh: NodeMesh) -> bool:
    try:
        node_layout(mesh)
        return True
    except ValueError:
        return False
