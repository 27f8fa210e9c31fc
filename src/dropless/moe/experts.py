"""The per-expert compute shared by the single-device layer and every dispatcher.

Legend: N rows entering the grouped matmul (expert-major), D model dim, F expert hidden dim,
E experts (the local experts inside a dispatcher), T tokens, K top-k.

This module sits below both `layer.py` and `dispatch/`: the layer sorts rows and calls
`expert_ffn`; a dispatcher moves rows to their device and calls the same `expert_ffn`, so the
grouped-matmul backend and the precision seam (`gmm_for`) are one thing for both.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dropless.config import MoEConfig
from dropless.moe import permute as perm
from dropless.moe.router import Routing
from dropless.ops.gmm import grouped_matmul


def gmm_for(cfg: MoEConfig):
    """The grouped matmul the layer uses: the configured backend, wrapped by its quantization."""
    if cfg.gmm_quantization == "none":
        return lambda x, w, gs: grouped_matmul(x, w, gs, backend=cfg.gmm_backend,
                                               preferred_element_type=x.dtype)
    from dropless.quant import quantized_gmm  # the one seam for low precision
    return quantized_gmm(cfg)


def expert_ffn(x_ND: jax.Array, group_sizes_E: jax.Array, experts: dict[str, jax.Array],
               cfg: MoEConfig) -> jax.Array:
    """SwiGLU per expert over expert-major rows: down(silu(x @ gate) * (x @ up)) -> [N, D].

    `group_sizes_E[e]` consecutive rows belong to expert e; rows past their sum are ignored.
    """
    dt = jnp.dtype(cfg.dtype)
    gmm = gmm_for(cfg)
    x_ND = x_ND.astype(dt)
    gate_NF = gmm(x_ND, experts["w_gate_EDF"].astype(dt), group_sizes_E)
    up_NF = gmm(x_ND, experts["w_up_EDF"].astype(dt), group_sizes_E)
    h_NF = (jax.nn.silu(gate_NF.astype(jnp.float32)) * up_NF.astype(jnp.float32)).astype(dt)
    return gmm(h_NF, experts["w_down_EFD"].astype(dt), group_sizes_E)


def dropless_experts(x_TD, routing: Routing, experts, cfg: MoEConfig):
    """Every (token, choice) row goes to its expert: sort, grouped matmuls, unsort, weight, sum.

    Returns (y_TD, group_sizes_E).
    """
    p = perm.sort_by_expert(routing.ids_TK, cfg.num_experts)
    x_ND = perm.permute(x_TD, p.order_N, p.inv_N, cfg.top_k)
    y_ND = expert_ffn(x_ND, p.group_sizes_E, experts, cfg)
    y_TKD = perm.unpermute(y_ND, p.order_N, p.inv_N, cfg.top_k)
    y_TD = jnp.einsum("tkd,tk->td", y_TKD, routing.weights_TK.astype(y_TKD.dtype),
                      preferred_element_type=jnp.float32)
    return y_TD, p.group_sizes_E
