"""`pallas_gpu` on aligned segments (`group_alignment`), in Pallas interpret mode on CPU.

Legend: M rows (sorted by group), K contraction dim, N output dim, G groups, A the alignment
(every group size a multiple of it), T row tiles of the aligned grid, W work items.

With A a multiple of the row block bm the forward and dlhs run a grid of cdiv(M, bm) plain row
tiles and drhs loops over whole bm-row slices (pallas_gpu.py); these tests check that grid
against the float64 per-group loop (`tests/_support/gmm_reference.py`) in fwd, dlhs and drhs,
with empty groups, one group taking every row, zero padding rows inside the segments (the
layout `MoEConfig.align_expert_rows` builds), rows past the sum and M not a multiple of bm;
that it is the same tiles as the work list (bitwise equal), that the grid launched is
`pallas_plan`'s tile model and smaller than the work list's, and that an alignment the row
block does not divide keeps the work list.
"""
import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.ops import grouped_matmul
from dropless.ops.gmm import registry
from dropless.ops.gpu import pallas_plan
from dropless.ops.gpu.pallas_gpu import tile_groups
from tests._support.gmm_reference import np_gmm, np_gmm_grads, operands

SMALL = dict(block_m=16, block_k=16, block_n=16)


def padded_operands(m, k, n, sizes, used, dtype=jnp.float32, seed=0):
    """Operands in the aligned layout: group g holds sizes[g] rows (a multiple of A), of which
    the first used[g] are routed rows and the rest zero padding (lhs and dy zero there)."""
    lhs, rhs, gs, dy = operands(m, k, n, sizes, dtype, seed)
    keep = np.zeros(m, bool)
    start = 0
    for s, u in zip(sizes, used):
        keep[start:start + u] = True
        start += s
    keep[start:] = True      # rows past the sum: not zero, they must come out zero anyway
    z = jnp.asarray(keep)[:, None]
    return jnp.where(z, lhs, 0), rhs, gs, jnp.where(z, dy, 0)


def fwd_bwd(lhs, rhs, gs, dy, **opts):
    f = lambda a, b: grouped_matmul(a, b, gs, backend="pallas_gpu", **opts)
    out, vjp = jax.vjp(f, lhs, rhs)
    return (out,) + vjp(dy)


def kernel_grids(fn, *args) -> dict:
    """{pallas_call name: grid} of every Pallas kernel `fn` traces (interpret mode on CPU)."""
    grids = {}

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                prm = eqn.params   # the name's key differs between jax releases
                name = prm["name"] if "name" in prm else prm["name_and_src_info"].name
                grids[name] = prm["grid_mapping"].grid
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)
    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return grids


def test_tile_groups_hand_worked():
    # sizes [4, 0, 8], bm=4, m=16: tiles at rows 0, 4, 8, 12 -> g0, g2, g2, the zero tail (3)
    assert tile_groups(jnp.array([4, 0, 8]), 16, 4).tolist() == [0, 2, 2, 3]
    # m=18 is not a multiple of bm: a fifth tile (rows 16-19) in the tail
    assert tile_groups(jnp.array([4, 0, 8]), 18, 4).tolist() == [0, 2, 2, 3, 3]


# (M, sizes (multiples of A), used rows per group, K, N, A): empty groups, padding rows inside
# the segments, rows past the sum, M not a multiple of bm, K and N not multiples of the blocks
CASES = {
    "empty_groups_and_padding": (104, [32, 0, 16, 0, 32], [17, 0, 16, 0, 1], 20, 36, 16),
    "one_group_takes_all": (64, [0, 64, 0], [0, 64, 0], 24, 40, 32),
    "zero_tail_past_m": (90, [16, 48, 0], [3, 40, 0], 16, 16, 16),
}


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_aligned_grid_against_the_per_group_loop(name, dtype):
    m, sizes, used, k, n, a = CASES[name]
    lhs, rhs, gs, dy = padded_operands(m, k, n, sizes, used, jnp.dtype(dtype), seed=len(name))
    opts = dict(SMALL, group_alignment=a)
    grids = kernel_grids(lambda *x: fwd_bwd(*x, **opts), lhs, rhs, gs, dy)
    assert set(grids) == {"dropless_gmm_aligned", "dropless_gmm_dlhs_aligned",
                          "dropless_gmm_drhs"}      # the aligned grid ran
    out, dl, dr = jax.jit(lambda *x: fwd_bwd(*x, **opts))(lhs, rhs, gs, dy)
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == "float32" else dict(rtol=2e-2, atol=1e-1)
    np.testing.assert_allclose(np.asarray(out, np.float32), np_gmm(lhs, rhs, sizes), **tol)
    edl, edr = np_gmm_grads(lhs, rhs, sizes, dy)
    np.testing.assert_allclose(np.asarray(dl, np.float32), edl, **tol)
    np.testing.assert_allclose(np.asarray(dr, np.float32), edr, **tol)
    total = sum(sizes)
    assert not np.asarray(out[total:]).any() and not np.asarray(dl[total:]).any()
    assert not np.asarray(dr[np.asarray(sizes) == 0]).any()   # empty groups: zero gradient
    start = 0
    for s, u in zip(sizes, used):   # zero padding rows give exactly zero rows
        assert not np.asarray(out[start + u:start + s]).any()
        start += s


def test_aligned_equals_the_work_list_bitwise():
    # A = bm: the work list's group-start tiles are the aligned grid's tiles, the same block
    # products in the same order, so the results are equal bit for bit
    m, sizes, used, k, n, a = CASES["empty_groups_and_padding"]
    lhs, rhs, gs, dy = padded_operands(m, k, n, sizes, used, seed=7)
    run = jax.jit(lambda al, *x: fwd_bwd(*x, **SMALL, group_alignment=al), static_argnums=0)
    for got, want in zip(run(a, lhs, rhs, gs, dy), run(1, lhs, rhs, gs, dy)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_grid_is_the_tile_model_and_smaller_than_the_work_list():
    m, sizes, used, k, n, a = CASES["empty_groups_and_padding"]
    lhs, rhs, gs, dy = padded_operands(m, k, n, sizes, used)
    g, bm, bn, bk = len(sizes), 16, 16, 16
    n_blocks, k_blocks = -(-n // bn), -(-k // bk)
    for align, aligned in ((a, True), (1, False)):
        grids = kernel_grids(lambda *x: fwd_bwd(*x, **SMALL, group_alignment=align),
                             lhs, rhs, gs, dy)
        tiles = pallas_plan.row_tiles_launched(m, g, bm, aligned)
        suffix = "_aligned" if aligned else ""
        assert grids["dropless_gmm" + suffix] == (tiles * n_blocks,)
        assert grids["dropless_gmm_dlhs" + suffix] == (tiles * k_blocks,)
        assert grids["dropless_gmm_drhs"] == (g * k_blocks * n_blocks,)
    # 104 rows, bm=16: 7 aligned tiles against the work list's (104 + 6 * 15) // 16 = 12
    assert pallas_plan.row_tiles_launched(m, g, bm, True) == 7
    assert pallas_plan.row_tiles_launched(m, g, bm, False) == 12
    # the tiles doing arithmetic: sum_g cdiv(s_g, bm), the same on either grid
    fig = pallas_plan.row_tiles_as_run(sizes, m, "float32", a, block_m=bm)
    assert fig == {"block_m": 16, "aligned": True, "tiles_launched": 7, "tiles_computed": 5}


def test_alignment_the_block_does_not_divide_keeps_the_work_list():
    # A = 16 with block_m = 32: a tile could hold two groups, so the work list runs (exact)
    m, sizes, used, k, n, _ = CASES["zero_tail_past_m"]
    lhs, rhs, gs, dy = padded_operands(m, k, n, sizes, used, seed=2)
    opts = dict(block_m=32, block_k=16, block_n=16, group_alignment=16)
    assert set(kernel_grids(lambda *x: fwd_bwd(*x, **opts), lhs, rhs, gs, dy)) == {
        "dropless_gmm", "dropless_gmm_dlhs", "dropless_gmm_drhs"}
    out, dl, dr = jax.jit(lambda *x: fwd_bwd(*x, **opts))(lhs, rhs, gs, dy)
    np.testing.assert_allclose(out, np_gmm(lhs, rhs, sizes), rtol=1e-5, atol=1e-4)
    edl, edr = np_gmm_grads(lhs, rhs, sizes, dy)
    np.testing.assert_allclose(dl, edl, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(dr, edr, rtol=1e-5, atol=1e-4)


def test_default_block_m_divides_the_alignment():
    # 8192 rows at G=64: the unaligned default is bm=64 (128 would waste 1.50 rows a row);
    # aligned to 128 nothing is wasted, so bm=128; aligned to 64, 64; to 32 no candidate fits
    assert pallas_plan.choose_block_m(8192, 64, "bfloat16") == 64
    assert pallas_plan.choose_block_m(8192, 64, "bfloat16", align=128) == 128
    assert pallas_plan.choose_block_m(8192, 64, "bfloat16", align=192) == 64
    assert pallas_plan.choose_block_m(8192, 8, "bfloat16", align=32) == 128
    assert pallas_plan.choose_block_m(8192, 64, "float32", align=128) == 64
    assert not pallas_plan.is_aligned(1, 16)


def test_registry_names_pallas_gpu_aligned():
    # the layer aligns segments to the row block of what `auto` runs on CUDA without tokamax
    spec = registry.backend_spec("pallas_gpu")
    assert spec.aligned and spec.row_block == pallas_plan.ALIGNED_ROW_BLOCK == 128
    assert registry.row_alignment("pallas_gpu", "cuda") == 128
    for cands in (d["block_m"] for d in pallas_plan.DEFAULTS.values()):
        assert all(pallas_plan.is_aligned(128, bm) for bm in cands)


def test_default_blocks_aligned_bf16():
    # the Hopper defaults with A=128: bm=128 (shrunk to nothing smaller: M=256), bk=64, bn=128
    # shrunk to the operands; one group empty, one taking 128 rows of which 100 are routed
    m, sizes, used, k, n = 256, [128, 0, 128], [100, 0, 128], 64, 48
    lhs, rhs, gs, dy = padded_operands(m, k, n, sizes, used, jnp.bfloat16, seed=9)
    grids = kernel_grids(lambda *x: fwd_bwd(*x, group_alignment=128), lhs, rhs, gs, dy)
    assert grids["dropless_gmm_aligned"] == (2,)    # 2 row tiles x 1 N block of 64
    out, dl, dr = jax.jit(lambda *x: fwd_bwd(*x, group_alignment=128))(lhs, rhs, gs, dy)
    tol = dict(rtol=2e-2, atol=1e-1)
    np.testing.assert_allclose(np.asarray(out, np.float32), np_gmm(lhs, rhs, sizes), **tol)
    edl, edr = np_gmm_grads(lhs, rhs, sizes, dy)
    np.testing.assert_allclose(np.asarray(dl, np.float32), edl, **tol)
    np.testing.assert_allclose(np.asarray(dr, np.float32), edr, **tol)


def test_bench_model_reports_the_grid_as_it_runs():
    # `bench gmm --model-only`'s alignment records: Qwen3's 262,144 rows in 128 groups launch
    # 2,175 row tiles of 128 either way: the work list's bound (262,144 + 129 x 127) // 128 and
    # the aligned layout's P = 278,400 rows / 128 (the tiles past the routed rows store zeros)
    from dropless.bench.gmm import align_records
    rec = next(r for r in align_records() if r["shape"] == "qwen3_30b_a3b"
               and r["routing"] == "uniform")
    assert rec["pallas_launched_per_row_unaligned"] == 2175 * 128 / 262144
    assert rec["pallas_launched_per_row_aligned"] == 2175 * 128 / 262144
