"""The static facts a dispatcher's per-device code needs, checked against the mesh.

Legend: T tokens, K top-k, E experts, P peers on the `expert` mesh axis, El = E/P local experts,
J = min(K, El) entries a row can carry.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax.sharding import Mesh

from dropless.config import MoEConfig
from dropless.moe.dispatch import plan as dp

EXPERT_AXIS = "expert"


@dataclasses.dataclass(frozen=True)
class EPContext:
    """Static facts the per-device code needs (hashable: it is a custom_vjp static argument)."""

    cfg: MoEConfig
    expert_axis: str
    all_axes: tuple[str, ...]
    mesh_shape: tuple[int, ...]
    node_of_position: tuple[int, ...]   # node id of each mesh position, row-major
    num_tokens: int                     # local tokens per device
    num_peers: int
    experts_per_peer: int
    row_slots: int
    budget: dp.Budget
    overflow: str
    row_bytes: int                      # one travelling row: D activations
    entry_bytes: int                    # one travelling entry: (row, expert) code + weight

    @property
    def max_rounds(self) -> int:
        """Static bound on the rounds any routing needs."""
        return self.budget.max_rounds


def make_context(cfg: MoEConfig, mesh: Mesh, num_tokens: int, dtype) -> EPContext:
    """Validate the mesh against the config and the token count; build the EPContext.

    Raises ValueError when the mesh has no `expert` axis, num_experts is not divisible by it,
    or the tokens do not split evenly over the devices.
    """
    if EXPERT_AXIS not in mesh.axis_names:
        raise ValueError(f"mesh axes {mesh.axis_names} have no {EXPERT_AXIS!r} axis")
    ep = int(mesh.shape[EXPERT_AXIS])
    if cfg.num_experts % ep:
        raise ValueError(f"MoEConfig.num_experts={cfg.num_experts} is not divisible by expert "
                         f"parallelism {ep} (mesh axis {EXPERT_AXIS!r})")
    if num_tokens % mesh.size:
        raise ValueError(f"token count {num_tokens} is not divisible by the {mesh.size} devices "
                         f"of the mesh {dict(mesh.shape)}; pad the batch")
    t_local = num_tokens // mesh.size
    el = cfg.num_experts // ep
    j = dp.slots_per_row(cfg.top_k, el)
    nodes = tuple(int(d.id) // cfg.devices_per_node for d in mesh.devices.flat)
    return EPContext(
        cfg=cfg, expert_axis=EXPERT_AXIS, all_axes=tuple(mesh.axis_names),
        mesh_shape=tuple(int(s) for s in mesh.devices.shape), node_of_position=nodes,
        num_tokens=t_local, num_peers=ep, experts_per_peer=el, row_slots=j,
        budget=dp.make_budget(t_local, cfg.top_k, cfg.num_experts, ep, cfg.ragged_buffer_factor),
        overflow=cfg.overflow, row_bytes=cfg.d_model * jnp.dtype(dtype).itemsize, entry_bytes=8)
