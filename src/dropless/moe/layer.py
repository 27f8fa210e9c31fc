"""The MoE layer, functional: router -> sort by expert -> three grouped matmuls -> combine.

Legend: T tokens, D model dim, F expert hidden dim, E experts, K top-k, N = T*K routed rows,
C capacity rows per expert (capacity baseline only), Fs shared hidden dim.

Parameter names are a public contract:
  params["router"]["w_DE"], params["router"]["bias_E"],
  params["experts"]["w_gate_EDF"], ["w_up_EDF"], ["w_down_EFD"]
    (or, with prefuse_moe_weights, ["w_gate_up_ED2F"] = concat([gate, up], -1), ["w_down_EFD"]),
  params["shared"]["w_gate_DF"], ["w_up_DF"], ["w_down_FD"]   (when num_shared_experts > 0).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from dropless.config import MoEConfig
from dropless.moe import permute as perm
from dropless.moe import router as rt
from dropless.moe.dispatch import expert_parallel_experts
from dropless.moe.experts import check_layout, dropless_experts, fuse_expert_weights
from dropless.moe.ffn import Draw, fan_in_draw, init_swiglu_ffn, swiglu, swiglu_ffn
from dropless.parallel.mesh import AnyMesh

Params = dict[str, dict[str, jax.Array]]


def init_params(key: jax.Array, cfg: MoEConfig, draw: Draw = fan_in_draw) -> Params:
    """Random parameters with the contract's names; weights in `cfg.weight_dtype`, router f32.

    Each weight comes from `draw` (ffn.Draw; default N(0, 1/fan_in), ffn.fan_in_draw) with its
    kind: "router" (fan-in D), "expert" for gate/up and "expert_out" for down (fan-in D and F
    per expert: `draw` sees the [E, in, out] shape), the shared experts "ffn"/"ffn_out"
    (ffn.init_swiglu_ffn). The router bias starts at zero. With `cfg.prefuse_moe_weights` the
    experts are exactly fuse_expert_weights of the unfused ones.
    """
    d, f, e = cfg.d_model, cfg.d_ff, cfg.num_experts
    wdt = jnp.dtype(cfg.weight_dtype)
    k_r, k_g, k_u, k_d, k_s = jax.random.split(key, 5)
    params: Params = {
        "router": {"w_DE": draw(k_r, "router", (d, e), d, jnp.float32),
                   "bias_E": jnp.zeros((e,), jnp.float32)},
        "experts": {"w_gate_EDF": draw(k_g, "expert", (e, d, f), d, wdt),
                    "w_up_EDF": draw(k_u, "expert", (e, d, f), d, wdt),
                    "w_down_EFD": draw(k_d, "expert_out", (e, f, d), f, wdt)},
    }
    if cfg.prefuse_moe_weights:
        params = fuse_expert_weights(params)
    if cfg.num_shared_experts > 0:
        params["shared"] = init_swiglu_ffn(k_s, d, cfg.num_shared_experts * f, wdt, draw)
    return params


def capacity(cfg: MoEConfig, num_tokens: int) -> int:
    """Rows per expert in the capacity baseline: ceil(T * K / E * capacity_factor)."""
    return max(1, math.ceil(num_tokens * cfg.top_k / cfg.num_experts * cfg.capacity_factor))


def capacity_experts(x_TD, routing: rt.Routing, experts, cfg: MoEConfig):
    """The capacity baseline: each expert takes its first C rows (in token order), the rest are
    dropped; one batched GEMM per weight over [E, C, D]. Returns (y_TD, sizes_E, dropped)."""
    t = x_TD.shape[0]
    c = capacity(cfg, t)
    dt = jnp.dtype(cfg.dtype)
    p = perm.sort_by_expert(routing.ids_TK, cfg.num_experts)
    ends_E = jnp.cumsum(p.group_sizes_E)
    starts_E = ends_E - p.group_sizes_E
    slot_EC = starts_E[:, None] + jnp.arange(c)[None, :]
    valid_EC = jnp.arange(c)[None, :] < p.group_sizes_E[:, None]
    n = routing.ids_TK.size
    tok_EC = p.order_N[jnp.minimum(slot_EC, n - 1)] // cfg.top_k
    x_ECD = jnp.where(valid_EC[..., None], x_TD[tok_EC].astype(dt), 0)
    check_layout(experts, cfg)
    if cfg.prefuse_moe_weights:
        gu = jnp.einsum("ecd,edf->ecf", x_ECD, experts["w_gate_up_ED2F"].astype(dt),
                        preferred_element_type=jnp.float32)
        g, u = jnp.split(gu, 2, axis=-1)
    else:
        g = jnp.einsum("ecd,edf->ecf", x_ECD, experts["w_gate_EDF"].astype(dt),
                       preferred_element_type=jnp.float32)
        u = jnp.einsum("ecd,edf->ecf", x_ECD, experts["w_up_EDF"].astype(dt),
                       preferred_element_type=jnp.float32)
    h_ECF = swiglu(g, u, dt)
    y_ECD = jnp.einsum("ecf,efd->ecd", h_ECF, experts["w_down_EFD"].astype(dt),
                       preferred_element_type=jnp.float32)
    # back to (token, choice): sorted position inv -> (expert, slot); dropped rows give zero
    flat_ids_N = routing.ids_TK.reshape(-1)
    pos_N = p.inv_N - starts_E[flat_ids_N]
    kept_N = pos_N < c
    y_ND = jnp.where(kept_N[:, None], y_ECD[flat_ids_N, jnp.minimum(pos_N, c - 1)], 0)
    y_TKD = y_ND.reshape(t, cfg.top_k, -1)
    y_TD = jnp.einsum("tkd,tk->td", y_TKD, routing.weights_TK)
    dropped = jnp.sum(jnp.maximum(p.group_sizes_E - c, 0))
    return y_TD, p.group_sizes_E, dropped


def check_input(x: jax.Array, cfg: MoEConfig) -> None:
    if x.ndim not in (2, 3) or x.shape[-1] != cfg.d_model:
        raise ValueError(f"x must have shape [T, d_model={cfg.d_model}] or [B, S, d_model="
                         f"{cfg.d_model}]; got {x.shape}")


def apply(params: Params, x: jax.Array, cfg: MoEConfig, *, mesh: AnyMesh | None = None
          ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The MoE layer on x of shape [T, D] or [B, S, D]; returns (y like x, aux).

    aux: `tokens_per_expert` [E], `dropped_tokens` (0 when dropless), `load_balance_loss`,
    `seq_aux_loss`, `z_loss`, and `loss` = the coefficient-weighted sum to add to the objective.
    With `mesh` (a mesh with an `expert` axis: a jax.sharding.Mesh, one node, or a
    parallel.NodeMesh, which carries its devices' node size) the experts run expert-parallel.
    """
    check_input(x, cfg)
    x_TD = x.reshape(-1, cfg.d_model)
    logits_TE = rt.router_logits(x_TD, params["router"]["w_DE"])
    routing = rt.route(logits_TE, params["router"]["bias_E"], cfg)
    extra: dict[str, jax.Array] = {}
    if mesh is not None:
        y_TD, sizes_E, extra = expert_parallel_experts(x_TD, routing, params["experts"], cfg,
                                                       mesh)
        dropped = jnp.zeros((), jnp.int32)
    elif cfg.capacity_factor is None:
        y_TD, sizes_E = dropless_experts(x_TD, routing, params["experts"], cfg)
        dropped = jnp.zeros((), jnp.int32)
    else:
        y_TD, sizes_E, dropped = capacity_experts(x_TD, routing, params["experts"], cfg)
    if cfg.num_shared_experts > 0:   # one SwiGLU of width num_shared_experts * d_ff
        y_TD = y_TD + swiglu_ffn(params["shared"], x_TD, cfg.dtype)
    aux = _losses(routing, x.shape, cfg)
    aux.update(tokens_per_expert=sizes_E, dropped_tokens=dropped.astype(jnp.int32), **extra)
    return y_TD.astype(x.dtype).reshape(x.shape), aux


def _losses(routing: rt.Routing, shape, cfg: MoEConfig) -> dict[str, jax.Array]:
    lb = rt.load_balance_loss(routing.probs_TE, routing.ids_TK)
    b, s = (1, shape[0]) if len(shape) == 2 else shape[:2]
    seq = rt.seq_aux_loss(routing.probs_TE.reshape(b, s, -1), routing.ids_TK.reshape(b, s, -1))
    z = rt.z_loss(routing.logits_TE)
    total = cfg.load_balance_coef * lb + cfg.seq_aux_coef * seq + cfg.z_loss_coef * z
    return {"load_balance_loss": lb, "seq_aux_loss": seq, "z_loss": z, "loss": total}
