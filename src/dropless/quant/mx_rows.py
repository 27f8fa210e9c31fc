"""MXFP8 rows that travel: quantized once before they move, consumed by the MXFP8 grouped matmul
as its already-quantized lhs, their gradient carried back in the activation dtype.

Legend: T rows before they move (tokens), R rows after (routed rows), D model dim,
B = ceil(D/32) scale blocks per row.

A row's MX blocks run along D (1x32, the forward matmul's contraction dim), so quantizing a
token once and moving its codes gives exactly the codes the grouped matmul would compute from
the moved activations: quantization commutes with any movement that copies whole rows (gather,
all_to_all, all_gather, expert-major permutation). `travel` does that: it quantizes, lets a
movement function move the codes and scales leafwise, and attaches a gradient slot: zeros in
the activation dtype that the forward never computes (XLA removes them), whose VJP is the
movement's own VJP on the activations. The input gradient of the grouped matmul lands there and
goes back through the transposed movement in the activation dtype, as a combine does; the codes
have no gradient (straight-through, as `fake_quantize` inside the grouped matmul has).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

from dropless.quant import mxfp8 as mx


@functools.partial(jax.tree_util.register_dataclass, data_fields=["q_RD", "scale_RB", "grad_RD"],
                   meta_fields=["dtype", "elem"])
@dataclasses.dataclass(frozen=True)
class MXRows:
    """Rows as MXFP8 blocks along D. A pytree: movement functions map over its arrays.

    Both code arrays are uint8 bit patterns, one byte an element, so that what crosses a
    collective is exactly the FP8 payload: XLA:CPU widens a float8 all-to-all to f16 (2 bytes)
    but moves uint8 as it is, and JAX fills the empty slots of a gather or a ragged exchange
    with zero, which as uint8 is the element +0 and the scale 2**-127 (float8_e8m0fnu cannot
    hold zero: it would become code 255, NaN). An empty row decodes to zeros.
    q_RD: uint8, the `elem` (float8_e4m3fn) element codes. scale_RB: uint8, the E8M0 scale
      codes (value 2**(code - 127)).
    grad_RD: None before the rows move; after, zeros in `dtype` whose cotangent is the rows'
      gradient (see `travel`).
    dtype: the activation dtype the rows came from: the grouped matmul's output and input
      gradient dtype, and what the combine sends back. elem: the element format's name.
    """

    q_RD: jax.Array
    scale_RB: jax.Array
    grad_RD: jax.Array | None
    dtype: Any
    elem: str = "e4m3"

    @property
    def shape(self) -> tuple[int, ...]:
        return self.q_RD.shape

    def values(self, dtype=jnp.float32) -> jax.Array:
        """The rows' MX values q * 2**(code - 127) [R, D] in `dtype` (exact in bf16 and f32)."""
        q = lax.bitcast_convert_type(self.q_RD, mx.elem_format(self.elem).dtype)
        scale = lax.bitcast_convert_type(self.scale_RB, jnp.float8_e8m0fnu)
        return mx.dequantize(q, scale, 1, out_dtype=dtype)


def quantize_rows(x_TD: jax.Array, *, rounding: str = "floor") -> MXRows:
    """x_TD's rows as MXFP8 (E4M3 elements, 1x32 blocks along D, `rounding` of the scales, the
    rounding `quant/mxfp8.py` implements); no gradient flows through the codes."""
    q, scale = mx.quantize(lax.stop_gradient(x_TD), 1, elem="e4m3", rounding=rounding)
    codes = lambda a: lax.bitcast_convert_type(a, jnp.uint8)
    return MXRows(codes(q), codes(scale), None, x_TD.dtype, "e4m3")


def travel(move: Callable[..., tuple], x_TD: jax.Array, *args: Any, rounding: str = "floor"):
    """Quantize x_TD's rows once, move them with `move`, attach their gradient slot.

    move(rows, *args) -> (moved_rows, *rest): a movement of whole rows (each output row a copy
    of one input row or zeros; collectives allowed) that applies the same to an array and, leaf
    by leaf, to MXRows. Returns (moved MXRows with grad_RD set, *rest). The backward runs
    move's VJP in x_TD's dtype (`args` get no gradient from here: whatever of them `rest`
    carries is differentiated through `rest`).
    """
    out = move(quantize_rows(x_TD, rounding=rounding), *args)
    rows = out[0]
    first = lambda x, *a: move(x, *a)[0]
    grad = _gradient_slot(first, rows.shape, x_TD, args)
    return (dataclasses.replace(rows, grad_RD=grad), *out[1:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _gradient_slot(move, shape, x_TD, args):
    """Zeros [shape] in x_TD's dtype; VJP: move's VJP in x_TD at (x_TD, args)."""
    return jnp.zeros(shape, x_TD.dtype)


def _slot_fwd(move, shape, x_TD, args):
    # only x's shape and dtype are kept: move is linear in x, its VJP does not read x's values
    return _gradient_slot(move, shape, x_TD, args), (jnp.zeros((x_TD.shape[0], 0), x_TD.dtype),
                                                     args)


def _slot_bwd(move, shape, res, d_RD):
    shape_T0, args = res
    x0_TD = jnp.zeros((shape_T0.shape[0], shape[1]), shape_T0.dtype)
    _, vjp = jax.vjp(lambda x: move(x, *args), x0_TD)
    (d_TD,) = vjp(d_RD.astype(shape_T0.dtype))
    return d_TD, None


_gradient_slot.defvjp(_slot_fwd, _slot_bwd)
