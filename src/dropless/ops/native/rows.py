"""The MoE layer's row movement and selection on the native library (csrc/rows.cc), for the CPU:
the float32 row gathers of the permute and combine (`gather_rows`, `gather_sum`, `row_dots`),
the counting sort of routed rows by expert (`sort_by_expert`) and the router's top-k
(`top_k_indices`), each as plain loops over rows. They give the XLA forms' values (the same
indices, ties and NaNs included; sums in the same float32 order), and do not depend on the GEMM
kernel choice.

Legend: R source rows, D row width, N gathered rows, T tokens, K choices per token, E experts.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dropless.ops.native.load import problem


def _rows(target, out_shape, *args):
    why = problem()   # (the GEMMs' kernel setting does not apply to these)
    if why is not None:
        raise RuntimeError(f"the native row gathers: {why}")
    return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(out_shape, jnp.float32),
                            vmap_method="sequential")(*args)


def _factors(f, shape):
    """A factor operand: f as float32 of `shape`, or the empty [0] meaning every factor is 1."""
    if f is None:
        return jnp.zeros((0,), jnp.float32)
    return jnp.asarray(f, jnp.float32).reshape(shape)


def gather_rows(src_RD, idx_N, scale_N=None):
    """out[i] = scale[i] * src[idx[i]] -> [N, D] float32 (scale None: the rows copied as they
    are). Indices outside [0, R) are clamped to it (jnp.take's mode="clip")."""
    n = idx_N.shape[0]
    return _rows("dropless_gather_rows_f32", (n, src_RD.shape[1]), src_RD.astype(jnp.float32),
                 idx_N.astype(jnp.int32), _factors(scale_N, (n,)))


def gather_sum(src_RD, idx_TK, weights_TK=None):
    """out[t] = sum_k weights[t, k] * src[idx[t, k]] -> [T, D] float32, summed in float32 in
    order k = 0, 1, ... (weights None: every weight 1). Indices clamped as in gather_rows."""
    return _rows("dropless_gather_sum_f32", (idx_TK.shape[0], src_RD.shape[1]),
                 src_RD.astype(jnp.float32), idx_TK.astype(jnp.int32),
                 _factors(weights_TK, idx_TK.shape))


def row_dots(a_TD, b_RD, idx_TK):
    """out[t, k] = dot(a[t], b[idx[t, k]]) -> [T, K] float32 (the gradient of gather_sum's
    weights). Indices clamped as in gather_rows."""
    return _rows("dropless_row_dots_f32", idx_TK.shape, a_TD.astype(jnp.float32),
                 b_RD.astype(jnp.float32), idx_TK.astype(jnp.int32))


def sort_by_expert(ids_N, num_experts: int):
    """(order_N, inv_N, sizes_E) int32 by a counting sort: order_N the stable argsort of ids_N,
    inv_N its inverse, sizes_E[e] the ids equal to e (the XLA form's values, out-of-range ids
    included: they sort by value and count as numpy's negative indices do). Raises RuntimeError
    when the library cannot be built."""
    why = problem()
    if why is not None:
        raise RuntimeError(f"the native sort: {why}")
    n = ids_N.shape[0]
    i32 = jnp.int32
    return jax.ffi.ffi_call("dropless_sort_by_expert",
                            (jax.ShapeDtypeStruct((n,), i32), jax.ShapeDtypeStruct((n,), i32),
                             jax.ShapeDtypeStruct((num_experts,), i32)),
                            vmap_method="sequential")(ids_N.astype(i32))


def top_k_indices(x_TE, k: int):
    """[T, K] int32: the indices jax.lax.top_k(x_TE, k) returns (each row's k largest,
    descending, equal values by lower index, NaN above +inf and -NaN below -inf), for float32
    x [T, E] with k <= E. Raises RuntimeError when the library cannot be built."""
    why = problem()
    if why is not None:
        raise RuntimeError(f"the native top-k: {why}")
    return jax.ffi.ffi_call("dropless_top_k",
                            jax.ShapeDtypeStruct((x_TE.shape[0], k), jnp.int32),
                            vmap_method="sequential")(x_TE.astype(jnp.float32))
