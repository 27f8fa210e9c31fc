"""Start-up timing of the MoE layer's pieces at the run's exact shapes (per device, local
dispatch): one grouped matmul (the gate projection, [N, D] x [E, D, F]), dispatch (sort by
expert + permute rows) and combine (`moe.permute.combine`: the rows back to their tokens,
weighted over the top-k choices), each as the layer runs it.

Legend: T tokens per device per MoE layer, D model dim, F expert hidden, E experts, K top-k,
N = T*K routed rows.
"""
from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp

from dropless.config import TrainConfig
from dropless.moe import permute as perm
from dropless.moe.experts import gmm_for
from dropless.ops.gmm.fallback import compile_auto


def _median_ms(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))   # compile
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def time_moe_kernels(cfg: TrainConfig, *, repeats: int = 5) -> dict[str, float]:
    """{"gmm_ms", "dispatch_ms", "combine_ms", "tokens", "rows"} for one MoE layer forward with
    routing drawn uniformly at random; {} for a dense model."""
    moe = cfg.model.moe
    if moe is None:
        return {}
    t = cfg.per_device_batch_size * cfg.seq_len
    k_x, k_w, k_r = jax.random.split(jax.random.PRNGKey(0), 3)
    dt = jnp.dtype(moe.dtype)
    x_TD = jax.random.normal(k_x, (t, moe.d_model), dt)
    w_EDF = jax.random.normal(k_w, (moe.num_experts, moe.d_model, moe.d_ff), dt)
    ids_TK = jnp.argsort(jax.random.uniform(k_r, (t, moe.num_experts)), axis=-1)[:, :moe.top_k]
    ids_TK = ids_TK.astype(jnp.int32)
    weights_TK = jnp.full((t, moe.top_k), 1.0 / moe.top_k, jnp.float32)

    @jax.jit
    def dispatch(x_TD, ids_TK):
        p = perm.sort_by_expert(ids_TK, moe.num_experts)
        return perm.permute(x_TD, p.order_N, p.inv_N, moe.top_k), p

    x_ND, p = dispatch(x_TD, ids_TK)
    gmm, _ = compile_auto(gmm_for(moe), x_ND, w_EDF, p.group_sizes_E, what="kernel timing")

    @jax.jit
    def combine(y_ND, order_N, inv_N, w_TK):
        return perm.combine(y_ND, w_TK, order_N, inv_N)

    return {"tokens": t, "rows": t * moe.top_k,
            "gmm_ms": _median_ms(gmm, x_ND, w_EDF, p.group_sizes_E, repeats=repeats),
            "dispatch_ms": _median_ms(dispatch, x_TD, ids_TK, repeats=repeats),
            "combine_ms": _median_ms(combine, x_ND, p.order_N, p.inv_N, weights_TK,
                                     repeats=repeats)}
