"""Routing: router logits -> (weights_TK, ids_TK) and the balance losses. All math in float32.

Legend: T tokens, D model dim, E experts, K top-k, B sequences, S tokens per sequence,
Gr expert groups (n_groups), Eg experts per group.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dropless.config import MoEConfig
from dropless.ops import kernels


class Routing(NamedTuple):
    weights_TK: jax.Array   # f32 combine weights (after norm and routed_scaling_factor)
    ids_TK: jax.Array       # int32 chosen experts, distinct per token
    probs_TE: jax.Array     # f32 per-expert probabilities (rows sum to 1): the balance losses'
    #                         input; softmax, or the sigmoid scores normalised per token
    logits_TE: jax.Array    # f32 raw router logits


def router_logits(x_TD: jax.Array, w_DE: jax.Array) -> jax.Array:
    """x @ w in float32 (the router is precision sensitive; DeepSeek-V3 and MaxText keep it f32)."""
    return jnp.dot(x_TD.astype(jnp.float32), w_DE.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)


def _limit_to_groups(select_TE: jax.Array, n_groups: int, topk_groups: int) -> jax.Array:
    """Mask experts outside each token's `topk_groups` best groups to -inf.

    A group's score is the sum of its two best selection scores (DeepSeek-V3), or its best when
    a group holds one expert.
    """
    t, e = select_TE.shape
    grouped = select_TE.reshape(t, n_groups, e // n_groups)
    best = jax.lax.top_k(grouped, min(2, e // n_groups))[0]
    group_score_TGr = jnp.sum(best, axis=-1)
    _, top_groups = jax.lax.top_k(group_score_TGr, topk_groups)
    keep_TGr = jnp.zeros((t, n_groups), bool).at[jnp.arange(t)[:, None], top_groups].set(True)
    keep_TE = jnp.repeat(keep_TGr, e // n_groups, axis=1)
    return jnp.where(keep_TE, select_TE, -jnp.inf)


def top_k_ids(select_TE: jax.Array, k: int) -> jax.Array:
    """[T, K] int32: jax.lax.top_k(select_TE, k)'s indices, by the platform's top-k
    (`kernels.top_k_indices`: the same indices, ties and NaNs included, wherever it runs)."""
    return kernels.top_k_indices(select_TE, k)


def route(logits_TE: jax.Array, bias_E: jax.Array, cfg: MoEConfig) -> Routing:
    """Choose top_k experts per token and their combine weights.

    softmax: probabilities over all experts; weights are the chosen probabilities, renormalised
      to sum to one when `norm_topk_prob` (Mixtral, Qwen3-MoE).
    sigmoid (DeepSeek-V3): independent scores; `bias_E` is added only to pick the experts
      (aux-loss-free balancing); weights come from the unbiased scores, normalised when
      `norm_topk_prob`. Both are then multiplied by `routed_scaling_factor`.
    With n_groups > 1, experts outside the `topk_groups` best groups are never picked.
    """
    logits_TE = logits_TE.astype(jnp.float32)
    if cfg.score_func == "softmax":
        scores_TE = jax.nn.softmax(logits_TE, axis=-1)
        probs_TE = scores_TE
    else:
        scores_TE = jax.nn.sigmoid(logits_TE)
        probs_TE = scores_TE / jnp.sum(scores_TE, axis=-1, keepdims=True)
    select_TE = scores_TE + bias_E.astype(jnp.float32)[None, :]
    if cfg.n_groups > 1:
        select_TE = _limit_to_groups(select_TE, cfg.n_groups, cfg.topk_groups)
    ids_TK = top_k_ids(select_TE, cfg.top_k)
    weights_TK = jnp.take_along_axis(scores_TE, ids_TK, axis=-1)
    if cfg.norm_topk_prob:
        weights_TK = weights_TK / (jnp.sum(weights_TK, axis=-1, keepdims=True) + 1e-20)
    weights_TK = weights_TK * cfg.routed_scaling_factor
    return Routing(weights_TK, ids_TK.astype(jnp.int32), probs_TE, logits_TE)


def expert_counts(ids_TK: jax.Array, num_experts: int) -> jax.Array:
    """[E] int32: how many (token, choice) rows each expert receives."""
    return jnp.zeros((num_experts,), jnp.int32).at[ids_TK.reshape(-1)].add(1)


def load_balance_loss(probs_TE: jax.Array, ids_TK: jax.Array) -> jax.Array:
    """Switch/Mixtral: E * sum_e f_e * P_e; f_e = share of routed rows, P_e = mean probability.

    Equals 1 under perfectly uniform routing and probabilities.
    """
    e = probs_TE.shape[-1]
    f_E = expert_counts(ids_TK, e) / ids_TK.size
    return e * jnp.sum(jax.lax.stop_gradient(f_E) * jnp.mean(probs_TE, axis=0))


def seq_aux_loss(probs_BSE: jax.Array, ids_BSK: jax.Array) -> jax.Array:
    """DeepSeek-V3 sequence-wise balance loss, averaged over sequences.

    Per sequence: f_i = E / (K * S) * (tokens choosing i), P_i = mean normalised score; sum f*P.
    """
    b, s, e = probs_BSE.shape
    k = ids_BSK.shape[-1]
    counts_BE = jax.vmap(lambda ids: expert_counts(ids, e))(ids_BSK)
    f_BE = counts_BE * (e / (k * s))
    p_BE = jnp.mean(probs_BSE, axis=1)
    return jnp.mean(jnp.sum(jax.lax.stop_gradient(f_BE) * p_BE, axis=-1))


def z_loss(logits_TE: jax.Array) -> jax.Array:
    """ST-MoE router z-loss: mean(logsumexp(logits)^2)."""
    return jnp.mean(jnp.square(jax.nn.logsumexp(logits_TE, axis=-1)))


def update_bias(bias_E: jax.Array, counts_E: jax.Array, speed: float) -> jax.Array:
    """DeepSeek-V3 aux-loss-free update: raise under-loaded experts, lower over-loaded ones.

    bias += speed * sign(mean load - load). Applied outside the optimizer, once per step.
    """
    counts_E = counts_E.astype(jnp.float32)
    return bias_E + speed * jnp.sign(jnp.mean(counts_E) - counts_E).astype(bias_E.dtype)
