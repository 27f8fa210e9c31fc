"""`pallas_gpu` in Pallas interpret mode on CPU: the kernels' index logic and numerics.

Legend: M rows, K contraction dim, N output dim, G groups, W work items.

The shared suite (test_gmm.py) runs pallas_gpu on its cases; here: the work-list metadata by
hand, several block sizes (so tiles straddle groups and K/N are not multiples of the blocks),
one-row and empty groups, rows past sum(group_sizes), bf16/f16/f32, and the option errors.
Shapes are tiny: interpret mode runs every grid step as a loop iteration on the CPU.
"""
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.ops import grouped_matmul
from dropless.ops.gpu import pallas_plan
from dropless.ops.gpu.pallas_gpu import group_offsets, work_items
from tests._support.gmm_reference import np_gmm, np_gmm_grads, operands


def test_work_items_hand_worked():
    # sizes [5, 0, 3], m=10, bm=4: tiles start at each group's first row: g0 rows 0-4 -> tiles
    # at rows 0 and 4, g1 is empty, g2 rows 5-7 -> one tile at row 5, the zero tail
    # (pseudo-group 3) rows 8-9 -> row 8; W = (10 + 4 * 3) // 4 = 5, the last item is surplus
    # and points at the empty pseudo-group 4
    offsets = group_offsets(jnp.array([5, 0, 3]), 10)
    assert offsets.tolist() == [0, 5, 5, 8, 10, 10]
    group_W, row0_W = work_items(offsets, 10, 4)
    assert group_W.tolist() == [0, 0, 2, 3, 4]
    assert row0_W.tolist() == [0, 4, 5, 8, 0]


@jax.jit
def _items(sizes_G):
    offsets = group_offsets(sizes_G, 100)
    return (offsets,) + work_items(offsets, 100, 16)


def test_work_items_cover_every_row_once():
    rng = np.random.default_rng(0)
    m, bm = 100, 16
    for _ in range(30):
        sizes = rng.multinomial(int(rng.integers(0, m + 1)), rng.dirichlet(np.ones(7) * 0.3))
        off, group_W, row0_W = (np.asarray(a) for a in _items(jnp.asarray(sizes, jnp.int32)))
        hits = np.zeros(m, int)
        for grp, row0 in zip(group_W, row0_W):
            rows = np.arange(row0, row0 + bm)
            hits[rows[(rows >= off[grp]) & (rows < off[grp + 1])]] += 1
        assert (hits == 1).all(), sizes.tolist()


# (M, sizes, K, N): one-row groups, empty groups, a group spanning several 16-row tiles,
# rows past the sum, K and N not multiples of 16
CASE = (70, [1, 0, 33, 1, 0, 17, 2], 20, 36)


def fwd_bwd(lhs, rhs, gs, dy, **opts):
    f = lambda a, b: grouped_matmul(a, b, gs, backend="pallas_gpu", **opts)
    out, vjp = jax.vjp(f, lhs, rhs)
    return (out,) + vjp(dy)


SMALL, MIXED, DEFAULT = (dict(block_m=16, block_k=16, block_n=16),
                         dict(block_m=32, block_k=16, block_n=32),
                         dict())  # the Hopper defaults, shrunk to these operands


@pytest.mark.parametrize("dtype,blocks", [("float32", SMALL), ("bfloat16", SMALL),
                                          ("bfloat16", MIXED), ("float32", DEFAULT)])
def test_forward_and_grads_against_numpy(blocks, dtype):
    m, sizes, k, n = CASE
    dt = jnp.dtype(dtype)
    lhs, rhs, gs, dy = operands(m, k, n, sizes, dt, seed=3)
    out, dl, dr = jax.jit(lambda *a: fwd_bwd(*a, **blocks))(lhs, rhs, gs, dy)
    assert out.dtype == dl.dtype == dr.dtype == dt
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == "float32" else dict(rtol=2e-2, atol=1e-1)
    expected = np_gmm(lhs, rhs, sizes)
    np.testing.assert_allclose(np.asarray(out, np.float32), expected, **tol)
    assert not np.asarray(out[sum(sizes):]).any()  # rows past the sum are exactly zero
    edl, edr = np_gmm_grads(lhs, rhs, sizes, dy)
    np.testing.assert_allclose(np.asarray(dl, np.float32), edl, **tol)
    np.testing.assert_allclose(np.asarray(dr, np.float32), edr, **tol)
    assert not np.asarray(dl[sum(sizes):]).any()
    assert not np.asarray(dr[np.asarray(sizes) == 0]).any()  # empty groups: zero gradient


def test_tiles_running_past_the_last_row():
    # sizes sum to M and each group's tiles start at its first row: g2 (rows 23-39) has tiles
    # at rows 23 and 39, the second reaching 15 rows past M=40 (masked loads and stores)
    m, sizes, k, n = 40, [3, 20, 17], 20, 36
    lhs, rhs, gs, dy = operands(m, k, n, sizes, jnp.float32, seed=5)
    out, dl, dr = jax.jit(lambda *a: fwd_bwd(*a, **SMALL))(lhs, rhs, gs, dy)
    tol = dict(rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(out, np_gmm(lhs, rhs, sizes), **tol)
    edl, edr = np_gmm_grads(lhs, rhs, sizes, dy)
    np.testing.assert_allclose(dl, edl, **tol)
    np.testing.assert_allclose(dr, edr, **tol)


def test_f16_inputs_and_f32_output():
    m, sizes, k, n = CASE
    lhs, rhs, gs, _ = operands(m, k, n, sizes, jnp.float16, seed=4)
    out = grouped_matmul(lhs, rhs, gs, backend="pallas_gpu", preferred_element_type=jnp.float32,
                         block_m=32, block_k=16, block_n=16, interpret=True)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, np_gmm(lhs, rhs, sizes), rtol=1e-3, atol=1e-2)


def test_degenerate_shapes_give_zeros():
    lhs, rhs, gs, _ = operands(0, 4, 3, [0, 0])
    assert grouped_matmul(lhs, rhs, gs, backend="pallas_gpu").shape == (0, 3)
    lhs, rhs, gs, _ = operands(5, 0, 3, [2, 3])
    assert not np.asarray(grouped_matmul(lhs, rhs, gs, backend="pallas_gpu")).any()


@pytest.mark.parametrize("opts,match", [
    (dict(block_m=24), r"block_m=24 must be a power of two >= 16"),
    (dict(block_k=8), r"block_k=8 must be a power of two >= 16"),
    (dict(num_warps=3), r"num_warps=3"),
    (dict(num_stages=0), r"num_stages=0"),
    (dict(interpret="yes"), r"interpret='yes'"),
    (dict(tile_sizes=(8,)), r"takes options \[.*block_m.*\]; got unknown \['tile_sizes'\]"),
])
def test_bad_options_name_the_option(opts, match):
    lhs, rhs, gs, _ = operands(8, 4, 3, [4, 4])
    with pytest.raises(ValueError, match=match):
        grouped_matmul(lhs, rhs, gs, backend="pallas_gpu", **opts)


def test_tokamax_missing_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "tokamax", None)  # makes `import tokamax` raise
    lhs, rhs, gs, _ = operands(8, 4, 3, [4, 4])
    with pytest.raises(ImportError, match=r"pip install 'dropless\[gpu\]'"):
        grouped_matmul(lhs, rhs, gs, backend="tokamax")


def test_tokamax_bad_implementation_is_named():
    lhs, rhs, gs, _ = operands(8, 4, 3, [4, 4])
    with pytest.raises(ValueError, match=r"implementation='cutlass' must be one of"):
        grouped_matmul(lhs, rhs, gs, backend="tokamax", implementation="cutlass")


# ---- pallas_plan: the sizing rules and the cost model the bench prints ----

def test_rows_computed_hand_worked():
    # sizes [3, 3], bm=4: tiles from each group's first row: one tile each -> 8 rows for 6;
    # bm-aligned tiles: g0 rows 0-2 -> tile 0, g1 rows 3-5 -> tiles 0 and 1 -> 12 rows for 6
    assert pallas_plan.rows_computed_ratio([3, 3], 4) == pytest.approx(8 / 6)
    assert pallas_plan.rows_computed_ratio([3, 3], 4, "aligned") == 2.0
    # empty groups cost nothing either way
    assert pallas_plan.rows_computed_ratio([0, 4, 0], 4) == 1.0


def test_block_m_follows_the_static_shape():
    # 8192 rows: 8 groups -> 128 (modeled 1.06), 64 groups -> 64 (128 would be 1.50, 64 1.25)
    assert [pallas_plan.choose_block_m(8192, g, "bfloat16") for g in (8, 64, 256)] == [128, 64, 64]
    assert pallas_plan.modeled_rows_ratio(8192, 64, 128) == pytest.approx(1 + 64 * 127 / 16384)
    assert [pallas_plan.choose_block_m(8192, g, "float32") for g in (8, 64)] == [64, 32]


def test_program_order_model():
    b = pallas_plan.Blocks(128, 64, 128, 4, 4)
    sizes = np.full(8, 2048)
    # the former grid ran an lhs tile's 8 N-blocks one wave apart: lhs read ~8 times
    old = pallas_plan.gmm_traffic(sizes, 1024, 1024, b, "bfloat16", order="old")
    new = pallas_plan.gmm_traffic(sizes, 1024, 1024, b, "bfloat16")
    assert old["lhs_reads"] > 7 and new["lhs_reads"] < 1.1
    assert new["bytes_per_flop"] < old["bytes_per_flop"] / 1.5
    # drhs under skew: largest group first never schedules worse than groups fastest
    skew = np.array([4000] + [20] * 255)
    assert pallas_plan.drhs_schedule(skew, 128, 128, b, "bfloat16")["makespan_vs_ideal"] <= \
        pallas_plan.drhs_schedule(skew, 128, 128, b, "bfloat16", order="old")["makespan_vs_ideal"]


def test_bench_gmm_model_only_prints_the_figures(capsys, tmp_path):
    from dropless import cli
    out = tmp_path / "m.jsonl"
    assert cli.main(["bench", "gmm", "--model-only", "--m", "512", "--k", "64", "--n", "64",
                     "--groups", "8,64", "--routings", "zipf", "--dtypes", "bfloat16",
                     "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "rows_before" in text and "drhs_makespan_after" in text
    # the asked cases' pallas_gpu model, then the alignment model at the shapes table
    recs = [json.loads(line) for line in out.read_text().splitlines()
            if json.loads(line)["mode"] == "model"]
    assert [r["groups"] for r in recs] == [8, 64]
    assert recs[1]["rows_after"] < recs[1]["rows_before"]
