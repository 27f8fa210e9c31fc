"""The per-expert compute shared by the single-device layer and every dispatcher.

Legend: N rows entering the grouped matmul (expert-major), D model dim, F expert hidden dim,
2F the gate and up halves side by side, E experts (the local experts inside a dispatcher),
T tokens, K top-k.

This module sits below both `layer.py` and `dispatch/`: the layer sorts rows and calls
`expert_ffn`; a dispatcher moves rows to their device and calls the same `expert_ffn`, so the
grouped-matmul backend and the precision seam (`gmm_for`) are one thing for both.

Two parameter layouts (`MoEConfig.prefuse_moe_weights`, MaxText's key of the same name):
  unfused: experts["w_gate_EDF"], ["w_up_EDF"], ["w_down_EFD"]    three grouped matmuls
  fused:   experts["w_gate_up_ED2F"] = concat([gate, up], -1), ["w_down_EFD"]
           one grouped matmul for gate and up (one pass over the routed rows), then down.
`fuse_expert_weights` / `unfuse_expert_weights` convert any tree holding either layout (model
parameters, optimizer moments, checkpoints' abstract trees) and are exact inverses.

The grouped matmuls' outputs carry the names of `SAVED_NAMES` (`jax.ad_checkpoint.
checkpoint_name`), so a remat policy can keep them: a grouped matmul is a custom call, not a
`dot_general`, and a policy that saves dots does not see it (models/decoder.remat_policy).
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from dropless.config import MoEConfig
from dropless.moe import permute as perm
from dropless.moe.ffn import swiglu
from dropless.moe.router import Routing
from dropless.ops import kernels
from dropless.ops.gmm import grouped_matmul
from dropless.quant.mx_rows import MXRows, travel


def gmm_for(cfg: MoEConfig):
    """The grouped matmul the layer uses: the configured backend, wrapped by its quantization.
    With `align_expert_rows` the unquantized one is told the aligned layout
    (`group_alignment=`); the quantized ones are exact on it as it is (padding rows are zero)."""
    if cfg.gmm_quantization == "none":
        align = max(1, cfg.align_expert_rows)
        return lambda x, w, gs: grouped_matmul(x, w, gs, backend=cfg.gmm_backend,
                                               preferred_element_type=x.dtype,
                                               group_alignment=align)
    if cfg.gmm_quantization == "nvfp4":
        from dropless.quant import nvfp4_quantized_gmm
        return nvfp4_quantized_gmm(cfg)
    from dropless.quant import quantized_gmm  # the one seam for low precision
    return quantized_gmm(cfg)


UNFUSED_KEYS = ("w_gate_EDF", "w_up_EDF")
FUSED_KEY = "w_gate_up_ED2F"
# the names the grouped matmuls' outputs carry: gate and up (or both, fused weights), down
SAVED_NAMES = ("moe_gate", "moe_up", "moe_gate_up", "moe_down")


def check_layout(experts: dict[str, Any], cfg: MoEConfig) -> None:
    """Raise ValueError when the expert parameters' layout disagrees with the config."""
    fused = FUSED_KEY in experts
    if fused != cfg.prefuse_moe_weights or not (fused or all(k in experts for k in UNFUSED_KEYS)):
        have = sorted(experts)
        raise ValueError(f"MoEConfig.prefuse_moe_weights={cfg.prefuse_moe_weights} but the expert "
                         f"parameters are {have}; convert them with dropless.moe."
                         f"{'fuse' if cfg.prefuse_moe_weights else 'unfuse'}_expert_weights")


def gate_up(x_ND: jax.Array, group_sizes_E: jax.Array, experts: dict[str, jax.Array],
            cfg: MoEConfig) -> tuple[jax.Array, jax.Array]:
    """(gate_NF, up_NF) projections: one grouped matmul on the fused weight, else two."""
    dt = jnp.dtype(cfg.dtype)
    gmm = gmm_for(cfg)
    if FUSED_KEY in experts:
        h_N2F = checkpoint_name(gmm(x_ND, experts[FUSED_KEY].astype(dt), group_sizes_E),
                                "moe_gate_up")
        f = h_N2F.shape[-1] // 2
        return h_N2F[:, :f], h_N2F[:, f:]
    return (checkpoint_name(gmm(x_ND, experts["w_gate_EDF"].astype(dt), group_sizes_E),
                            "moe_gate"),
            checkpoint_name(gmm(x_ND, experts["w_up_EDF"].astype(dt), group_sizes_E), "moe_up"))


def expert_ffn(x_ND: jax.Array | MXRows, group_sizes_E: jax.Array,
               experts: dict[str, jax.Array], cfg: MoEConfig) -> jax.Array:
    """SwiGLU per expert over expert-major rows: down(silu(x @ gate) * (x @ up)) -> [N, D].

    `group_sizes_E[e]` consecutive rows belong to expert e; rows past their sum are ignored.
    x_ND may be MXRows (quantized before they moved, `dispatch_quantization="mxfp8"`): the
    gate/up grouped matmuls take them as their quantized lhs. Either parameter layout (see the
    module docstring); raises ValueError when it disagrees with `cfg.prefuse_moe_weights`.
    With `cfg.align_expert_rows` = A > 1 the rows run in the aligned layout
    (`permute.align_segments`: each expert's segment starts at a multiple of A, zero rows
    between) and come back to their sorted positions; the result is the same.
    """
    check_layout(experts, cfg)
    if cfg.align_expert_rows > 1 and not isinstance(x_ND, MXRows):
        lay = perm.align_segments(group_sizes_E, x_ND.shape[0], cfg.align_expert_rows)
        x_PD = perm.to_aligned(x_ND.astype(cfg.dtype), lay)
        y_PD = _expert_ffn(x_PD, lay.group_sizes_E, experts, cfg)
        return perm.from_aligned(y_PD, lay)
    return _expert_ffn(x_ND, group_sizes_E, experts, cfg)


def _expert_ffn(x_ND, group_sizes_E, experts, cfg: MoEConfig) -> jax.Array:
    dt = jnp.dtype(cfg.dtype)
    if not isinstance(x_ND, MXRows):
        x_ND = x_ND.astype(dt)
    if not _plain_swiglu(x_ND, experts, cfg):
        return _unfused_ffn(x_ND, group_sizes_E, experts, cfg)

    def generic(x, w_g, w_u, w_d, gs):
        return _unfused_ffn(x, gs, {"w_gate_EDF": w_g, "w_up_EDF": w_u, "w_down_EFD": w_d}, cfg)
    # the platform's fused FFN where it offers one for this backend and these rows
    return kernels.swiglu_ffn(x_ND, experts["w_gate_EDF"], experts["w_up_EDF"],
                              experts["w_down_EFD"], group_sizes_E, backend=cfg.gmm_backend,
                              generic=generic)


def _unfused_ffn(x_ND, group_sizes_E, experts, cfg: MoEConfig) -> jax.Array:
    dt = jnp.dtype(cfg.dtype)
    gate_NF, up_NF = gate_up(x_ND, group_sizes_E, experts, cfg)
    h_NF = kernels.swiglu_rows(gate_NF, up_NF, dt, backend=cfg.gmm_backend, generic=swiglu)
    return checkpoint_name(gmm_for(cfg)(h_NF, experts["w_down_EFD"].astype(dt), group_sizes_E),
                           "moe_down")


def _plain_swiglu(x_ND, experts, cfg: MoEConfig) -> bool:
    """Whether this FFN is the plain SwiGLU of three grouped matmuls that a platform's fused
    FFN may stand in for (`kernels.swiglu_ffn`): unquantized rows and matmuls, unfused weights."""
    return (not isinstance(x_ND, MXRows) and cfg.gmm_quantization == "none"
            and FUSED_KEY not in experts)


def _concat(a, b):
    if isinstance(a, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(a.shape[:-1] + (2 * a.shape[-1],), a.dtype,
                                    sharding=getattr(a, "sharding", None))
    return (np if isinstance(a, np.ndarray) else jnp).concatenate([a, b], axis=-1)


def _halves(a):
    f = a.shape[-1] // 2
    if isinstance(a, jax.ShapeDtypeStruct):
        half = jax.ShapeDtypeStruct(a.shape[:-1] + (f,), a.dtype,
                                    sharding=getattr(a, "sharding", None))
        return half, half
    return a[..., :f], a[..., f:]


def _has_experts(x) -> bool:
    return isinstance(x, dict) and (FUSED_KEY in x or all(k in x for k in UNFUSED_KEYS))


def _convert(tree: Any, node_fn) -> Any:
    """Apply node_fn to every dict holding expert weights, anywhere in any pytree."""
    return jax.tree_util.tree_map(lambda x: node_fn(x) if _has_experts(x) else x, tree,
                                  is_leaf=_has_experts)


def fuse_expert_weights(tree: Any) -> Any:
    """Every dict holding w_gate_EDF and w_up_EDF gets w_gate_up_ED2F (their concatenation on
    the last axis) instead; everything else is unchanged. Pure; arrays, numpy arrays and
    jax.ShapeDtypeStruct leaves (abstract trees for checkpoint restore) alike."""
    def node(d):
        if not all(k in d for k in UNFUSED_KEYS):
            return d
        out = {k: v for k, v in d.items() if k not in UNFUSED_KEYS}
        out[FUSED_KEY] = _concat(d["w_gate_EDF"], d["w_up_EDF"])
        return out
    return _convert(tree, node)


def unfuse_expert_weights(tree: Any) -> Any:
    """The inverse of fuse_expert_weights: w_gate_up_ED2F -> w_gate_EDF, w_up_EDF (halves)."""
    def node(d):
        if FUSED_KEY not in d:
            return d
        out = {k: v for k, v in d.items() if k != FUSED_KEY}
        out["w_gate_EDF"], out["w_up_EDF"] = _halves(d[FUSED_KEY])
        return out
    return _convert(tree, node)


def convert_expert_weights(tree: Any, *, prefuse: bool) -> Any:
    """`tree` in the layout `prefuse` asks for, whichever layout it is in now."""
    return fuse_expert_weights(tree) if prefuse else unfuse_expert_weights(tree)


def expert_layout(tree: Any) -> bool | None:
    """True if the dicts in `tree` hold the fused weight, False if the unfused pair, None if
    neither (a tree without MoE layers). Dict keys are enough: works on checkpoint metadata."""
    found = [FUSED_KEY in x for x in jax.tree_util.tree_leaves(tree, is_leaf=_has_experts)
             if _has_experts(x)]
    return found[0] if found else None


def quantized_rows(move, x_TD: jax.Array, *args, cfg: MoEConfig):
    """move(x_TD, *args) -> (x_ND, *rest), with the rows quantized once before they move when
    cfg.dispatch_quantization is "mxfp8" (then x_ND is MXRows in cfg.dtype; quant.mx_rows.travel)
    and moved as they are otherwise."""
    if cfg.dispatch_quantization == "none":
        return move(x_TD, *args)
    return travel(move, x_TD.astype(cfg.dtype), *args, rounding=cfg.mx_scale_rounding)


def _permuted(x_TD, order_N, inv_N, *, top_k: int):
    return (jax.tree.map(lambda a: perm.permute(a, order_N, inv_N, top_k), x_TD),)


def dropless_experts(x_TD, routing: Routing, experts, cfg: MoEConfig):
    """Every (token, choice) row goes to its expert: sort, grouped matmuls, unsort, weight, sum.
    With dispatch_quantization="mxfp8" the tokens are quantized before the sort (`quantized_rows`).

    Returns (y_TD, group_sizes_E).
    """
    p = perm.sort_by_expert(routing.ids_TK, cfg.num_experts)
    (x_ND,) = quantized_rows(functools.partial(_permuted, top_k=cfg.top_k), x_TD, p.order_N,
                             p.inv_N, cfg=cfg)
    y_ND = expert_ffn(x_ND, p.group_sizes_E, experts, cfg)
    y_TD = perm.combine(y_ND, routing.weights_TK, p.order_N, p.inv_N)
    return y_TD, p.group_sizes_E
