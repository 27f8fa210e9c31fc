"""Parameter placement: THE table from parameter path to logical axes, for every parameter of
every model (MaxText's logical axis rules); `parallel.mesh.logical_to_spec` maps the logical
axes to mesh axes. Read by the trainer (params, optimizer state, scanned layers), the Hugging
Face loader and the benches. There is no name heuristic: a parameter path the table does not
know is a ValueError naming it.

Legend: V vocabulary, D model dim, F hidden dim (dense FFN, expert or shared expert),
E experts, H heads, G key/value heads, K/N/V per-head dims, Q / L the MLA query / key-value
latent ranks, Ls layers stacked by a scan.

Paths: "/"-joined dict keys, list indices written `*` in the table
("layers/*/moe/experts/w_gate_EDF" is "layers/3/moe/experts/w_gate_EDF" of a model).
A path in a train state matches the table entry it ends with ("params/layers/3/attn/wq_DHK",
"opt_state/0/mu/layers/3/attn/wq_DHK": the optimizer's moments mirror the parameters), the
longest entry first. Each array has at most one FSDP dim, the one its entry names with a
sharded logical axis (the larger of its model / vocabulary / latent dims); the other dims are
None (replicated) or name an axis without mesh axes ("mlp", "heads", "router").
"""
from __future__ import annotations

import re
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from dropless.parallel.mesh import AnyMesh, jax_mesh, logical_to_spec

# The parameter group whose arrays are stacked over layers (scanned layers, models/scan.py).
STACKED_GROUP = "layer_runs"

# One MoE layer's parameters (moe/layer.py). Expert weights split over `expert` (dim E) and
# FSDP over `embed` (dim D: fsdp alone, `expert` being E's; LOGICAL_RULES); the shared experts'
# `embed` over fsdp x expert, as every other matrix's; the router is small and stays replicated.
MOE_LAYER_AXES: dict[str, tuple[str | None, ...]] = {
    "router/w_DE": (None, "router"),
    "router/bias_E": ("router",),
    "experts/w_gate_EDF": ("expert", "embed", "mlp"),
    "experts/w_up_EDF": ("expert", "embed", "mlp"),
    "experts/w_gate_up_ED2F": ("expert", "embed", "mlp"),   # prefuse_moe_weights
    "experts/w_down_EFD": ("expert", "mlp", "embed"),
    # the shared experts: a SwiGLU of width num_shared_experts * d_ff beside the routed ones
    "shared/w_gate_DF": ("embed", "mlp"),
    "shared/w_up_DF": ("embed", "mlp"),
    "shared/w_down_FD": ("mlp", "embed"),
}

# One decoder block (models/decoder.py): attention (MLA or GQA), norms, a dense FFN or MoE.
BLOCK_AXES: dict[str, tuple[str | None, ...]] = {
    "attn_norm_D": (None,),
    "ffn_norm_D": (None,),
    # MLA
    "attn/wq_a_DQ": ("embed", None),
    "attn/q_norm_Q": (None,),
    "attn/wq_b_QHK": ("q_lora", "heads", None),
    "attn/wq_DHK": ("embed", "heads", None),          # MLA without q_lora_rank, and GQA
    "attn/wkv_a_DL": ("embed", None),
    "attn/kv_norm_L": (None,),
    "attn/wkv_b_LHN": ("kv_lora", "heads", None),
    "attn/wo_HVD": ("heads", None, "embed"),
    # GQA (attention="mha")
    "attn/wk_DGK": ("embed", "heads", None),
    "attn/wv_DGK": ("embed", "heads", None),
    "attn/wo_HKD": ("heads", None, "embed"),
    "attn/q_norm_K": (None,),
    "attn/k_norm_K": (None,),
    # the dense FFN (dense layers): its own rule, not the shared expert's
    "ffn/w_gate_DF": ("embed", "mlp"),
    "ffn/w_up_DF": ("embed", "mlp"),
    "ffn/w_down_FD": ("mlp", "embed"),
    **{f"moe/{k}": v for k, v in MOE_LAYER_AXES.items()},
}

# The whole model: embedding, head, layers (unrolled or stacked by a scan), MTP modules.
MODEL_AXES: dict[str, tuple[str | None, ...]] = {
    "embed/w_VD": ("vocab", None),
    "final_norm/w_D": (None,),
    "lm_head/w_DV": (None, "vocab"),
    **{f"layers/*/{k}": v for k, v in BLOCK_AXES.items()},
    **{f"{STACKED_GROUP}/*/{k}": ("layers",) + v for k, v in BLOCK_AXES.items()},
    "mtp/*/hidden_norm_D": (None,),
    "mtp/*/embed_norm_D": (None,),
    "mtp/*/proj_2DD": ("embed", None),
    "mtp/*/out_norm_D": (None,),
    **{f"mtp/*/block/{k}": v for k, v in BLOCK_AXES.items()},
}

# path pattern -> logical axis per dim: every parameter of every model, and of a bare MoE layer
PARAM_AXES: dict[str, tuple[str | None, ...]] = {**MODEL_AXES, **MOE_LAYER_AXES}
# first components of the patterns: a state leaf below none of them is not a parameter
PARAM_ROOTS = frozenset(p.split("/", 1)[0] for p in PARAM_AXES)
_BY_LENGTH = sorted(PARAM_AXES, key=lambda p: -p.count("/"))


def param_path(keys) -> str:
    """A pytree key path as "/"-joined dict keys, attribute names and list indices
    ("layers/3/attn/wq_DHK"; the table writes the index `*`)."""
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
                    for k in keys)


def param_entry(path: str) -> str:
    """The PARAM_AXES pattern for the parameter at `path` (a table path, possibly under a
    container: "params/...", "opt_state/*/mu/..."; integer components count as `*`): the
    longest entry the path ends with. Raises ValueError naming the path when none matches."""
    norm = re.sub(r"(^|/)\d+(?=/|$)", r"\1*", path)
    for pattern in _BY_LENGTH:
        if norm == pattern or norm.endswith("/" + pattern):
            return pattern
    raise ValueError(f"parameter {path!r} has no entry in PARAM_AXES (parallel/sharding.py): "
                     "add its logical axes there")


def param_axes(path: str, ndim: int) -> tuple[str | None, ...]:
    """The logical axes of the parameter at `path` (see `param_entry`). Raises ValueError
    naming the path when no entry matches, or when the entry's rank is not the array's."""
    pattern = param_entry(path)
    axes = PARAM_AXES[pattern]
    if len(axes) != ndim:
        raise ValueError(f"parameter {path!r} has {ndim} dims but PARAM_AXES[{pattern!r}] gives "
                         f"{len(axes)} axes {axes}")
    return axes


def param_spec(path: str, shape: tuple[int, ...], mesh: AnyMesh) -> PartitionSpec:
    """PartitionSpec of the parameter at `path` of `shape` on `mesh` (a mesh axis that does not
    divide its dim is dropped: that dim is replicated, see `logical_to_spec`). Raises
    ValueError as `param_axes`."""
    return logical_to_spec(param_axes(path, len(shape)), mesh, shape=tuple(shape))


def param_specs(params: Any, mesh: AnyMesh) -> Any:
    """A pytree of PartitionSpecs like `params` (a model's or one MoE layer's parameters).
    Raises ValueError naming a path that PARAM_AXES does not know."""
    return jax.tree_util.tree_map_with_path(
        lambda keys, leaf: param_spec(param_path(keys), tuple(leaf.shape), mesh), params)


def param_shardings(params: Any, mesh: AnyMesh) -> Any:
    """NamedShardings for `params` on `mesh` (see PARAM_AXES)."""
    mesh = jax_mesh(mesh)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(params, mesh),
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def shard_params(params: Any, mesh: AnyMesh) -> Any:
    """Place `params` on `mesh` according to PARAM_AXES."""
    return jax.device_put(params, param_shardings(params, mesh))


def state_shardings(state: Any, mesh: AnyMesh | None) -> Any:
    """NamedShardings for a whole train state (params, optimizer state, step, rng) on `mesh`;
    None without a mesh.

    A leaf below a parameter root (`embed`, `layers`, `layer_runs`, `mtp`, ...: PARAM_ROOTS) is
    a parameter or its optimizer moment and is placed by PARAM_AXES (the leading layer dim of
    scanned layers unsharded: each scan step takes one layer); any other leaf (the step, the
    rng key, the optimizer's counters) is replicated. Raises ValueError naming a parameter path
    the table does not know."""
    mesh = jax_mesh(mesh)
    if mesh is None:
        return None

    def one(keys, leaf):
        path = param_path(keys)
        shape = tuple(getattr(leaf, "shape", ()))
        if PARAM_ROOTS.isdisjoint(path.split("/")):
            return NamedSharding(mesh, PartitionSpec())
        return NamedSharding(mesh, param_spec(path, shape, mesh))
    return jax.tree_util.tree_map_with_path(one, state)
