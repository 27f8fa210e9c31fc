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
For float32 on CPU, in a process whose default backend is the CPU, `permute` and `combine` run
the native row gathers of the `openblas` library (ops/gmm/openblas.py: gather_rows, gather_sum,
row_dots), and `sort_by_expert` its counting sort, chosen at lowering time; elsewhere, or where
that library cannot be built, XLA's gathers and sort (`combine_reference` and
`sort_by_expert_reference` are the XLA forms, and the tests' references for the native ones).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dropless.ops import native as openblas

# Every index here is in range (a permutation of [0, N), or order // K < T), so the gathers
# clamp instead of jnp.take's default "fill", whose out-of-range select made XLA:CPU's row
# gather 2-10x slower (issue 26's profile; the same values bit for bit).
IN_RANGE = "clip"


class Permutation(NamedTuple):
    order_N: jax.Array        # int32 flat row index at each sorted position
    inv_N: jax.Array          # int32 sorted position of each flat row
    group_sizes_E: jax.Array  # int32 rows per expert, computed on device


def sort_by_expert(ids_TK: jax.Array, num_experts: int) -> Permutation:
    """Stable expert-major order of the T*K routed rows; nothing leaves the device. On CPU a
    counting sort (the native library's, where `_native` allows), elsewhere XLA's sort
    (`sort_by_expert_reference`, the tests' reference for the native one)."""
    flat_N = ids_TK.reshape(-1).astype(jnp.int32)
    if not _native():
        return sort_by_expert_reference(flat_N, num_experts)
    return Permutation(*jax.lax.platform_dependent(
        flat_N, cpu=lambda f: openblas.sort_by_expert(f, num_experts),
        default=lambda f: tuple(sort_by_expert_reference(f, num_experts))))


def sort_by_expert_reference(flat_N: jax.Array, num_experts: int) -> Permutation:
    """`sort_by_expert` of the flat ids by XLA's stable sort and scatters."""
    order_N = jnp.argsort(flat_N, stable=True).astype(jnp.int32)
    n = flat_N.shape[0]
    inv_N = jnp.zeros((n,), jnp.int32).at[order_N].set(jnp.arange(n, dtype=jnp.int32))
    sizes_E = jnp.zeros((num_experts,), jnp.int32).at[flat_N].add(1)
    return Permutation(order_N, inv_N, sizes_E)


def _native(*arrays) -> bool:
    """Whether the native library takes these arrays: float32 (any for none), in a process
    whose default backend is the CPU (elsewhere the CPU library is never built for them), and
    the library is built."""
    return (all(a.dtype == jnp.float32 for a in arrays) and jax.default_backend() == "cpu"
            and openblas.problem() is None)


def permute(x_TD: jax.Array, order_N: jax.Array, inv_N: jax.Array, top_k: int) -> jax.Array:
    """x_ND[i] = x_TD[order_N[i] // K]: each token copied once per choice, expert-major. Its
    gradient is dx_TD[t] = sum_k d_ND[inv_N[t*K + k]] (a gather, summed in float32)."""
    if not _native(x_TD):
        return _permute_xla(x_TD, order_N, inv_N, top_k)
    return jax.lax.platform_dependent(
        x_TD, order_N, inv_N, cpu=lambda x, o, i: _permute_native(x, o, i, top_k),
        default=lambda x, o, i: _permute_xla(x, o, i, top_k))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _permute_xla(x_TD, order_N, inv_N, top_k):
    return jnp.take(x_TD, order_N // top_k, axis=0, mode=IN_RANGE)


def _permute_xla_fwd(x_TD, order_N, inv_N, top_k):
    return _permute_xla(x_TD, order_N, inv_N, top_k), (order_N, inv_N, x_TD.shape[0])


def _permute_xla_bwd(top_k, res, d_ND):
    order_N, inv_N, t = res
    d_TKD = jnp.take(d_ND, inv_N, axis=0, mode=IN_RANGE).reshape(t, top_k, -1)
    return jnp.sum(d_TKD, axis=1, dtype=jnp.float32).astype(d_ND.dtype), None, None


_permute_xla.defvjp(_permute_xla_fwd, _permute_xla_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _permute_native(x_TD, order_N, inv_N, top_k):
    return openblas.gather_rows(x_TD, order_N // top_k)


def _permute_native_fwd(x_TD, order_N, inv_N, top_k):
    return _permute_native(x_TD, order_N, inv_N, top_k), (inv_N, x_TD.shape[0])


def _permute_native_bwd(top_k, res, d_ND):
    inv_N, t = res
    return openblas.gather_sum(d_ND, inv_N.reshape(t, top_k)), None, None


_permute_native.defvjp(_permute_native_fwd, _permute_native_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def unpermute(y_ND: jax.Array, order_N: jax.Array, inv_N: jax.Array, top_k: int) -> jax.Array:
    """y_TKD[t, k] = y_ND[inv_N[t*K + k]]: sorted rows back to (token, choice) order."""
    return jnp.take(y_ND, inv_N, axis=0, mode=IN_RANGE).reshape(-1, top_k, y_ND.shape[-1])


def _unpermute_fwd(y_ND, order_N, inv_N, top_k):
    return unpermute(y_ND, order_N, inv_N, top_k), (order_N, inv_N)


def _unpermute_bwd(top_k, res, d_TKD):
    order_N, inv_N = res
    d_ND = jnp.take(d_TKD.reshape(-1, d_TKD.shape[-1]), order_N, axis=0, mode=IN_RANGE)
    return d_ND, None, None


unpermute.defvjp(_unpermute_fwd, _unpermute_bwd)


def combine_reference(y_ND: jax.Array, weights_TK: jax.Array, order_N: jax.Array,
                      inv_N: jax.Array) -> jax.Array:
    """`combine` by XLA: unpermute, then the weighted sum over the K choices in float32."""
    y_TKD = unpermute(y_ND, order_N, inv_N, weights_TK.shape[1])
    return jnp.einsum("tkd,tk->td", y_TKD, weights_TK.astype(y_TKD.dtype),
                      preferred_element_type=jnp.float32)


def combine(y_ND: jax.Array, weights_TK: jax.Array, order_N: jax.Array,
            inv_N: jax.Array) -> jax.Array:
    """y_TD[t] = sum_k weights_TK[t, k] * y_ND[inv_N[t*K + k]] -> [T, D] float32: the experts'
    rows back to their tokens, weighted by the router. Gradients: d_y_ND[i] = w[j] * dy_TD[j // K]
    and d_weights_TK[t, k] = dot(dy_TD[t], y_ND[inv_N[t*K + k]]), with j = order_N[i]."""
    if not _native(y_ND, weights_TK):
        return combine_reference(y_ND, weights_TK, order_N, inv_N)
    return jax.lax.platform_dependent(y_ND, weights_TK, order_N, inv_N, cpu=_combine_native,
                                      default=combine_reference)


@jax.custom_vjp
def _combine_native(y_ND, weights_TK, order_N, inv_N):
    return openblas.gather_sum(y_ND, inv_N.reshape(weights_TK.shape), weights_TK)


def _combine_native_fwd(y_ND, weights_TK, order_N, inv_N):
    return _combine_native(y_ND, weights_TK, order_N, inv_N), (y_ND, weights_TK, order_N, inv_N)


def _combine_native_bwd(res, dy_TD):
    y_ND, weights_TK, order_N, inv_N = res
    k = weights_TK.shape[1]
    dy_TD = dy_TD.astype(jnp.float32)
    d_ND = openblas.gather_rows(dy_TD, order_N // k,
                                jnp.take(weights_TK.reshape(-1), order_N, mode=IN_RANGE))
    d_TK = openblas.row_dots(dy_TD, y_ND, inv_N.reshape(weights_TK.shape))
    return d_ND, d_TK.astype(weights_TK.dtype), None, None


_combine_native.defvjp(_combine_native_fwd, _combine_native_bwd)
