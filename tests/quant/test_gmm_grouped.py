"""Group-aware MX blocks: 32-row blocks restart at every group boundary, codes bit-exact.

Legend: M rows sorted by group, K columns, G groups, B blocks.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tests._support import mx_numpy_reference as ref
from dropless.quant import mxfp8 as mx


def codes(a):
    return np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8))


def data(seed, m, k):
    rng = np.random.default_rng(seed)
    # rows of very different magnitudes, so a block that straddled a boundary would change codes
    return (rng.standard_normal((m, k)) * 2.0 ** rng.integers(-12, 12, (m, 1))).astype(np.float32)


@pytest.mark.parametrize("sizes,m", [([1, 31, 33, 44, 0], 109), ([1, 31, 33, 44, 0], 120),
                                     ([0, 0, 5], 5), ([64, 32], 96), ([0], 7)])
@pytest.mark.parametrize("elem,rounding", [("e4m3", "floor"), ("e5m2", "up")])
def test_codes_and_scales_match_reference(sizes, m, elem, rounding):
    x = data(sum(sizes) + m, m, 3)
    gq = mx.quantize_grouped(jnp.asarray(x), jnp.asarray(sizes, jnp.int32), 0, elem=elem,
                             rounding=rounding)
    want_q, want_row_scale = ref.quantize_grouped_rows(x, sizes, elem, rounding)
    np.testing.assert_array_equal(codes(gq.q), want_q)
    np.testing.assert_array_equal(codes(gq.scale_BK)[np.asarray(gq.block_M)], want_row_scale)
    d = np.asarray(mx.dequantize_grouped(gq))
    np.testing.assert_array_equal(d, ref.fake_quantize_grouped(x, sizes, elem, rounding)
                                  .astype(np.float32))


def test_hand_worked_block_ids():
    # sizes [1, 0, 33], m = 40: row 0 -> block 0; rows 1..32 -> 1; row 33 -> 2; tail 34..39 -> 3
    block_M, nblk = mx.group_blocks(jnp.array([1, 0, 33]), 40)
    assert block_M.tolist() == [0] + [1] * 32 + [2] + [3] * 6
    assert nblk == 2 + 3


_group_blocks = jax.jit(mx.group_blocks, static_argnums=1)


def plain_block_ids(sizes, m):
    """Block ids by walking the rows: a new block at each part start and every 32 rows."""
    ids, nxt = [], 0
    for start, end in ref.grouped_parts(sizes, m):
        for r in range(start, end):
            if (r - start) % 32 == 0:
                nxt += 1
            ids.append(nxt - 1)
    return ids


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 100), min_size=5, max_size=5),
       m=st.sampled_from([33, 100, 390]))
def test_blocks_never_straddle_a_group_boundary(sizes, m):
    # fixed G and a few m keep compilations few; sums above m exercise the clipping too
    block_M, nblk = _group_blocks(jnp.asarray(sizes, jnp.int32), m)
    block_M = np.asarray(block_M)
    assert block_M.tolist() == plain_block_ids(sizes, m)
    assert block_M.max() < nblk
    group_M = np.searchsorted(np.cumsum(sizes), np.arange(m), side="right")
    for b in np.unique(block_M):
        rows = np.flatnonzero(block_M == b)
        assert len(rows) <= 32 and len(set(group_M[rows])) == 1
        assert rows.tolist() == list(range(rows[0], rows[-1] + 1))


def test_sizes_summing_past_m_are_clipped():
    block_M, _ = mx.group_blocks(jnp.array([30, 30]), 40)
    assert block_M.tolist() == [0] * 30 + [1] * 10


def test_jit_with_traced_group_sizes_needs_no_host_sync():
    x = jnp.asarray(data(1, 70, 4))
    f = jax.jit(lambda x, gs: mx.fake_quantize_grouped(x, gs))
    for sizes in ([1, 31, 33, 0], [70, 0, 0, 0], [0, 0, 0, 5]):
        got = np.asarray(f(x, jnp.asarray(sizes, jnp.int32)))
        want = ref.fake_quantize_grouped(np.asarray(x), sizes).astype(np.float32)
        np.testing.assert_array_equal(got, want)
    assert f._cache_size() == 1  # one compilation serves every routing


def test_axis_one_is_the_transpose_of_axis_zero():
    x = data(2, 45, 3)
    sizes = jnp.array([12, 33])
    a = mx.quantize_grouped(jnp.asarray(x), sizes, 0)
    b = mx.quantize_grouped(jnp.asarray(x.T), sizes, 1)
    np.testing.assert_array_equal(codes(a.q), codes(b.q).T)
    np.testing.assert_array_equal(np.asarray(mx.dequantize_grouped(a)),
                                  np.asarray(mx.dequantize_grouped(b)).T)


def test_nonfinite_row_poisons_only_its_own_block():
    x = np.ones((40, 2), np.float32)
    x[3, 0] = np.inf
    d = np.asarray(mx.fake_quantize_grouped(jnp.asarray(x), jnp.array([5, 35])))
    assert np.isnan(d[:5, 0]).all() and np.isfinite(d[5:, 0]).all() and np.isfinite(d[:, 1]).all()


def test_bad_arguments():
    x = jnp.ones((8, 2))
    with pytest.raises(ValueError, match="x must be 2-D"):
        mx.quantize_grouped(jnp.ones((8,)), jnp.array([8]))
    with pytest.raises(ValueError, match="group_sizes must be a 1-D integer"):
        mx.quantize_grouped(x, jnp.array([8.0]))
    with pytest.raises(ValueError, match="axis=2"):
        mx.quantize_grouped(x, jnp.array([8]), axis=2)
    with pytest.raises(ValueError, match="elem='int8'"):
        mx.quantize_grouped(x, jnp.array([8]), elem="int8")


def test_fake_quantize_grouped_fast_path_equals_codes_path():
    x = data(7, 120, 5)
    x[50, 2] = np.nan
    sizes = jnp.array([1, 31, 33, 44, 0])
    for elem, rounding in (("e4m3", "floor"), ("e5m2", "up")):
        slow = mx.dequantize_grouped(mx.quantize_grouped(jnp.asarray(x), sizes, 0, elem=elem,
                                                         rounding=rounding))
        fast = mx.fake_quantize_grouped(jnp.asarray(x), sizes, 0, elem=elem, rounding=rounding)
        np.testing.assert_array_equal(np.asarray(fast), np.asarray(slow))
