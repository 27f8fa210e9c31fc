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
`sort_by_expert_reference` and `combine_reference` are their XLA forms, the tests' references.
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
    """`combine` by XLA: unpermute, then the weighted sum over the K choices in float32."""
    return kernels.combine_xla(y_ND, weights_TK, order_N, inv_N)
