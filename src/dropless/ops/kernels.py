"""What each platform offers the MoE layer beyond the grouped matmul, asked for by capability.

Legend: T tokens, D model dim, K top-k, N = T*K routed rows, E experts, F expert hidden dim.

The layer asks for a capability and never names a kernel; this module makes the platform
choice, once, when the caller is lowered (`jax.lax.platform_dependent`):

  capability       CPU, float32 (the native library, ops/native)   every other case (XLA)
  sort_by_expert   counting sort (int ids: any dtype of rows)        stable argsort + scatters
  top_k_indices    native top-k ([T, E] float32, k <= E)             jax.lax.top_k
  permute_rows     gather_rows; gradient gather_sum                  jnp.take; gradient a gather
  combine          gather_sum; gradients gather_rows, row_dots       unpermute_rows + einsum
  swiglu_ffn       the fused SwiGLU expert FFN (backend `native`,    the caller's `generic`
                   or `auto` where it picks `native` at all three    (three grouped matmuls and
                   shapes); refused in one line for another          the activation)
                   platform when `native` is asked for by name
  swiglu_rows      bfloat16 rows (the unfused FFN's activation):     the caller's `generic`
                   silu(g) * u in one native pass each way, for       (moe/ffn.py's swiglu)
                   backend `native` or `auto`, as swiglu_ffn

The native forms are taken only in a process whose default backend is the CPU (`native_takes`):
every branch of `platform_dependent` is traced, and tracing the CPU branch asks the library
whether it builds, which a GPU or TPU process must never pay for. Where the library cannot be
built, every capability is XLA's. The native forms give the XLA forms' values (the same indices,
ties and NaNs included; sums in the same float32 order), which are the tests' references.

`order_N[i]` is the flat (token, choice) index j = t*K + k of the row at sorted position i;
`inv_N` is its inverse. Gather's transpose is a scatter-add; because `order` is a permutation
it is written as a gather through `inv` instead (and vice versa), which XLA runs much faster
than a scatter on CPU.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from dropless.ops import native
from dropless.ops.gmm.aliases import canonical_backend
from dropless.ops.gmm.choices import note, shape_key
from dropless.ops.gmm.registry import resolve_backend

# Every index here is in range (a permutation of [0, N), or order // K < T), so the gathers
# clamp instead of jnp.take's default "fill", whose out-of-range select makes XLA:CPU's row
# gather several times slower (the same values bit for bit).
IN_RANGE = "clip"


def native_takes(*arrays) -> bool:
    """Whether the native library takes these arrays: float32 (any for none), in a process whose
    default backend is the CPU (elsewhere the CPU library is never built), and it builds."""
    return (all(a.dtype == jnp.float32 for a in arrays) and jax.default_backend() == "cpu"
            and native.problem() is None)


def _on_cpu_natively(takes: bool, cpu: Callable, generic: Callable, *operands):
    """generic(*operands), or, where `takes`, the platform's choice when lowered: cpu on CPU."""
    if not takes:
        return generic(*operands)
    return jax.lax.platform_dependent(*operands, cpu=cpu, default=generic)


# ---- sort by expert ----

def sort_by_expert(flat_N: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(order_N, inv_N, group_sizes_E) int32 for int32 expert ids flat_N [N]: the stable
    expert-major order, its inverse and the rows per expert (ids outside [0, E) sort by value
    and count as numpy's negative indices do). A counting sort on CPU, XLA's sort elsewhere."""
    return _on_cpu_natively(native_takes(), lambda f: native.sort_by_expert(f, num_experts),
                            lambda f: sort_by_expert_xla(f, num_experts), flat_N)


def sort_by_expert_xla(flat_N: jax.Array, num_experts: int):
    """`sort_by_expert` by XLA's stable sort and scatters."""
    order_N = jnp.argsort(flat_N, stable=True).astype(jnp.int32)
    n = flat_N.shape[0]
    inv_N = jnp.zeros((n,), jnp.int32).at[order_N].set(jnp.arange(n, dtype=jnp.int32))
    sizes_E = jnp.zeros((num_experts,), jnp.int32).at[flat_N].add(1)
    return order_N, inv_N, sizes_E


# ---- top-k indices ----

def top_k_indices(select_TE: jax.Array, k: int) -> jax.Array:
    """[T, K] int32: jax.lax.top_k(select_TE, k)'s indices; the native selection for float32
    [T, E] on CPU (k <= E), XLA's elsewhere. The indices carry no gradient."""
    xla = functools.partial(top_k_indices_xla, k=k)
    if (select_TE.dtype != jnp.float32 or select_TE.ndim != 2 or k > select_TE.shape[-1]
            or not native_takes()):
        return xla(select_TE)
    # (the native call is kept out of differentiation)
    return jax.lax.platform_dependent(jax.lax.stop_gradient(select_TE),
                                      cpu=lambda s: native.top_k_indices(s, k), default=xla)


def top_k_indices_xla(select_TE: jax.Array, k: int) -> jax.Array:
    """`top_k_indices` by jax.lax.top_k."""
    return jax.lax.top_k(select_TE, k)[1].astype(jnp.int32)


# ---- permute: x_ND[i] = x_TD[order_N[i] // K] ----

def permute_rows(x_TD: jax.Array, order_N: jax.Array, inv_N: jax.Array, top_k: int) -> jax.Array:
    """x_ND[i] = x_TD[order_N[i] // K]: each token copied once per choice, expert-major. Its
    gradient is dx_TD[t] = sum_k d_ND[inv_N[t*K + k]] (a gather, summed in float32). The native
    row gathers for float32 on CPU, XLA's gathers elsewhere."""
    return _on_cpu_natively(native_takes(x_TD),
                            lambda x, o, i: _permute_native(x, o, i, top_k),
                            lambda x, o, i: permute_rows_xla(x, o, i, top_k),
                            x_TD, order_N, inv_N)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def permute_rows_xla(x_TD, order_N, inv_N, top_k):
    """`permute_rows` by XLA's gathers (forward and gradient)."""
    return jnp.take(x_TD, order_N // top_k, axis=0, mode=IN_RANGE)


def _permute_xla_fwd(x_TD, order_N, inv_N, top_k):
    return permute_rows_xla(x_TD, order_N, inv_N, top_k), (order_N, inv_N, x_TD.shape[0])


def _permute_xla_bwd(top_k, res, d_ND):
    order_N, inv_N, t = res
    d_TKD = jnp.take(d_ND, inv_N, axis=0, mode=IN_RANGE).reshape(t, top_k, -1)
    return jnp.sum(d_TKD, axis=1, dtype=jnp.float32).astype(d_ND.dtype), None, None


permute_rows_xla.defvjp(_permute_xla_fwd, _permute_xla_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _permute_native(x_TD, order_N, inv_N, top_k):
    return native.gather_rows(x_TD, order_N // top_k)


def _permute_native_fwd(x_TD, order_N, inv_N, top_k):
    return _permute_native(x_TD, order_N, inv_N, top_k), (inv_N, x_TD.shape[0])


def _permute_native_bwd(top_k, res, d_ND):
    inv_N, t = res
    return native.gather_sum(d_ND, inv_N.reshape(t, top_k)), None, None


_permute_native.defvjp(_permute_native_fwd, _permute_native_bwd)


# ---- unpermute and combine: the rows back to their tokens ----

@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def unpermute_rows(y_ND: jax.Array, order_N: jax.Array, inv_N: jax.Array,
                   top_k: int) -> jax.Array:
    """y_TKD[t, k] = y_ND[inv_N[t*K + k]]: sorted rows back to (token, choice) order (XLA's
    gathers on every platform; the gradient gathers through order_N)."""
    return jnp.take(y_ND, inv_N, axis=0, mode=IN_RANGE).reshape(-1, top_k, y_ND.shape[-1])


def _unpermute_fwd(y_ND, order_N, inv_N, top_k):
    return unpermute_rows(y_ND, order_N, inv_N, top_k), (order_N, inv_N)


def _unpermute_bwd(top_k, res, d_TKD):
    order_N, inv_N = res
    d_ND = jnp.take(d_TKD.reshape(-1, d_TKD.shape[-1]), order_N, axis=0, mode=IN_RANGE)
    return d_ND, None, None


unpermute_rows.defvjp(_unpermute_fwd, _unpermute_bwd)


def combine(y_ND: jax.Array, weights_TK: jax.Array, order_N: jax.Array,
            inv_N: jax.Array) -> jax.Array:
    """y_TD[t] = sum_k weights_TK[t, k] * y_ND[inv_N[t*K + k]] -> [T, D] float32. Gradients:
    d_y_ND[i] = w[j] * dy_TD[j // K] and d_weights_TK[t, k] = dot(dy_TD[t], y_ND[inv_N[t*K + k]]),
    with j = order_N[i]. The native gathers when y and the weights are float32 on CPU, XLA's
    (`combine_xla`) elsewhere."""
    return _on_cpu_natively(native_takes(y_ND, weights_TK), _combine_native, combine_xla,
                            y_ND, weights_TK, order_N, inv_N)


def combine_autodiff(y_ND: jax.Array, weights_TK: jax.Array, order_N: jax.Array,
                     inv_N: jax.Array) -> jax.Array:
    """`combine` as its definition, differentiated by jax: unpermute_rows, then the weighted
    sum over the K choices in float32 (the weights rounded to the rows' dtype first). The
    tests' reference for `combine_xla`."""
    y_TKD = unpermute_rows(y_ND, order_N, inv_N, weights_TK.shape[1])
    return jnp.einsum("tkd,tk->td", y_TKD, weights_TK.astype(y_TKD.dtype),
                      preferred_element_type=jnp.float32)


@jax.custom_vjp
def combine_xla(y_ND: jax.Array, weights_TK: jax.Array, order_N: jax.Array,
                inv_N: jax.Array) -> jax.Array:
    """`combine` by XLA: `combine_autodiff`'s values, with a gradient of two gathers that each
    read what they need where it lies: d_y_ND[i] = w[j] * dy_TD[j // K] straight from the
    tokens' cotangents (j = order_N[i]; autodiff writes the weighted [T, K, D] cotangent and
    gathers it again), d_weights from the rows gathered into the dot."""
    return combine_autodiff(y_ND, weights_TK, order_N, inv_N)


def _combine_xla_fwd(y_ND, weights_TK, order_N, inv_N):
    return combine_xla(y_ND, weights_TK, order_N, inv_N), (y_ND, weights_TK, order_N, inv_N)


def _combine_xla_bwd(res, dy_TD):
    y_ND, weights_TK, order_N, inv_N = res
    t, k = weights_TK.shape
    w_N = jnp.take(weights_TK.astype(y_ND.dtype).reshape(-1), order_N, mode=IN_RANGE)
    dy_ND = jnp.take(dy_TD, order_N // k, axis=0, mode=IN_RANGE)
    # each product rounded once to the rows' dtype, as autodiff's transposed dot rounds it
    d_ND = (dy_ND * w_N[:, None].astype(dy_TD.dtype)).astype(y_ND.dtype)
    y_TKD = jnp.take(y_ND, inv_N, axis=0, mode=IN_RANGE).reshape(t, k, -1)
    d_TK = jnp.einsum("td,tkd->tk", dy_TD, y_TKD, preferred_element_type=jnp.float32)
    # rounded to the rows' dtype (the weights' cast), then to the weights' own
    return d_ND, d_TK.astype(y_ND.dtype).astype(weights_TK.dtype), None, None


combine_xla.defvjp(_combine_xla_fwd, _combine_xla_bwd)


@jax.custom_vjp
def _combine_native(y_ND, weights_TK, order_N, inv_N):
    return native.gather_sum(y_ND, inv_N.reshape(weights_TK.shape), weights_TK)


def _combine_native_fwd(y_ND, weights_TK, order_N, inv_N):
    return _combine_native(y_ND, weights_TK, order_N, inv_N), (y_ND, weights_TK, order_N, inv_N)


def _combine_native_bwd(res, dy_TD):
    y_ND, weights_TK, order_N, inv_N = res
    k = weights_TK.shape[1]
    dy_TD = dy_TD.astype(jnp.float32)
    d_ND = native.gather_rows(dy_TD, order_N // k,
                              jnp.take(weights_TK.reshape(-1), order_N, mode=IN_RANGE))
    d_TK = native.row_dots(dy_TD, y_ND, inv_N.reshape(weights_TK.shape))
    return d_ND, d_TK.astype(weights_TK.dtype), None, None


_combine_native.defvjp(_combine_native_fwd, _combine_native_bwd)


# ---- the fused SwiGLU expert FFN ----

FUSED_FFN_BACKENDS = ("auto", "native")   # the grouped-matmul backends it stands in for


def swiglu_ffn(x_ND: jax.Array, w_gate_EDF: jax.Array, w_up_EDF: jax.Array,
               w_down_EFD: jax.Array, group_sizes_E: jax.Array, *, backend: str,
               generic: Callable[..., jax.Array]) -> jax.Array:
    """down(silu(x @ gate) * (x @ up)) per expert over expert-major rows -> [N, D].

    The native library's fused FFN (the activation fused into the products) where the grouped
    matmuls of `backend` would all run `native`: by name (refused in one line when lowered for
    another platform), or `auto` lowered for CPU where `auto` picks `native` at all three shapes
    (the refusals of `auto_scope` included; each choice noted for its `events`). Everywhere
    else, and for rows that are not float32, `generic(x, w_gate, w_up, w_down, group_sizes)`:
    the caller's unfused FFN on `backend`.
    """
    backend = canonical_backend(backend)
    if x_ND.dtype != jnp.float32 or backend not in FUSED_FFN_BACKENDS:
        return generic(x_ND, w_gate_EDF, w_up_EDF, w_down_EFD, group_sizes_E)
    args = (x_ND, w_gate_EDF.astype(jnp.float32), w_up_EDF.astype(jnp.float32),
            w_down_EFD.astype(jnp.float32), group_sizes_E.astype(jnp.int32))
    if backend == "native":
        return native.swiglu_ffn_on_cpu(*args)

    def cpu(x, w_g, w_u, w_d, gs):
        h = jax.ShapeDtypeStruct((x.shape[0], w_g.shape[2]), jnp.float32)
        keys = [shape_key(a, b, gs, jnp.float32) for a, b in ((x, w_g), (x, w_u), (h, w_d))]
        if any(resolve_backend("auto", "cpu", k) != "native" for k in keys):
            return generic(x, w_g, w_u, w_d, gs)
        for k in dict.fromkeys(keys):
            note({"asked": "auto", "platform": "cpu", "backend": "native", "shape": k})
        return native.swiglu_ffn(x, w_g, w_u, w_d, gs)
    return jax.lax.platform_dependent(*args, cpu=cpu, default=generic)


# ---- SwiGLU's activation on bfloat16 rows ----

def swiglu_rows(gate_NF: jax.Array, up_NF: jax.Array, dtype, *, backend: str,
                generic: Callable[..., jax.Array]) -> jax.Array:
    """silu(gate) * up -> [N, F] in `dtype`: the unfused expert FFN's activation.

    The native library's one-pass kernel (csrc/swiglu_bf16.cc, float32 inside, rounded once)
    where gate, up and `dtype` are all bfloat16 and the FFN's grouped matmuls run `backend`
    `native` (refused in one line when lowered for another platform) or `auto` (its CPU branch
    when lowered, in a process whose default backend is the CPU); everywhere else
    `generic(gate, up, dtype)`, the layer's own definition.
    """
    backend = canonical_backend(backend)
    bf16 = jnp.dtype(jnp.bfloat16)
    takes = ({jnp.dtype(gate_NF.dtype), jnp.dtype(up_NF.dtype), jnp.dtype(dtype)} == {bf16}
             and backend in FUSED_FFN_BACKENDS and jax.default_backend() == "cpu"
             and native.problem() is None)
    if not takes:
        return generic(gate_NF, up_NF, dtype)
    if backend == "native":
        return native.swiglu_bf16_on_cpu(gate_NF, up_NF)
    return jax.lax.platform_dependent(gate_NF, up_NF, cpu=native.swiglu_bf16,
                                      default=lambda g, u: generic(g, u, dtype))
