"""The native row gathers (rows.py: gather_rows, gather_sum, row_dots on csrc/rows.cc) against
float64 NumPy loops, one row (or one (token, choice)) at a time: at shapes whose work is cut into
several tasks and widths with vector tails (37) or none (384), with and without the optional
factors, clamped out-of-range indices, an empty source (R = 0) and empty outputs, a NaN kept to
the outputs that read its row, under jit and vmap, and the handlers' refusal of bad operands.

Legend: R source rows, D row width, N gathered rows, T tokens, K choices per token.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.ops.native import load
from dropless.ops.native import rows as native_rows


U = 2.0 ** -24   # float32's unit roundoff


@pytest.fixture(scope="module", autouse=True)
def _built():
    assert load.problem() is None   # the suite's environment builds the library


def _clamp(i, r):
    return min(max(int(i), 0), r - 1)


def np_gather_rows(src, idx, scale=None):
    src = np.asarray(src, np.float64)
    r, d = src.shape
    out = np.zeros((len(idx), d))
    for i, j in enumerate(idx):
        if r:
            out[i] = src[_clamp(j, r)] * (1.0 if scale is None else float(scale[i]))
    return out


def np_gather_sum(src, idx, weights=None):
    """(out, mag): the sum in float64 and the sum of the terms' magnitudes (for error bounds)."""
    src = np.asarray(src, np.float64)
    r, d = src.shape
    t, k = idx.shape
    out, mag = np.zeros((t, d)), np.zeros((t, d))
    for tok in range(t):
        for j in range(k):
            if r:
                term = src[_clamp(idx[tok, j], r)] * (1.0 if weights is None
                                                      else float(weights[tok, j]))
                out[tok] += term
                mag[tok] += np.abs(term)
    return out, mag


def np_row_dots(a, b, idx):
    """(out, mag) as np_gather_sum's, one dot product at a time."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    t, k = idx.shape
    r = b.shape[0]
    out, mag = np.zeros((t, k)), np.zeros((t, k))
    for tok in range(t):
        for j in range(k):
            if r:
                row = b[_clamp(idx[tok, j], r)]
                for c in range(a.shape[1]):
                    out[tok, j] += a[tok, c] * row[c]
                    mag[tok, j] += abs(a[tok, c] * row[c])
    return out, mag


def _within(got, want, mag, terms):
    """|got - want| within the float32 recursive-sum bound of `terms` terms (2 * terms * u * mag)."""
    err = np.abs(np.asarray(got, np.float64) - want)
    assert (err <= 2 * terms * U * mag).all(), float((err / np.maximum(mag, 1e-300)).max())


def _indices(rng, r, shape):
    """Random rows of [0, R), with a few out of range on both sides (clamped to 0 and R - 1)."""
    idx = rng.integers(0, max(r, 1), shape).astype(np.int32)
    flat = idx.reshape(-1)
    flat[:: 97] = -1
    flat[5:: 131] = r
    flat[7:: 151] = np.iinfo(np.int32).max
    flat[11:: 163] = np.iinfo(np.int32).min
    return idx


gather_rows = jax.jit(native_rows.gather_rows)


gather_sum = jax.jit(native_rows.gather_sum)


row_dots = jax.jit(native_rows.row_dots)


# N = 3000 rows of 384 floats is 9.2 MB of traffic, cut into 4 tasks a worker; 37 floats is two
# 16-wide vectors and a tail of 5 (the dot's 64-wide blocks: none at 37, six at 384)
@pytest.mark.parametrize("d", [384, 37])
def test_gather_rows_matches_loop(d):
    rng = np.random.default_rng(0)
    r, n = 500, 3000
    src = rng.standard_normal((r, d)).astype(np.float32)
    idx = _indices(rng, r, (n,))
    scale = rng.standard_normal(n).astype(np.float32)
    # a copy is exact, and so is a float32 product rounded once (float64 holds it exactly)
    np.testing.assert_array_equal(gather_rows(src, idx), np_gather_rows(src, idx))
    np.testing.assert_array_equal(gather_rows(src, idx, scale),
                                  np_gather_rows(src, idx, scale).astype(np.float32))


@pytest.mark.parametrize("d, k", [(384, 4), (37, 8), (37, 1)])
def test_gather_sum_matches_loop(d, k):
    rng = np.random.default_rng(1)
    r, t = 700, 2000
    src = rng.standard_normal((r, d)).astype(np.float32)
    idx = _indices(rng, r, (t, k))
    w = rng.standard_normal((t, k)).astype(np.float32)
    want, mag = np_gather_sum(src, idx, w)
    _within(gather_sum(src, idx, w), want, mag, k)
    # unweighted, the sum in order k = 0, 1, ... in float32 is exactly reproducible
    seq = src[np.clip(idx[:, 0], 0, r - 1)].copy()
    for j in range(1, k):
        seq += src[np.clip(idx[:, j], 0, r - 1)]
    np.testing.assert_array_equal(gather_sum(src, idx), seq)
    want, mag = np_gather_sum(src, idx)
    _within(seq, want, mag, k)   # (and that order is the float64 loop's sum)


@pytest.mark.parametrize("d, k", [(384, 4), (37, 8), (37, 1)])
def test_row_dots_matches_loop(d, k):
    rng = np.random.default_rng(2)
    r, t = 300, 1000 if d == 384 else 2000
    a = rng.standard_normal((t, d)).astype(np.float32)
    b = rng.standard_normal((r, d)).astype(np.float32)
    idx = _indices(rng, r, (t, k))
    want, mag = np_row_dots(a, b, idx) if d == 37 else _np_row_dots_fast(a, b, idx)
    _within(row_dots(a, b, idx), want, mag, d)


def _np_row_dots_fast(a, b, idx):
    # the same loop over (token, choice), each dot one NumPy call (384 wide: the element loop
    # above would take tens of seconds)
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    out, mag = np.zeros(idx.shape), np.zeros(idx.shape)
    for tok in range(idx.shape[0]):
        for j in range(idx.shape[1]):
            row = b[_clamp(idx[tok, j], b.shape[0])]
            out[tok, j] = np.dot(a[tok], row)
            mag[tok, j] = np.dot(np.abs(a[tok]), np.abs(row))
    return out, mag


def test_clamping_picks_the_first_and_last_rows():
    src = np.arange(12, dtype=np.float32).reshape(4, 3)
    idx = np.array([-5, 0, 3, 4, 2**31 - 1, -2**31], np.int32)
    assert np.asarray(gather_rows(src, idx))[:, 0].tolist() == [0, 0, 9, 9, 9, 0]
    assert np.asarray(gather_sum(src, idx.reshape(3, 2)))[:, 0].tolist() == [0, 18, 9]
    dots = row_dots(np.ones((3, 3), np.float32), src, idx.reshape(3, 2))
    assert np.asarray(dots).tolist() == [[3, 3], [30, 30], [30, 3]]


def test_empty_source_gives_zeros():
    # R = 0: every index is out of range and there is no row to clamp to
    src = np.zeros((0, 5), np.float32)
    idx = np.array([[0, -1], [3, 0], [1, 1]], np.int32)
    w = np.ones((3, 2), np.float32)
    for out, shape in ((gather_rows(src, idx[:, 0]), (3, 5)),
                       (gather_rows(src, idx[:, 0], w[:, 0]), (3, 5)),
                       (gather_sum(src, idx), (3, 5)), (gather_sum(src, idx, w), (3, 5)),
                       (row_dots(np.ones((3, 5), np.float32), src, idx), (3, 2))):
        out = np.asarray(out)
        assert out.shape == shape and not out.any() and np.isfinite(out).all()


def test_empty_dims_give_empty_or_zero_outputs():
    rng = np.random.default_rng(3)
    src = rng.standard_normal((6, 4)).astype(np.float32)
    # N = 0, T = 0: nothing to write
    assert gather_rows(src, np.zeros((0,), np.int32)).shape == (0, 4)
    assert gather_rows(src, np.zeros((0,), np.int32), np.zeros((0,))).shape == (0, 4)
    assert gather_sum(src, np.zeros((0, 2), np.int32)).shape == (0, 4)
    assert row_dots(np.zeros((0, 4), np.float32), src, np.zeros((0, 2), np.int32)).shape == (0, 2)
    # D = 0: empty rows; a dot over no elements is 0
    empty = np.zeros((6, 0), np.float32)
    idx = np.array([[1, 2], [5, 0], [3, 3]], np.int32)
    assert gather_rows(empty, idx[:, 0]).shape == (3, 0)
    assert gather_sum(empty, idx, np.ones((3, 2))).shape == (3, 0)
    dots = np.asarray(row_dots(np.zeros((3, 0), np.float32), empty, idx))
    assert dots.shape == (3, 2) and not dots.any()
    # K = 0: every sum is empty
    out = np.asarray(gather_sum(src, np.zeros((3, 0), np.int32), np.zeros((3, 0))))
    assert out.shape == (3, 4) and not out.any()
    assert row_dots(np.ones((3, 4), np.float32), src, np.zeros((3, 0), np.int32)).shape == (3, 0)


def test_a_nan_row_reaches_only_the_outputs_that_read_it():
    rng = np.random.default_rng(4)
    r, d, t, k = 50, 37, 400, 3
    src = rng.standard_normal((r, d)).astype(np.float32)
    src[7, 20] = np.nan
    idx = rng.integers(0, r, (t, k)).astype(np.int32)
    reads = idx == 7
    assert reads.any() and not reads.all()
    w = rng.standard_normal((t, k)).astype(np.float32)
    rows = np.asarray(gather_rows(src, idx.reshape(-1), w.reshape(-1)))
    assert np.isnan(rows[reads.reshape(-1), 20]).all()
    assert np.isfinite(np.delete(rows, 20, axis=1)).all()        # only the NaN's column
    assert np.isfinite(rows[~reads.reshape(-1)]).all()
    for out in (gather_sum(src, idx), gather_sum(src, idx, w)):
        out = np.asarray(out)
        assert np.isnan(out[reads.any(1), 20]).all() and np.isfinite(out[~reads.any(1)]).all()
        assert np.isfinite(np.delete(out, 20, axis=1)).all()
    dots = np.asarray(row_dots(rng.standard_normal((t, d)).astype(np.float32), src, idx))
    assert np.isnan(dots[reads]).all() and np.isfinite(dots[~reads]).all()
    # and a NaN in a[t] stays in token t's dots
    a = rng.standard_normal((t, d)).astype(np.float32)
    a[3, 36] = np.nan    # in the 37-wide row's scalar tail
    dots = np.asarray(row_dots(a, np.nan_to_num(src), idx))
    assert np.isnan(dots[3]).all() and np.isfinite(np.delete(dots, 3, axis=0)).all()


def test_vmap_runs_each_item():
    rng = np.random.default_rng(5)
    b, r, d, t, k = 3, 20, 37, 30, 2
    src = rng.standard_normal((b, r, d)).astype(np.float32)
    a = rng.standard_normal((b, t, d)).astype(np.float32)
    idx = _indices(rng, r, (b, t, k))
    w = rng.standard_normal((b, t, k)).astype(np.float32)
    flat, s = idx.reshape(b, -1), w.reshape(b, -1)
    got_rows = jax.vmap(native_rows.gather_rows)(src, flat, s)
    got_shared = jax.jit(jax.vmap(native_rows.gather_rows, in_axes=(None, 0, 0)))(src[0], flat, s)
    got_sum = jax.vmap(native_rows.gather_sum)(src, idx, w)
    got_plain = jax.vmap(native_rows.gather_sum, in_axes=(0, 0, None))(src, idx, None)
    got_dots = jax.jit(jax.vmap(native_rows.row_dots))(a, src, idx)
    for i in range(b):
        np.testing.assert_array_equal(got_rows[i], np_gather_rows(src[i], flat[i], s[i])
                                      .astype(np.float32))
        np.testing.assert_array_equal(got_shared[i], np_gather_rows(src[0], flat[i], s[i])
                                      .astype(np.float32))
        _within(got_sum[i], *np_gather_sum(src[i], idx[i], w[i]), k)
        _within(got_plain[i], *np_gather_sum(src[i], idx[i]), k)
        _within(got_dots[i], *np_row_dots(a[i], src[i], idx[i]), d)


def _ffi(target, out_shape, *args):
    return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(out_shape, jnp.float32),
                            vmap_method="sequential")(*args)


def test_bad_operands_are_refused_naming_the_handler():
    src, idx = jnp.ones((4, 3)), jnp.array([0, 1, 2], jnp.int32)
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match=r"INVALID_ARGUMENT: dropless_gather_rows: scale must be \[0\] or \[N\]"):
        _ffi("dropless_gather_rows_f32", (3, 3), src, idx, jnp.ones((2,)))
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match="dropless_gather_rows: src must be 2-D"):
        _ffi("dropless_gather_rows_f32", (3, 1), jnp.ones((4,)), idx, jnp.ones((3,)))
    with pytest.raises(jax.errors.JaxRuntimeError, match=(
            r"dropless_gather_sum: weights must be \[0\] or \[T, K\]")):
        jax.jit(lambda *a: _ffi("dropless_gather_sum_f32", (3, 3), *a))(
            src, idx.reshape(3, 1), jnp.ones((5,)))
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match="dropless_gather_sum: src and idx must be 2-D"):
        _ffi("dropless_gather_sum_f32", (3, 3), src, idx, jnp.zeros((0,)))
    with pytest.raises(jax.errors.JaxRuntimeError, match=(
            r"dropless_row_dots: a \[T, D\], b \[R, D\] and idx \[T, K\] must agree")):
        _ffi("dropless_row_dots_f32", (3, 1), jnp.ones((3, 4)), src, idx.reshape(3, 1))
    # a dtype other than the bound F32 / S32 is refused by XLA's decoding of the operands
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match="Wrong buffer dtype: expected F32 but got BF16"):
        _ffi("dropless_gather_rows_f32", (3, 3), src.astype(jnp.bfloat16), idx, jnp.zeros((0,)))
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match="Wrong buffer dtype: expected S32 but got F32"):
        _ffi("dropless_gather_rows_f32", (3, 3), src, idx.astype(jnp.float32), jnp.zeros((0,)))
    # the wrappers size the factors themselves: a wrong-length one fails before the call
    with pytest.raises(TypeError):
        native_rows.gather_rows(src, idx, jnp.ones((2,)))


def test_non_float32_operands_are_converted():
    # the wrappers cast to float32 (and the indices to int32) before the call
    rng = np.random.default_rng(6)
    src = rng.standard_normal((8, 5)).astype(np.float32)
    idx = np.array([[1, 7], [0, 3]], np.int64)
    got = native_rows.gather_sum(jnp.asarray(src, jnp.bfloat16), idx, np.ones((2, 2), np.float16))
    assert got.dtype == jnp.float32
    want, mag = np_gather_sum(np.asarray(jnp.asarray(src, jnp.bfloat16), np.float32), idx)
    _within(got, want, mag, 2)
