"""Parameter placement: one table from parameter path to logical axes.

Legend: D model dim, E experts, F expert hidden dim.
"""
from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dropless.parallel.mesh import logical_to_spec

# The parameter group whose arrays are stacked over layers (scanned layers, models/scan.py).
STACKED_GROUP = "layer_runs"

# "group/name" -> logical axis per dim. Expert weights split over `expert` (dim E) and FSDP
# over `embed` (dim D); the router and shared experts are small and stay replicated.
PARAM_AXES: dict[str, tuple[str | None, ...]] = {
    "router/w_DE": (None, "router"),
    "router/bias_E": ("router",),
    "experts/w_gate_EDF": ("expert", "embed", "mlp"),
    "experts/w_up_EDF": ("expert", "embed", "mlp"),
    "experts/w_gate_up_ED2F": ("expert", "embed", "mlp"),   # prefuse_moe_weights
    "experts/w_down_EFD": ("expert", "mlp", "embed"),
    "shared/w_gate_DF": ("embed", "mlp"),
    "shared/w_up_DF": ("embed", "mlp"),
    "shared/w_down_FD": ("mlp", "embed"),
}


def _path(keys) -> str:
    return "/".join(str(getattr(k, "key", k)) for k in keys)


def param_specs(params: Any, mesh: Mesh) -> Any:
    """A pytree of PartitionSpecs like `params`; a path missing from PARAM_AXES raises
    ValueError naming it."""
    def spec(keys, leaf) -> PartitionSpec:
        path = _path(keys)
        if path not in PARAM_AXES:
            raise ValueError(f"parameter {path!r} has no entry in PARAM_AXES; "
                             f"known: {sorted(PARAM_AXES)}")
        axes = PARAM_AXES[path]
        if len(axes) != leaf.ndim:
            raise ValueError(f"parameter {path!r} has shape {leaf.shape} but PARAM_AXES gives "
                             f"{len(axes)} axes {axes}")
        return logical_to_spec(axes, mesh)
    return jax.tree_util.tree_map_with_path(spec, params)


def param_shardings(params: Any, mesh: Mesh) -> Any:
    """NamedShardings for `params` on `mesh` (see PARAM_AXES)."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(params, mesh),
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def shard_params(params: Any, mesh: Mesh) -> Any:
    """Place `params` on `mesh` according to PARAM_AXES."""
    return jax.device_put(params, param_shardings(params, mesh))


def _divisible(spec: PartitionSpec, shape: tuple[int, ...], mesh: Mesh) -> bool:
    for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        names = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
        size = 1
        for a in names:
            size *= mesh.shape[a]
        if dim % size:
            return False
    return True


def leaf_spec(name: str, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """Placement of one array of a whole train state (parameters or their optimizer moments).

    MoE weights (named as in PARAM_AXES, whatever group holds them) follow the table; any other
    array of rank >= 2 is split over `fsdp` along its largest dim that divides evenly (FSDP: XLA
    gathers it where used); the rest (scalars, vectors, uneven shapes) is replicated.
    """
    for path, axes in PARAM_AXES.items():
        if name == path.split("/")[-1] and len(axes) == len(shape):
            spec = logical_to_spec(axes, mesh)
            if _divisible(spec, shape, mesh):
                return spec
    fsdp = mesh.shape.get("fsdp", 1)
    if len(shape) >= 2 and fsdp > 1:
        dims = [i for i in range(len(shape)) if shape[i] % fsdp == 0]
        if dims:
            best = max(dims, key=lambda i: shape[i])
            return PartitionSpec(*[("fsdp" if i == best else None) for i in range(len(shape))])
    return PartitionSpec()


def state_shardings(state: Any, mesh: Mesh) -> Any:
    """NamedShardings for a whole train state (params, optimizer state, ...) on `mesh`.

    Arrays under "layer_runs" (scanned layers, models/scan.py) carry a leading layer axis: it
    stays unsharded (each scan step takes one layer) and the rest is placed as that layer's
    array would be."""
    def one(keys, leaf):
        name = str(getattr(keys[-1], "key", getattr(keys[-1], "name", keys[-1]))) if keys else ""
        shape = tuple(getattr(leaf, "shape", ()))
        if any(getattr(k, "key", None) == STACKED_GROUP for k in keys) and shape:
            spec = PartitionSpec(None, *leaf_spec(name, shape[1:], mesh))
        else:
            spec = leaf_spec(name, shape, mesh)
        return NamedSharding(mesh, spec)
    return jax.tree_util.tree_map_with_path(one, state)
