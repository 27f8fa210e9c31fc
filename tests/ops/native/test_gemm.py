"""The grouped matmul on the native library (gemm.py, the `native` backend): both GEMM kernels
against a float64 NumPy loop at shapes where the work is cut into several tasks, at the tiled
kernel's tile edges, past one contraction chunk and above the streaming size; NaNs kept to their
group; degenerate dims; the dtype fallback to `tiled` (bf16 on AMX: test_gemm_amx.py); vmap. The
registry-wide tests (tests/ops/gmm/test_registry*.py) run it too.

Legend: M rows, K contraction dim, N output dim, G groups.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.ops import grouped_matmul
from dropless.ops.native import calibrate, choice, gemm, load
from tests._support.gmm_reference import np_gmm, np_gmm_grads
from tests._support.native_kernels import KERNELS


def _problem(seed, m, k, n, sizes):
    """lhs [M, K], rhs [4, K, N], dy [M, N] (float32) and the float64 loop's output, dlhs, drhs."""
    rng = np.random.default_rng(seed)
    lhs = rng.standard_normal((m, k)).astype(np.float32)
    rhs = rng.standard_normal((4, k, n)).astype(np.float32)
    dy = rng.standard_normal((m, n)).astype(np.float32)
    f64 = (lhs.astype(np.float64), rhs.astype(np.float64))
    return lhs, rhs, dy, (np_gmm(*f64, sizes), *np_gmm_grads(*f64, sizes, dy.astype(np.float64)))


# M=1240, K=N=256: a 700-row group is 45.9 M multiply-adds, cut into row tasks (forward, dlhs)
# and tasks of its weight gradient's K rows (drhs), smaller towards the end; 37 is no multiple of
# the row alignment (8); rows 1187.. belong to no group and must come out 0.
@pytest.mark.parametrize("sizes", [[700, 0, 450, 37], [0, 0, 0, 1240], [1, 0, 0, 0],
                                   [300, 300, 300, 300]])
def test_matches_float64_loop_where_work_is_split(fwd_bwd, sizes):
    lhs, rhs, dy, (want, want_dlhs, want_drhs) = _problem(0, 1240, 256, 256, sizes)
    out, dlhs, drhs = fwd_bwd(lhs, rhs, jnp.asarray(sizes, jnp.int32), dy)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(dlhs, want_dlhs, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(drhs, want_drhs, rtol=1e-4, atol=2e-3)
    end = sum(sizes)
    assert (np.asarray(out)[end:] == 0).all() and (np.asarray(dlhs)[end:] == 0).all()
    for g, s in enumerate(sizes):
        if s == 0:
            assert (np.asarray(drhs)[g] == 0).all()


def _kernel_matches_float64_loop(fwd_bwd, only_ran, kernel, seed, k, n, sizes, rows_past):
    """Run the forward and both gradients on `kernel` (forced) for groups of `sizes` and
    `rows_past` rows in none, check that only that kernel ran and that all three equal the
    float64 loop; returns the operands (lhs, rhs, dy) and the results (out, dlhs, drhs)."""
    m = sum(sizes) + rows_past
    lhs, rhs, dy, (want, want_dlhs, want_drhs) = _problem(seed, m, k, n, sizes)
    before = choice.gemm_calls()
    with choice.use_kernel(kernel):
        got = jax.block_until_ready(fwd_bwd(lhs, rhs, jnp.asarray(sizes, jnp.int32), dy))
    assert only_ran(kernel, before)
    out, dlhs, drhs = got
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4 * np.sqrt(k))
    np.testing.assert_allclose(dlhs, want_dlhs, rtol=1e-4, atol=1e-4 * np.sqrt(n))
    np.testing.assert_allclose(drhs, want_drhs, rtol=1e-4, atol=1e-4 * np.sqrt(m))
    return (lhs, rhs, dy), tuple(map(np.asarray, got))


# the two kernels of the native library, each forced (`use_kernel`, read when a call runs; the
# GEMM counters say which ran), at shapes that reach their edges: N with no whole 16-wide panel
# (37) or a panel and a lone vector (80), drhs groups on both sides of its 128-row transpose (100,
# 131), groups past the NT form's 64-row chunk (70) and no multiple of the 6- and 8-row tiles,
# and groups that fill the NT form's
# 1-, 2- and 3-vector passes in part (17, 31, 47, and 49: a whole 32-row pass and a part one); a
# NaN in group 0's rows must not reach another group's rows or weight gradient
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("k, n, sizes", [(1100, 37, [5, 70, 0, 13]), (24, 80, [33, 1, 100, 0]),
                                         (130, 16, [0, 0, 131, 2]), (40, 48, [17, 31, 47, 49])])
def test_both_kernels_match_float64_loop_at_tile_edges(fwd_bwd, only_ran, kernel, k, n, sizes):
    lhs, rhs, dy = _kernel_matches_float64_loop(fwd_bwd, only_ran, kernel, 1, k, n, sizes, 3)[0]
    first = next(g for g, s in enumerate(sizes) if s)
    lhs[0, 0] = np.nan
    with choice.use_kernel(kernel):
        out, dlhs, drhs = map(np.asarray, fwd_bwd(lhs, rhs, jnp.asarray(sizes, jnp.int32), dy))
    assert np.isnan(out[0]).all() and np.isnan(drhs[first][0]).all()
    rows = sizes[first]
    assert np.isfinite(out[rows:]).all() and np.isfinite(dlhs[rows:]).all()
    assert np.isfinite(np.delete(drhs, first, axis=0)).all()


# contractions longer than one of the tiled kernel's chunks (`chunk_rows`: its tiles of C are
# then written, read back and added to): the forward's K and a drhs group's rows (transposed
# first: more than 128 rows) past the forward's chunk, and the NT form's N past its own; a
# group under 128 rows runs drhs on its rows in place; a drhs task whose a^T exceeds the 2^20
# floats a worker transposes at a time. Both kernels, each forced.
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("case", ["nn", "nt", "tn_slices"])
def test_contractions_past_one_chunk_match_float64_loop(fwd_bwd, only_ran, kernel, case):
    # chunks of 64 KiB of B (a 2 MiB L2's half would ask for 32768-row operands in an SSE build)
    with choice.use_chunk_bytes(1 << 16):
        chunk = choice.chunk_rows()
        if case == "nn":
            k, n, sizes = chunk["nn"] + 52, 40, [chunk["nn"] + 102, 0, 47, 0]
        elif case == "tn_slices":   # drhs tasks of 800 of K's rows x 2000 rows: a^T in 2 slices
            k, n, sizes = 2400, 8, [2000, 0, 0, 3]
        else:
            k, n, sizes = 24, chunk["nt"] + 54, [60, 0, 40, 3]
        out, _, drhs = _kernel_matches_float64_loop(fwd_bwd, only_ran, kernel, 4, k, n, sizes,
                                                    2)[1]
    assert not out[sum(sizes):].any() and not drhs[1].any()


def test_auto_runs_the_tiled_kernel_for_every_group_in_avx512_builds(fwd_bwd, only_ran):
    # the build's rule before a calibration (csrc/kernel.h, KernelChoice): its own kernel
    # wherever the build has AVX-512, whatever the group's size; OpenBLAS elsewhere
    sizes = [1000, 30, 0, 200]
    lhs, rhs, dy, _ = _problem(5, sum(sizes), 64, 64, sizes)
    forms = ("kernel_nn", "kernel_nt", "kernel_tn")
    before = choice.gemm_calls()
    with calibrate.use_settings(load.library(), **dict.fromkeys(forms, "build")):
        jax.block_until_ready(fwd_bwd(lhs, rhs, jnp.asarray(sizes, jnp.int32), dy))
    wide = choice.describe()["native_vector_floats"] == 16
    assert only_ran("own" if wide else "openblas", before)


# outputs above the size the library streams (`stream_min_bytes`): drhs's [G, K, N] (a group of
# more rows than one 512-row contraction chunk is written in chunks, not streamed; 0-, 1- and
# 5-row groups) and the forward's [M, N]; N = 144 is two 64-wide panels and a lone vector, 129
# leaves a column summed one by one; both against the float64 loop
@pytest.mark.parametrize("n", [144, 129])
def test_streamed_outputs_match_float64_loop(n):
    limit = choice.stream_min_bytes()
    if limit is None:
        pytest.skip("this build has no streaming stores")
    sizes = [0, 300, 1, 77, 0, 520, 33, 5]
    m, g = sum(sizes), len(sizes)
    k = -(-2 * limit // (4 * g * n))          # drhs: twice the limit
    rng = np.random.default_rng(3)
    lhs, dy = (rng.standard_normal(s).astype(np.float32) for s in ((m, k), (m, n)))
    rhs = rng.standard_normal((g, k, n)).astype(np.float32)
    drhs = np.asarray(jax.jit(gemm.gmm_drhs)(lhs, dy, jnp.asarray(sizes, jnp.int32)))
    assert drhs.nbytes > limit
    want = np_gmm_grads(lhs.astype(np.float64), rhs.astype(np.float64), sizes,
                        dy.astype(np.float64))[1]
    np.testing.assert_allclose(drhs, want, rtol=1e-4, atol=1e-4 * np.sqrt(m))
    rows = -(-2 * limit // (4 * n))           # the forward: twice the limit
    fsizes = [rows // 2, 0, rows - rows // 2 - 3, 3]
    x = rng.standard_normal((rows + 5, 40)).astype(np.float32)
    w = rng.standard_normal((4, 40, n)).astype(np.float32)
    out = np.asarray(jax.jit(gemm.gmm_forward)(x, w, jnp.asarray(fsizes, jnp.int32)))
    assert out.nbytes > limit
    np.testing.assert_allclose(out, np_gmm(x.astype(np.float64), w.astype(np.float64), fsizes),
                               rtol=1e-4, atol=1e-4 * np.sqrt(40))
    assert (out[rows:] == 0).all()


def test_degenerate_dims_give_zeros():
    # K = 0: every product is an empty sum; N = 0 and M = 0: nothing to write
    for m, k, n in ((6, 0, 3), (6, 4, 0), (0, 4, 3)):
        lhs, rhs = jnp.ones((m, k)), jnp.ones((2, k, n))
        gs = jnp.array([min(m, 2), max(m - 2, 0)], jnp.int32)
        out, pullback = jax.vjp(
            lambda a, b: grouped_matmul(a, b, gs, backend="native"), lhs, rhs)
        dlhs, drhs = pullback(jnp.ones_like(out))
        assert out.shape == (m, n) and not np.asarray(out).any()
        assert dlhs.shape == (m, k) and not np.asarray(dlhs).any()
        assert drhs.shape == (2, k, n) and not np.asarray(drhs).any()


def test_operands_no_native_kernel_takes_run_tiled():
    # bf16 -> float32 and float16 always; bf16 -> bf16 where there is no AMX (test_gemm_amx.py)
    rng = np.random.default_rng(1)
    lhs = jnp.asarray(rng.standard_normal((20, 8)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((3, 8, 5)), jnp.bfloat16)
    gs = jnp.array([7, 0, 13], jnp.int32)
    cases = [(lhs, rhs, jnp.float32), (lhs.astype(jnp.float16), rhs.astype(jnp.float16), None)]
    if not load.amx_ready():
        cases.append((lhs, rhs, None))
    for lhs, rhs, pet in cases:
        assert not gemm.supports(lhs, rhs, pet or lhs.dtype)
        got = grouped_matmul(lhs, rhs, gs, backend="native", preferred_element_type=pet)
        want = grouped_matmul(lhs, rhs, gs, backend="tiled", preferred_element_type=pet)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_vmap_runs_each_item():
    rng = np.random.default_rng(2)
    lhs = rng.standard_normal((2, 12, 4)).astype(np.float32)
    rhs = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
    gs = np.array([[4, 4, 4], [0, 12, 0]], np.int32)
    got = jax.vmap(lambda a, b, g: grouped_matmul(a, b, g, backend="native"))(lhs, rhs, gs)
    for i in range(2):
        np.testing.assert_allclose(got[i], np_gmm(lhs[i], rhs[i], gs[i]), rtol=1e-5, atol=1e-5)
