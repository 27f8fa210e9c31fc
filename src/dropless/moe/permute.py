"""Sort routed rows into expert-major order and back, with gather-only custom VJPs.

Legend: T tokens, D model dim, K top-k, N = T*K routed rows, E experts.

`order_N[i]` is the flat (token, choice) index j = t*K + k of the row at sorted position i;
`inv_N` is its inverse (inv_N[order_N[i]] = i). Hand-worked example, T=3, K=2, E=3:
  ids_TK = [[2, 0], [0, 1], [2, 1]] -> flat [2, 0, 0, 1, 2, 1]
  stable sort by expert: order_N = [1, 2, 3, 5, 0, 4], group_sizes_E = [2, 2, 2]  (no empty)
  sorted rows are tokens order//K = [0, 1, 1, 2, 0, 2]; inv_N = [4, 0, 1, 2, 5, 3].
Gather's transpose is a scatter-add; because `order` is a permutation, we write it as a gather
through `inv` instead (and vice versa), which XLA runs much faster than a scatter on CPU.

`combine` is the layer's way back: y_TD[t] = sum_k weights_TK[t, k] * y_ND[inv_N[t*K + k]].
The sort, the row gathers of `permute` and `combine` and their gradients are capabilities of
the platform (`dropless.ops.kernels`, which chooses each kernel when the caller is lowered);
`sort_by_expert_reference` (XLA's sort) and `combine_reference` (the definition, differentiated
by jax) are the tests' references.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dropless.ops import kernels


class Permutation(NamedTuple):
    order_N: jax.Array        # int32 flat row index at each sorted position
    inv_N: jax.Array          # int32 sorted position of each flat row
    group_sizes_E: jax.Array  # int32 rows per expert, computed on device


def sort_by_expert(ids_TK: jax.Array, num_experts: int) -> Permutation:
    """Stable expert-major order of the T*K routed rows; nothing leaves the device
    (`kernels.sort_by_expert`: a counting sort on CPU, XLA's sort elsewhere)."""
    flat_N = ids_TK.reshape(-1).astype(jnp.int32)
    return Permutation(*kernels.sort_by_expert(flat_N, num_experts))


def sort_by_expert_reference(flat_N: jax.Array, num_experts: int) -> Permutation:
    """`sort_by_expert` of the flat ids by XLA's stable sort and scatters."""
    return Permutation(*kernels.sort_by_expert_xla(flat_N, num_experts))


def permute(x_TD: jax.Array, order_N: jax.Array, inv_N: jax.Array, top_k: int) -> jax.Array:
    """x_ND[i] = x_TD[order_N[i] // K]: each token copied once per choice, expert-major. Its
    gradient is dx_TD[t] = sum_k d_ND[inv_N[t*K + k]] (a gather, summed in float32)."""
    return kernels.permute_rows(x_TD, order_N, inv_N, top_k)


def unpermute(y_ND: jax.Array, order_N: jax.Array, inv_N: jax.Array, top_k: int) -> jax.Array:
    """y_TKD[t, k] = y_ND[inv_N[t*K + k]]: sorted rows back to (token, choice) order."""
    return kernels.unpermute_rows(y_ND, order_N, inv_N, top_k)


def combine(y_ND: jax.Array, weights_TK: jax.Array, order_N: jax.Array,
            inv_N: jax.Array) -> jax.Array:
    """y_TD[t] = sum_k weights_TK[t, k] * y_ND[inv_N[t*K + k]] -> [T, D] float32: the experts'
    rows back to their tokens, weighted by the router. Gradients: d_y_ND[i] = w[j] * dy_TD[j // K]
    and d_weights_TK[t, k] = dot(dy_TD[t], y_ND[inv_N[t*K + k]]), with j = order_N[i]."""
    return kernels.combine(y_ND, weights_TK, order_N, inv_N)


def combine_reference(y_ND: jax.Array, weights_TK: jax.Array, order_N: jax.Array,
                      inv_N: jax.Array) -> jax.Array:
    """`combine` as its definition (unpermute, then the weighted sum over the K choices in
    float32), differentiated by jax."""
    return kernels.combine_autodiff(y_ND, weights_TK, order_N, inv_N)


class Aligned(NamedTuple):
    """The aligned layout of N expert-major rows: expert e's rows start at padded row
    pstart_e = sum_{e' < e} cdiv(sizes_e', A) * A, followed by zero rows up to the next start.
    P = `aligned_rows(N, E, A)` rows in all (a static bound); the rows past the last segment
    are zero too."""
    src_P: jax.Array          # int32 sorted row at each padded row (0 where valid_P is False)
    valid_P: jax.Array        # bool: the padded row holds a routed row
    dest_N: jax.Array         # int32 padded row of each sorted row (0 where valid_N is False)
    valid_N: jax.Array        # bool: the sorted row belongs to an expert (i < sum(sizes))
    group_sizes_E: jax.Array  # int32 padded sizes cdiv(sizes_e, A) * A, each a multiple of A


def aligned_rows(n: int, num_experts: int, align: int) -> int:
    """P: rows of the aligned layout of n rows over E experts, from shapes alone:
    n + E * (A - 1) (the most a segment grows is A - 1), rounded up to a multiple of A."""
    return -(-(n + num_experts * (align - 1)) // align) * align


def align_segments(group_sizes_E: jax.Array, n: int, align: int) -> Aligned:
    """The aligned layout (`Aligned`) of n sorted rows with these expert sizes, computed on
    device. E.g. sizes [3, 0, 5], A=4, n=8 -> P=20, padded sizes [4, 0, 8],
    src_P = [0 1 2 . | 3 4 5 6 7 . . .| . ...] (dots invalid), dest_N = [0 1 2 4 5 6 7 8]."""
    sizes_E = group_sizes_E.astype(jnp.int32)
    e = sizes_E.shape[0]
    p = aligned_rows(n, e, align)
    ends_E = jnp.cumsum(sizes_E)
    starts_E = ends_E - sizes_E
    psizes_E = (sizes_E + align - 1) // align * align
    pends_E = jnp.cumsum(psizes_E)
    pstarts_E = pends_E - psizes_E
    rows_P = jnp.arange(p, dtype=jnp.int32)
    e_P = jnp.searchsorted(pends_E, rows_P, side="right")
    ec_P = jnp.minimum(e_P, e - 1)
    r_P = rows_P - pstarts_E[ec_P]
    valid_P = (e_P < e) & (r_P < sizes_E[ec_P])
    src_P = jnp.where(valid_P, starts_E[ec_P] + r_P, 0).astype(jnp.int32)
    rows_N = jnp.arange(n, dtype=jnp.int32)
    e_N = jnp.searchsorted(ends_E, rows_N, side="right")
    ec_N = jnp.minimum(e_N, e - 1)
    valid_N = e_N < e
    dest_N = jnp.where(valid_N, pstarts_E[ec_N] + rows_N - starts_E[ec_N], 0).astype(jnp.int32)
    return Aligned(src_P, valid_P, dest_N, valid_N, psizes_E)


def to_aligned(x_ND: jax.Array, lay: Aligned) -> jax.Array:
    """x_PD: the sorted rows in the aligned layout, zero rows between segments. A gather; its
    gradient adds each padded row's cotangent back to its sorted row (padding's: to none)."""
    return jnp.where(lay.valid_P[:, None], x_ND[lay.src_P], jnp.zeros((), x_ND.dtype))


def from_aligned(y_PD: jax.Array, lay: Aligned) -> jax.Array:
    """y_ND: the aligned layout's rows back at their sorted positions (zeros past the sum of
    sizes); padding rows are never read, so they get no gradient."""
    return jnp.where(lay.valid_N[:, None], y_PD[lay.dest_N], jnp.zeros((), y_PD.dtype))
