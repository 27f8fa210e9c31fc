"""Slow and naive grouped-matmul backends: the reference loop and the two baselines we beat.

Legend: M rows (sorted by group), K contraction dim, N output dim, G groups, C capacity rows.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


def group_bounds(group_sizes_G: jax.Array, m: int):
    """(start_G, end_G) row ranges of each group, clipped to the m rows that exist."""
    ends_G = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes_G, 0)), m)
    starts_G = jnp.concatenate([jnp.zeros((1,), ends_G.dtype), ends_G[:-1]])
    return starts_G, ends_G


def reference_gmm(lhs_MK, rhs_GKN, group_sizes_G, *, out_dtype):
    """Per-group loop: every group multiplies all rows and keeps its own. G times the work; tests
    only. Differentiated by plain autodiff, so it also checks the hand-written VJPs."""
    m = lhs_MK.shape[0]
    starts_G, ends_G = group_bounds(group_sizes_G, m)
    rows_M = jnp.arange(m)
    out_MN = jnp.zeros((m, rhs_GKN.shape[2]), jnp.float32)
    for g in range(rhs_GKN.shape[0]):
        mine_M = (rows_M >= starts_G[g]) & (rows_M < ends_G[g])
        # select the group's rows on the way in too: autodiff of the output select alone gives
        # drhs[g] = lhs^T @ (dy with other rows zeroed), and a NaN in another row's lhs survives
        # its zero (NaN * 0 = NaN) into every group's gradient
        x_MK = jnp.where(mine_M[:, None], lhs_MK, jnp.zeros_like(lhs_MK))
        y_MN = jnp.dot(x_MK, rhs_GKN[g], preferred_element_type=jnp.float32)
        out_MN = out_MN + jnp.where(mine_M[:, None], y_MN, 0.0)
    return out_MN.astype(out_dtype)


def clipped_group_sizes(group_sizes_G: jax.Array, m: int) -> jax.Array:
    """Sizes under the traced-size rule every backend follows: negative sizes count as zero and
    rows past m do not exist (a group is cut at row m). E.g. [2, -1, 5, 4], m=8 -> [2, 0, 5, 1]."""
    starts_G, ends_G = group_bounds(group_sizes_G, m)
    return (ends_G - starts_G).astype(group_sizes_G.dtype)


def ragged_dot_gmm(lhs_MK, rhs_GKN, group_sizes_G, *, out_dtype):
    """XLA's `jax.lax.ragged_dot`: the right choice on GPU/TPU, a masked dense dot on CPU.

    Sizes are clipped first (`clipped_group_sizes`): XLA's ragged_dot gives other results for
    negative sizes or sizes summing past M, and the backends must agree under jit. On CPU the
    op runs through `_contained_ragged_dot`, which keeps a non-finite weight in its own group's
    rows (see there); on other platforms it is XLA's kernel as is.
    """
    gs_G = clipped_group_sizes(group_sizes_G, lhs_MK.shape[0])
    return jax.lax.platform_dependent(
        lhs_MK, rhs_GKN, gs_G,
        cpu=functools.partial(_contained_ragged_dot, out_dtype=out_dtype),
        default=functools.partial(jax.lax.ragged_dot, preferred_element_type=out_dtype))


# JAX's ragged_dot on CPU multiplies every group's weights with all rows, the other groups' rows
# zeroed, and sums over groups: a NaN or Inf weight of one group then reaches every row
# (NaN * 0 = NaN). `_contained_ragged_dot` hands it finite weights (non-finite entries zeroed)
# and marks NaN exactly the outputs that met one: the rows of that group, in the columns the
# entry feeds (an Inf weight gives NaN there, where a plain matmul could give +-Inf). The cost,
# O(G*K*N + M*N), is small against the op's own O(G*M*K*N) on CPU. The weight gradient does
# not read the weights and is ragged_dot's own.

def _finite_or_zero(x):
    return jnp.where(jnp.isfinite(x), x, jnp.zeros_like(x))


def _mark_nonfinite(y_MX, bad_GX, group_sizes_G):
    """y with NaN in row r, column x where group(r) has bad_GX[group(r), x]; rows past the sum
    and rows of healthy groups untouched."""
    m = y_MX.shape[0]
    _, ends_G = group_bounds(group_sizes_G, m)
    rows_M = jnp.arange(m)
    g_M = jnp.minimum(jnp.searchsorted(ends_G, rows_M, side="right"), ends_G.shape[0] - 1)
    bad_MX = bad_GX[g_M] & (rows_M < ends_G[-1])[:, None]
    return jnp.where(bad_MX, jnp.asarray(jnp.nan, y_MX.dtype), y_MX)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _contained_ragged_dot(lhs_MK, rhs_GKN, group_sizes_G, out_dtype):
    y_MN = jax.lax.ragged_dot(lhs_MK, _finite_or_zero(rhs_GKN), group_sizes_G,
                              preferred_element_type=out_dtype)
    return _mark_nonfinite(y_MN, ~jnp.all(jnp.isfinite(rhs_GKN), axis=1), group_sizes_G)


def _contained_fwd(lhs_MK, rhs_GKN, group_sizes_G, out_dtype):
    return (_contained_ragged_dot(lhs_MK, rhs_GKN, group_sizes_G, out_dtype),
            (lhs_MK, rhs_GKN, group_sizes_G))


def _contained_bwd(out_dtype, res, dy_MN):
    lhs_MK, rhs_GKN, group_sizes_G = res
    w_GKN = _finite_or_zero(rhs_GKN)
    _, pullback = jax.vjp(lambda x, w: jax.lax.ragged_dot(x, w, group_sizes_G,
                                                          preferred_element_type=out_dtype),
                          lhs_MK, w_GKN)
    dlhs_MK, drhs_GKN = pullback(dy_MN.astype(out_dtype))
    dlhs_MK = _mark_nonfinite(dlhs_MK, ~jnp.all(jnp.isfinite(rhs_GKN), axis=2), group_sizes_G)
    return dlhs_MK, drhs_GKN, None


_contained_ragged_dot.defvjp(_contained_fwd, _contained_bwd)


def padding_stats(group_sizes_G, capacity: int) -> dict[str, int]:
    """What the padded baseline executes for these sizes: host-side, for reports and benchmarks."""
    gs = np.maximum(np.asarray(group_sizes_G), 0)
    kept = np.minimum(gs, capacity)
    return {"capacity": int(capacity), "useful_rows": int(gs.sum()),
            "executed_rows": int(capacity * gs.size), "padding_rows": int(capacity * gs.size
                                                                          - kept.sum()),
            "dropped_rows": int((gs - kept).sum())}


def padded_gmm(lhs_MK, rhs_GKN, group_sizes_G, *, out_dtype, capacity: int | None = None):
    """Pad every group to `capacity` rows and run one batched GEMM over [G, C, K].

    The "pad to worst-case capacity" baseline. Exact only when capacity >= the largest group
    (the default, capacity = M, always is, at G times the FLOPs); rows past capacity come out
    as zeros, i.e. dropped. `padding_stats` reports the executed and padding rows.
    """
    m = lhs_MK.shape[0]
    c = m if capacity is None else int(capacity)
    if c <= 0:
        raise ValueError(f"capacity={capacity!r} must be a positive int")
    starts_G, ends_G = group_bounds(group_sizes_G, m)
    slot_GC = starts_G[:, None] + jnp.arange(c)[None, :]
    valid_GC = slot_GC < ends_G[:, None]
    x_GCK = jnp.where(valid_GC[..., None], lhs_MK[jnp.minimum(slot_GC, m - 1)], 0)
    y_GCN = jnp.einsum("gck,gkn->gcn", x_GCK, rhs_GKN, preferred_element_type=jnp.float32)
    rows_M = jnp.arange(m)
    g_M = jnp.minimum(jnp.searchsorted(ends_G, rows_M, side="right"), rhs_GKN.shape[0] - 1)
    pos_M = rows_M - starts_G[g_M]
    keep_M = (rows_M < ends_G[-1]) & (pos_M < c)
    out_MN = jnp.where(keep_M[:, None], y_GCN[g_M, jnp.minimum(pos_M, c - 1)], 0)
    return out_MN.astype(out_dtype)


def loop_gmm(lhs_MK, rhs_GKN, group_sizes_G, *, out_dtype):
    """Host loop over groups, sizes copied to the host: the other naive baseline. Not jittable."""
    if isinstance(group_sizes_G, jax.core.Tracer):
        raise ValueError("grouped_matmul backend 'loop' copies group_sizes to the host and cannot "
                         "run under jax.jit (group_sizes is traced); use 'tiled' or 'ragged_dot'")
    gs = np.asarray(group_sizes_G)
    m, n = lhs_MK.shape[0], rhs_GKN.shape[2]
    pieces, start = [], 0
    for g, size in enumerate(gs.tolist()):
        size = max(min(size, m - start), 0)  # same rule as under jit (see clipped_group_sizes)
        if size > 0:
            pieces.append(jnp.dot(lhs_MK[start:start + size], rhs_GKN[g],
                                  preferred_element_type=jnp.float32).astype(out_dtype))
        start += size
    if start < m:
        pieces.append(jnp.zeros((m - start, n), out_dtype))
    return jnp.concatenate(pieces, axis=0) if pieces else jnp.zeros((m, n), out_dtype)
