"""Parameter placement: one table from parameter path to logical axes.

Legend: D model dim, E experts, F expert hidden dim.
"""
from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dropless.parallel.mesh import logical_to_spec

# "group/name" -> logical axis per dim. Expert weights split over `expert` (dim E) and FSDP
# over `embed` (dim D); the router and shared experts are small and stay replicated.
PARAM_AXES: dict[str, tuple[str | None, ...]] = {
    "router/w_DE": (None, "router"),
    "router/bias_E": ("router",),
    "experts/w_gate_EDF": ("expert", "embed", "mlp"),
    "experts/w_up_EDF": ("expert", "embed", "mlp"),
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
