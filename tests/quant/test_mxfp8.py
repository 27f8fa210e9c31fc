"""MX quantize/dequantize against the plain-NumPy OCP MX reference in _mx_numpy_reference.py.

Legend: R rows, n elements along the blocked axis, nb = ceil(n / 32) blocks.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from tests._support import mx_numpy_reference as ref
from dropless.quant import mxfp8 as mx

ELEMS = ("e4m3", "e5m2")
ROUNDINGS = ("floor", "up")


def codes(a):
    return np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8))


def check_against_reference(x_Rn, elem, rounding):
    q, s = mx.quantize(jnp.asarray(x_Rn, jnp.float32), axis=1, elem=elem, rounding=rounding)
    want_q, want_s = ref.quantize_last_axis(x_Rn, elem, rounding)
    np.testing.assert_array_equal(codes(s), want_s, err_msg="scale codes")
    np.testing.assert_array_equal(codes(q), want_q, err_msg="element codes")
    return q, s


def wide_range(seed, shape, lo=-30, hi=30):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * 2.0 ** rng.integers(lo, hi, shape)).astype(np.float32)


@pytest.mark.parametrize("elem", ELEMS)
@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_random_wide_range_bit_exact(elem, rounding):
    check_against_reference(wide_range(0, (6, 70)), elem, rounding)


def row(values, fill=0.0):
    return np.array(list(values) + [fill] * (32 - len(values)), np.float32)[None]


EDGE_BLOCKS = {
    "zeros": row([]),
    "negative_zero": row([-0.0, 0.0, -0.0]),
    "one_huge_value": row([1e30, 1.0, -1.0, 3.0e25], fill=0.5),
    "at_e4m3_max": row([448.0, -448.0, 1.0]),
    "above_e4m3_max": row([449.0, 464.0, 465.0, 479.0, 500.0, -511.0]),
    "significand_just_above_1.75": row([1.7500001 * 2 ** 5, 1.0]),
    "powers_of_two": row([2.0 ** k for k in range(-20, 12)]),
    "element_subnormals": row([1.0, 2.0 ** -17, 1.5 * 2 ** -17, 2.0 ** -18, 3 * 2.0 ** -18,
                               -2.0 ** -18, 2.0 ** -19, 2.0 ** -12]),
    "float32_subnormal_inputs": row([1e-40, -1e-39, 2.0 ** -126, 1e-45]),
    "tiny_block_clamped_scale": row([2.0 ** -125, 2.0 ** -124, -2.0 ** -126]),
    "float32_max": row([3.4028235e38, -1.0e38, 1.0]),
    "e5m2_range": row([57344.0, 60000.0, 1.0, 2.0 ** -14]),
    "ties": row([256.0, 272.0, 288.0, 304.0, 9.0, 11.0, 13.0, 0.5625, 0.6875]),
}


@pytest.mark.parametrize("name", sorted(EDGE_BLOCKS))
@pytest.mark.parametrize("elem", ELEMS)
@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_edge_blocks_bit_exact(name, elem, rounding):
    check_against_reference(EDGE_BLOCKS[name], elem, rounding)


@pytest.mark.parametrize("values", [[np.inf, 1.0], [-np.inf], [np.nan, 2.0], [1.0, np.nan]])
@pytest.mark.parametrize("elem", ELEMS)
def test_nonfinite_block_is_nan_scaled_and_decodes_to_nan(values, elem):
    x = np.concatenate([row(values), row([1.0, 2.0])], axis=0)  # second row stays finite
    q, s = check_against_reference(x, elem, "floor")
    assert codes(s).tolist() == [[255], [127 - ref.FORMATS[elem]["emax"] + 1]]
    d = np.asarray(mx.dequantize(q, s, axis=1))
    assert np.isnan(d[0]).all() and np.isfinite(d[1]).all()


def test_hand_worked_codes():
    # 500: floor(log2 500) = 8 -> e = 0; 500 saturates to 448 = 1.75 * 2**8 = code 0x7E.
    # 'up': 500 > 448 -> e = 1; 250 rounds (quantum 16 in [128, 256)) to 256 = 0x78.
    q, s = mx.quantize(jnp.asarray(row([500.0, -3e-3])), axis=1)
    assert codes(s)[0, 0] == 127 and codes(q)[0, :2].tolist() == [0x7E, 0x82]
    q, s = mx.quantize(jnp.asarray(row([500.0])), axis=1, rounding="up")
    assert codes(s)[0, 0] == 128 and codes(q)[0, 0] == 0x78
    # a zero block takes the smallest scale 2**-127 (code 0) and zero codes
    q, s = mx.quantize(jnp.zeros((1, 32)), axis=1)
    assert codes(s)[0, 0] == 0 and not codes(q).any()


def test_round_up_never_saturates_and_floor_does():
    x = wide_range(1, (8, 64), -4, 4)
    amax_Rb = np.abs(x).reshape(8, 2, 32).max(axis=-1)
    for rounding, saturates in (("floor", True), ("up", False)):
        _, s = mx.quantize(jnp.asarray(x), axis=1, rounding=rounding)
        scaled_amax = amax_Rb / 2.0 ** (codes(s).astype(np.float64) - 127)
        assert (scaled_amax > 448).any() == saturates
        assert (scaled_amax >= 224).all()  # the scale is never larger than it needs to be


@pytest.mark.parametrize("n", [1, 31, 33, 45, 64])
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_padding_never_leaks_and_axes(n, axis):
    x = wide_range(n, (3, n), -8, 8)
    x = x if axis in (1, -1) else x.T.copy()
    q, s = mx.quantize(jnp.asarray(x), axis=axis)
    assert q.shape == x.shape and q.dtype == jnp.float8_e4m3fn
    assert s.shape[axis] == -(-n // 32) and s.dtype == jnp.float8_e8m0fnu
    xt = x if axis in (1, -1) else x.T
    want_q, want_s = ref.quantize_last_axis(xt)
    got_q, got_s = (codes(q), codes(s)) if axis in (1, -1) else (codes(q).T, codes(s).T)
    np.testing.assert_array_equal(got_q, want_q)
    np.testing.assert_array_equal(got_s, want_s)
    d = np.asarray(mx.dequantize(q, s, axis=axis))
    want_d = ref.dequantize_last_axis(want_q, want_s)
    np.testing.assert_array_equal(d if axis in (1, -1) else d.T, want_d.astype(np.float32))


def test_three_d_middle_axis_matches_reference():
    x = wide_range(5, (2, 40, 3), -6, 6)
    q, s = mx.quantize(jnp.asarray(x), axis=1)
    assert s.shape == (2, 2, 3)
    for b in range(2):
        want_q, want_s = ref.quantize_last_axis(x[b].T)
        np.testing.assert_array_equal(codes(q)[b].T, want_q)
        np.testing.assert_array_equal(codes(s)[b].T, want_s)


def test_bfloat16_input_same_as_its_float32_value():
    x = jnp.asarray(wide_range(2, (4, 64), -10, 10)).astype(jnp.bfloat16)
    q, s = mx.quantize(x, axis=1)
    want_q, want_s = ref.quantize_last_axis(np.asarray(x.astype(jnp.float32)))
    np.testing.assert_array_equal(codes(q), want_q)
    np.testing.assert_array_equal(codes(s), want_s)


def test_jit_equals_eager():
    x = jnp.asarray(wide_range(3, (5, 50)))
    f = jax.jit(lambda x: mx.quantize(x, axis=1, rounding="up"))
    (qj, sj), (qe, se) = f(x), mx.quantize(x, axis=1, rounding="up")
    np.testing.assert_array_equal(codes(qj), codes(qe))
    np.testing.assert_array_equal(codes(sj), codes(se))


def test_fake_quantize_relative_error_is_small():
    x = np.random.default_rng(4).standard_normal((32, 128)).astype(np.float32)
    d = np.asarray(mx.fake_quantize(jnp.asarray(x), axis=1))
    np.testing.assert_array_equal(d, ref.fake_quantize(x, 1).astype(np.float32))
    assert np.linalg.norm(d - x) / np.linalg.norm(x) < 0.05


@settings(max_examples=40, deadline=None)
@given(x=hnp.arrays(np.float32, st.sampled_from([(2, 32), (1, 33), (3, 7)]),
                    elements=st.floats(width=32, allow_nan=True, allow_infinity=True)),
       elem=st.sampled_from(ELEMS), rounding=st.sampled_from(ROUNDINGS))
def test_property_any_float32_bit_exact(x, elem, rounding):
    check_against_reference(x, elem, rounding)


def test_bad_arguments_name_the_value():
    x = jnp.ones((2, 32))
    with pytest.raises(ValueError, match="elem='e3m4'"):
        mx.quantize(x, elem="e3m4")
    with pytest.raises(ValueError, match="rounding='nearest'"):
        mx.quantize(x, rounding="nearest")
    with pytest.raises(ValueError, match="axis=2"):
        mx.quantize(x, axis=2)
    with pytest.raises(ValueError, match="x must be a floating array"):
        mx.quantize(jnp.ones((2, 32), jnp.int32))
    q, s = mx.quantize(x)
    with pytest.raises(ValueError, match="scale shape"):
        mx.dequantize(q, s[:, :0])


def test_reference_decode_round_trips_every_code():
    # the reference's own consistency: every finite code decodes and re-encodes to itself
    for elem in ELEMS:
        for c in range(256):
            v = ref.decode(c, elem)
            if math.isfinite(v) and abs(v) <= ref.FORMATS[elem]["max"]:
                assert ref.encode(v, elem) == c, (elem, c)


@pytest.mark.parametrize("elem", ELEMS)
@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_fake_quantize_fast_path_equals_codes_path(elem, rounding):
    # fake_quantize skips the FP8 codes; it must give dequantize(quantize(x)) bit for bit
    x = np.concatenate([wide_range(6, (6, 64), -40, 40)] +
                       [np.pad(b, ((0, 0), (0, 32))) for b in EDGE_BLOCKS.values()])
    x[0, 3], x[1, 40] = np.inf, np.nan
    q, s = mx.quantize(jnp.asarray(x), axis=1, elem=elem, rounding=rounding)
    slow = np.asarray(mx.dequantize(q, s, axis=1))
    fast = np.asarray(mx.fake_quantize(jnp.asarray(x), 1, elem=elem, rounding=rounding))
    np.testing.assert_array_equal(fast, slow)
    np.testing.assert_array_equal(np.isnan(fast), np.isnan(slow))
