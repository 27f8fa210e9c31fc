"""MXRows: rows quantized once, moved as uint8 codes, fed to the MXFP8 grouped matmul as its lhs.

Legend: T tokens, M rows sorted by group, K contraction dim, N output dim, G groups.
The oracle is the plain-NumPy OCP MX reference (tests/_support/mx_numpy_reference.py) through
tests/quant/test_gmm.py's dequantize-then-matmul loop, fed the travelled rows' values.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests._support import mx_numpy_reference as ref
from tests.quant.test_gmm import SIZES, operands, ref_gmm_and_grads
from dropless import MoEConfig
from dropless.quant import MXFP8Config, mxfp8_grouped_matmul
from dropless.quant import mxfp8 as mx
from dropless.quant.mx_rows import MXRows, quantize_rows, travel

T = 50


def _gather(rows, src_M):
    """A movement of whole rows: row m of the output is row src_M[m] (T: an empty slot)."""
    return (jax.tree.map(lambda a: jnp.take(a, src_M, axis=0, mode="fill", fill_value=0),
                         rows),)


def _src(m):
    rng = np.random.default_rng(3)
    src = rng.integers(0, T, m).astype(np.int32)
    src[[5, 40]] = T   # two empty slots
    return jnp.asarray(src)


def test_codes_are_quantize_bit_for_bit_and_values_fake_quantize():
    x, _, _ = operands(m=T)
    rows = quantize_rows(jnp.asarray(x))
    q, s = mx.quantize(jnp.asarray(x), 1)
    assert rows.q_RD.dtype == jnp.uint8 and rows.scale_RB.dtype == jnp.uint8
    np.testing.assert_array_equal(rows.q_RD, jax.lax.bitcast_convert_type(q, jnp.uint8))
    np.testing.assert_array_equal(rows.scale_RB, jax.lax.bitcast_convert_type(s, jnp.uint8))
    np.testing.assert_array_equal(rows.values(), ref.fake_quantize(x, 1, "e4m3", "floor"))


@jax.jit
def _wire(x, w, gs, dy, src_M):
    """Forward and VJP (x, w) of gather-then-gmm with the rows travelling as MXRows."""
    def f(x, w):
        (rows,) = travel(_gather, x, src_M)
        return mxfp8_grouped_matmul(rows, w, gs)
    out, pullback = jax.vjp(f, x, w)
    return (out, *pullback(dy))


def test_travelled_rows_through_the_gmm_match_the_numpy_oracle():
    """Forward: the gathered rows' codes as the lhs; dx: the gather's transpose of the gmm's
    input gradient (blocked as ever); dw: the travelled values re-blocked per group."""
    x, w, dy = operands()
    x_T = x[:T]
    src = _src(x.shape[0])
    out, dx, dw = (np.asarray(a, np.float64) for a in _wire(
        jnp.asarray(x_T), jnp.asarray(w), jnp.asarray(SIZES, jnp.int32), jnp.asarray(dy), src))
    moved = np.where((np.asarray(src) < T)[:, None], x_T[np.minimum(np.asarray(src), T - 1)], 0)
    xq = ref.fake_quantize(moved, 1, "e4m3", "floor")     # the values that travelled
    want_out, want_dx_M, want_dw = ref_gmm_and_grads(xq, w, dy, SIZES)
    want_dx = np.zeros(x_T.shape)
    np.add.at(want_dx, np.asarray(src)[np.asarray(src) < T], want_dx_M[np.asarray(src) < T])
    valid = sum(SIZES)
    np.testing.assert_allclose(out[:valid], want_out[:valid], rtol=1e-6, atol=1e-5)
    np.testing.assert_array_equal(out[valid:], 0)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(dw, want_dw, rtol=1e-5, atol=1e-4)


def test_forward_equals_the_bf16_lhs_path_bitwise():
    """Quantizing before the move changes nothing in the forward: the gmm on the moved f32 rows
    quantizes them to exactly the codes that travelled."""
    x, w, dy = operands()
    src = _src(x.shape[0])
    gs = jnp.asarray(SIZES, jnp.int32)
    out = _wire(jnp.asarray(x[:T]), jnp.asarray(w), gs, jnp.asarray(dy), src)[0]
    (moved,) = _gather(jnp.asarray(x[:T]), src)
    np.testing.assert_array_equal(out, mxfp8_grouped_matmul(moved, jnp.asarray(w), gs))


def test_rows_without_a_gradient_slot_or_of_another_format_are_refused():
    x, w, _ = operands()
    gs = jnp.asarray(SIZES, jnp.int32)
    rows = quantize_rows(jnp.asarray(x))
    with pytest.raises(ValueError, match="gradient slot"):
        mxfp8_grouped_matmul(rows, jnp.asarray(w), gs)
    with pytest.raises(ValueError, match="'e5m2' codes"):
        mxfp8_grouped_matmul(rows, jnp.asarray(w), gs, config=MXFP8Config(fwd_elem="e5m2"))


def test_dispatch_quantization_needs_the_mxfp8_gmm():
    kw = dict(num_experts=4, top_k=2, d_model=8, d_ff=8)
    with pytest.raises(ValueError, match=r"MoEConfig.dispatch_quantization='mxfp8' needs "
                                         r"gmm_quantization='mxfp8' \(got 'none'\)"):
        MoEConfig(**kw, dispatch_quantization="mxfp8")
    with pytest.raises(ValueError, match=r"dispatch_quantization='fp8' must be one of"):
        MoEConfig(**kw, gmm_quantization="mxfp8", dispatch_quantization="fp8")
    assert MoEConfig(**kw, gmm_quantization="mxfp8",
                     dispatch_quantization="mxfp8").dispatch_quantization == "mxfp8"


def test_an_mxrows_pytree_maps_over_both_code_arrays_only():
    rows = quantize_rows(jnp.ones((4, 40)))
    assert isinstance(rows, MXRows) and rows.shape == (4, 40) and rows.dtype == jnp.float32
    leaves = jax.tree.leaves(rows)
    assert [a.shape for a in leaves] == [(4, 40), (4, 2)]   # grad_RD is None before moving
