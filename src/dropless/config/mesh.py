"""`MeshConfig`: the device mesh's axis sizes, and the nodes each axis spans."""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from dropless.config.fields import _check_types, _fail, _positive_ints, described
from dropless.config.names import MESH_AXES


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """The device mesh: sizes of the `data`, `fsdp` and `expert` axes (product = device count),
    and of each, how many nodes (ICI domains, MaxText's dcn_*) it spans; the rest of the axis is
    inside one node.

    Tokens are sharded over all three axes; expert weights over `expert` (their first dim) and,
    with fsdp > 1, over `fsdp` (their model dim). Devices are grouped into nodes of
    `devices_per_node` consecutive ids (`parallel.mesh.make_mesh`); the expert axis varies
    fastest, so an expert group stays inside a node when dcn_expert = 1. The node size is read
    from here only: `parallel.mesh.train_mesh` puts it beside the mesh (a `NodeMesh`), which is
    how the dispatcher gets it.
    """

    data: int = described(1, doc="devices on the data axis: the batch split, weights replicated")
    fsdp: int = described(1, doc="devices on the fsdp axis: the batch split, weights and "
                                 "optimizer state sharded")
    expert: int = described(1, doc="devices on the expert axis: the batch split, experts "
                                   "divided among them (must divide model.moe.num_experts)")
    dcn_data: int = described(1, doc="nodes the data axis spans (divides data); the rest of the "
                                     "axis is inside a node")
    dcn_fsdp: int = described(1, doc="nodes the fsdp axis spans (divides fsdp)")
    dcn_expert: int = described(1, doc="nodes the expert axis spans (divides expert)")

    def __post_init__(self) -> None:
        c = "MeshConfig"
        _check_types(self)
        _positive_ints(c, self, MESH_AXES + tuple(f"dcn_{a}" for a in MESH_AXES))
        for axis in MESH_AXES:
            total, dcn = getattr(self, axis), getattr(self, f"dcn_{axis}")
            if total % dcn:
                _fail(c, f"dcn_{axis}", dcn, f"must divide {axis}={total}")

    @property
    def shape(self) -> tuple[int, ...]:
        """Axis sizes in MESH_AXES order."""
        return tuple(getattr(self, a) for a in MESH_AXES)

    @property
    def dcn_shape(self) -> tuple[int, ...]:
        """Nodes each axis spans, in MESH_AXES order."""
        return tuple(getattr(self, f"dcn_{a}") for a in MESH_AXES)

    @property
    def ici_shape(self) -> tuple[int, ...]:
        """The in-node part of each axis (shape / dcn_shape), in MESH_AXES order."""
        return tuple(n // d for n, d in zip(self.shape, self.dcn_shape))

    @property
    def num_devices(self) -> int:
        return math.prod(self.shape)

    @property
    def num_nodes(self) -> int:
        """Nodes (ICI domains) the mesh spans: the product of the dcn_* sizes."""
        return math.prod(self.dcn_shape)

    @property
    def devices_per_node(self) -> int:
        """Devices inside one node: num_devices // num_nodes (the product of the ICI parts)."""
        return self.num_devices // self.num_nodes

    def replace(self, **changes: Any) -> "MeshConfig":
        return dataclasses.replace(self, **changes)
