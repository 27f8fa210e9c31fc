"""The tiled kernel's backward parts on their own (tiled_dlhs, tiled_drhs): exactly the
gradients of tiled_gmm, which test_registry.py checks against a NumPy loop."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.ops.gmm.tiled import tiled_dlhs, tiled_drhs, tiled_gmm
from tests._support.gmm_reference import np_gmm, np_gmm_grads, operands


def test_dlhs_and_drhs_are_the_custom_vjp_parts():
    rng = np.random.default_rng(0)
    sizes = np.array([1, 7, 0, 13, 9], np.int32)     # sums to 30 of M=32: two tail rows
    lhs = jnp.asarray(rng.standard_normal((32, 6)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((5, 6, 4)), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((32, 4)), jnp.float32)
    gs, tiles = jnp.asarray(sizes), (8, 4, 2)
    _, pullback = jax.vjp(lambda a, b: tiled_gmm(a, b, gs, out_dtype=jnp.float32,
                                                 tile_sizes=tiles), lhs, rhs)
    want_dlhs, want_drhs = pullback(dy)
    got_dlhs = tiled_dlhs(dy, rhs, gs, out_dtype=jnp.float32, tile_sizes=tiles)
    got_drhs = tiled_drhs(lhs, dy, gs, out_dtype=jnp.float32, tile_sizes=tiles)
    np.testing.assert_array_equal(got_dlhs, want_dlhs)
    np.testing.assert_array_equal(got_drhs, want_drhs)
    ref_dlhs, ref_drhs = np_gmm_grads(np.asarray(lhs), np.asarray(rhs), sizes, np.asarray(dy))
    np.testing.assert_allclose(got_dlhs, ref_dlhs, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_drhs, ref_drhs, rtol=1e-5, atol=1e-5)


def test_default_plan_covers_each_group_once_and_wastes_under_32_rows():
    # the plan, read back as row ownership, against the group sizes themselves: every row of
    # every group in exactly one tile, and a group's masked tile holds fewer than 32 other rows
    from dropless.ops.gmm.tiled import DEFAULT_TILE_SIZES, plan_tiles
    rng = np.random.default_rng(1)
    m = 4096
    # remainders that sizes 1.15-1.5x apart would cover with 60-125 spare rows (260, 515, 700,
    # 1100 = 1024 + 76), one empty group, and 20 random groups of ~60 rows; 3575 rows of 4096,
    # so the tail rows belong to no group
    sizes = np.concatenate([[260, 515, 0, 700, 1100],
                            np.bincount(rng.integers(0, 20, 1000), minlength=20)]).astype(np.int32)
    ends = np.cumsum(sizes)
    covered = np.zeros(m, np.int32)
    for tc in plan_tiles(jnp.asarray(sizes), m, DEFAULT_TILE_SIZES):
        for t in range(int(tc.count)):
            g, row = int(tc.group_P[t]), int(tc.row_P[t])
            start, end = ends[g] - sizes[g], ends[g]
            own = min(row + tc.size, end) - row
            assert start <= row < end and own > 0
            covered[row:row + own] += 1
            if tc.masked:
                assert tc.size - own < 32 or tc.size <= 64, (g, tc.size, own)
    np.testing.assert_array_equal(covered[:ends[-1]], 1)
    np.testing.assert_array_equal(covered[ends[-1]:], 0)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("m,sizes", [(64, [64]), (60, [60]), (64, [40, 24]), (64, [0, 64, 0])])
def test_16_bit_gradients_where_one_tile_is_the_whole_array(dtype, m, sizes):
    # one group's tile spanning every row let XLA fold the weight gradient's transpose and slice
    # into a bf16 x bf16 -> f32 dot contracting both leading dims, which XLA:CPU cannot run
    # inside a loop (UNIMPLEMENTED at run time); jax 0.10-0.12 alike
    lhs, rhs, gs, dy = operands(m, 16, 8, sizes, dtype)
    tiles = (64, 32, 16, 8)

    @jax.jit    # compiled: run op by op, nothing is folded and it always worked
    def with_grads(a, b, dy):
        out, pullback = jax.vjp(lambda a, b: tiled_gmm(a, b, gs, out_dtype=dtype,
                                                       tile_sizes=tiles), a, b)
        return out, *pullback(dy)
    out, dlhs, drhs = with_grads(lhs, rhs, dy)
    assert out.dtype == dlhs.dtype == drhs.dtype == dtype
    f32 = lambda a: np.asarray(a, np.float32)
    ref_dlhs, ref_drhs = np_gmm_grads(f32(lhs), f32(rhs), sizes, f32(dy))
    tol = dict(rtol=2e-2, atol=2e-2 * 16 ** 0.5)
    np.testing.assert_allclose(f32(out), np_gmm(f32(lhs), f32(rhs), sizes), **tol)
    np.testing.assert_allclose(f32(dlhs), ref_dlhs, **tol)
    np.testing.assert_allclose(f32(drhs), ref_drhs, rtol=2e-2, atol=2e-2 * m ** 0.5)
