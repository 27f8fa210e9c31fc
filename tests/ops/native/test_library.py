"""The `openblas` backend: its native kernel against a float64 NumPy loop at shapes where its
work is cut into several tasks, its dtype fallback, vmap, and its build cache (atomic,
concurrent, failing with a reason). The registry-wide tests (test_registry*.py) run it too."""
import importlib.util
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.ops import grouped_matmul
from dropless.ops.native import library as openblas
from dropless.ops.gmm.registry import resolve_backend
from tests._support.gmm_reference import np_gmm, np_gmm_grads

ROOT = Path(__file__).resolve().parents[3]


def test_builds_here_and_is_autos_cpu_choice():
    # the suite's environment has the dependency and a compiler: a silent fall back to tiled
    # would make every CPU number in the benches a different kernel's
    assert openblas.problem() is None
    assert resolve_backend("auto", "cpu") == "openblas"


def _only_ran(kernel, before):
    """Every GEMM since `before` (openblas.gemm_calls()) ran on `kernel`, and some did."""
    now = openblas.gemm_calls()
    other = "openblas" if kernel == "own" else "own"
    return now[kernel] > before[kernel] and now[other] == before[other]


@pytest.fixture(scope="module")
def fwd_bwd():
    def f(lhs, rhs, sizes, dy):
        out, pullback = jax.vjp(
            lambda a, b: grouped_matmul(a, b, sizes, backend="openblas"), lhs, rhs)
        return (out, *pullback(dy))
    return jax.jit(f)


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


def _kernel_matches_float64_loop(fwd_bwd, kernel, seed, k, n, sizes, rows_past):
    """Run the forward and both gradients on `kernel` (forced) for groups of `sizes` and
    `rows_past` rows in none, check that only that kernel ran and that all three equal the
    float64 loop; returns the operands (lhs, rhs, dy) and the results (out, dlhs, drhs)."""
    m = sum(sizes) + rows_past
    lhs, rhs, dy, (want, want_dlhs, want_drhs) = _problem(seed, m, k, n, sizes)
    before = openblas.gemm_calls()
    with openblas.use_kernel(kernel):
        got = jax.block_until_ready(fwd_bwd(lhs, rhs, jnp.asarray(sizes, jnp.int32), dy))
    assert _only_ran(kernel, before)
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
@pytest.mark.parametrize("kernel", ["own", "openblas"])
@pytest.mark.parametrize("k, n, sizes", [(1100, 37, [5, 70, 0, 13]), (24, 80, [33, 1, 100, 0]),
                                         (130, 16, [0, 0, 131, 2]), (40, 48, [17, 31, 47, 49])])
def test_both_kernels_match_float64_loop_at_tile_edges(fwd_bwd, kernel, k, n, sizes):
    lhs, rhs, dy = _kernel_matches_float64_loop(fwd_bwd, kernel, 1, k, n, sizes, 3)[0]
    first = next(g for g, s in enumerate(sizes) if s)
    lhs[0, 0] = np.nan
    with openblas.use_kernel(kernel):
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
@pytest.mark.parametrize("kernel", ["own", "openblas"])
@pytest.mark.parametrize("case", ["nn", "nt", "tn_slices"])
def test_contractions_past_one_chunk_match_float64_loop(fwd_bwd, kernel, case):
    chunk = openblas.chunk_rows()
    if case == "nn":
        k, n, sizes = chunk["nn"] + 52, 40, [chunk["nn"] + 102, 0, 47, 0]
    elif case == "tn_slices":   # drhs tasks of 800 of K's rows x 2000 rows: a^T in 2 slices
        k, n, sizes = 2400, 8, [2000, 0, 0, 3]
    else:
        k, n, sizes = 24, chunk["nt"] + 54, [60, 0, 40, 3]
    out, _, drhs = _kernel_matches_float64_loop(fwd_bwd, kernel, 4, k, n, sizes, 2)[1]
    assert not out[sum(sizes):].any() and not drhs[1].any()


def test_auto_runs_the_tiled_kernel_for_every_group_in_avx512_builds(fwd_bwd):
    # the library's rule (native/grouped_gemm.cc, KernelChoice): its own kernel wherever the
    # build has AVX-512, whatever the group's size; OpenBLAS elsewhere
    sizes = [1000, 30, 0, 200]
    lhs, rhs, dy, _ = _problem(5, sum(sizes), 64, 64, sizes)
    before = openblas.gemm_calls()
    jax.block_until_ready(fwd_bwd(lhs, rhs, jnp.asarray(sizes, jnp.int32), dy))
    wide = openblas.describe()["native_vector_floats"] == 16
    assert _only_ran("own" if wide else "openblas", before)


# outputs above the size the library streams (`stream_min_bytes`): drhs's [G, K, N] (a group of
# more rows than one 512-row contraction chunk is written in chunks, not streamed; 0-, 1- and
# 5-row groups) and the forward's [M, N]; N = 144 is two 64-wide panels and a lone vector, 129
# leaves a column summed one by one; both against the float64 loop
@pytest.mark.parametrize("n", [144, 129])
def test_streamed_outputs_match_float64_loop(n):
    limit = openblas.stream_min_bytes()
    if limit is None:
        pytest.skip("this build has no streaming stores")
    sizes = [0, 300, 1, 77, 0, 520, 33, 5]
    m, g = sum(sizes), len(sizes)
    k = -(-2 * limit // (4 * g * n))          # drhs: twice the limit
    rng = np.random.default_rng(3)
    lhs, dy = (rng.standard_normal(s).astype(np.float32) for s in ((m, k), (m, n)))
    rhs = rng.standard_normal((g, k, n)).astype(np.float32)
    drhs = np.asarray(jax.jit(openblas.gmm_drhs)(lhs, dy, jnp.asarray(sizes, jnp.int32)))
    assert drhs.nbytes > limit
    want = np_gmm_grads(lhs.astype(np.float64), rhs.astype(np.float64), sizes,
                        dy.astype(np.float64))[1]
    np.testing.assert_allclose(drhs, want, rtol=1e-4, atol=1e-4 * np.sqrt(m))
    rows = -(-2 * limit // (4 * n))           # the forward: twice the limit
    fsizes = [rows // 2, 0, rows - rows // 2 - 3, 3]
    x = rng.standard_normal((rows + 5, 40)).astype(np.float32)
    w = rng.standard_normal((4, 40, n)).astype(np.float32)
    out = np.asarray(jax.jit(openblas.gmm_forward)(x, w, jnp.asarray(fsizes, jnp.int32)))
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
            lambda a, b: grouped_matmul(a, b, gs, backend="openblas"), lhs, rhs)
        dlhs, drhs = pullback(jnp.ones_like(out))
        assert out.shape == (m, n) and not np.asarray(out).any()
        assert dlhs.shape == (m, k) and not np.asarray(dlhs).any()
        assert drhs.shape == (2, k, n) and not np.asarray(drhs).any()


def test_non_float32_operands_run_tiled():
    rng = np.random.default_rng(1)
    lhs = jnp.asarray(rng.standard_normal((20, 8)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((3, 8, 5)), jnp.bfloat16)
    gs = jnp.array([7, 0, 13], jnp.int32)
    for pet in (None, jnp.float32):
        got = grouped_matmul(lhs, rhs, gs, backend="openblas", preferred_element_type=pet)
        want = grouped_matmul(lhs, rhs, gs, backend="tiled", preferred_element_type=pet)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_vmap_runs_each_item():
    rng = np.random.default_rng(2)
    lhs = rng.standard_normal((2, 12, 4)).astype(np.float32)
    rhs = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
    gs = np.array([[4, 4, 4], [0, 12, 0]], np.int32)
    got = jax.vmap(lambda a, b, g: grouped_matmul(a, b, g, backend="openblas"))(lhs, rhs, gs)
    for i in range(2):
        np.testing.assert_allclose(got[i], np_gmm(lhs[i], rhs[i], gs[i]), rtol=1e-5, atol=1e-5)


def test_build_without_a_compiler_says_so(monkeypatch, tmp_path):
    monkeypatch.setenv("DROPLESS_CACHE", str(tmp_path))
    monkeypatch.setattr(openblas, "_compiler", lambda: None)
    with pytest.raises(RuntimeError, match="no C.. compiler"):
        openblas.build()
    assert not any(tmp_path.rglob("*.so"))


def test_concurrent_builds_into_one_empty_cache_both_load(tmp_path):
    # two processes build the same key at once: each compiles to its own temp file and moves it
    # into place, so both load a whole library and no temp file is left behind
    script = textwrap.dedent("""
        import jax.numpy as jnp, numpy as np
        from dropless.ops.native import library as openblas
        assert openblas.problem() is None, openblas.problem()
        out = openblas.gmm_forward(jnp.ones((4, 3)), jnp.ones((2, 3, 2)), jnp.array([1, 2]))
        assert np.asarray(out).tolist() == [[3, 3], [3, 3], [3, 3], [0, 0]], out
        print(openblas.build())
    """)
    env = dict(os.environ, DROPLESS_CACHE=str(tmp_path), JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    paths = {out.strip().splitlines()[-1] for out, _ in outs}
    assert len(paths) == 1
    files = [f for f in tmp_path.rglob("*") if f.is_file()]
    assert [f.name for f in files] == ["libdropless_gmm.so"]


def test_an_unwritable_cache_folder_builds_in_the_temp_folder(monkeypatch, tmp_path):
    # DROPLESS_CACHE names a file: its folder cannot be made, so the build goes to the temp folder
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("")
    monkeypatch.setenv("DROPLESS_CACHE", str(blocker))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", None)   # gettempdir() reads TMPDIR again
    path = openblas.build()
    assert path.is_file() and str(path).startswith(str(tmp_path / "tmp"))
    assert blocker.read_text() == ""


@pytest.mark.skipif(importlib.util.find_spec("ziglang") is None,
                    reason="ziglang not installed (the compiler pip brings; 100 MB, not in CI)")
def test_without_a_system_compiler_ziglang_builds_a_working_kernel(monkeypatch, tmp_path):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(openblas.shutil, "which", lambda name: None)
    assert openblas._compiler()[1:] == ["-m", "ziglang", "c++"]
    monkeypatch.setenv("DROPLESS_CACHE", str(tmp_path))
    path = openblas.build()
    script = ("import ctypes, sys, jax, jax.numpy as jnp, numpy as np\n"
              "lib = ctypes.CDLL(sys.argv[1])\n"
              "jax.ffi.register_ffi_target('t', jax.ffi.pycapsule(lib.DroplessGroupedGemmF32),"
              " platform='cpu')\n"
              "out = jax.ffi.ffi_call('t', jax.ShapeDtypeStruct((3, 2), jnp.float32))("
              "jnp.ones((3, 4)), jnp.ones((1, 4, 2)), jnp.array([2], jnp.int32), mode=np.int32(0))\n"
              "assert np.asarray(out).tolist() == [[4, 4], [4, 4], [0, 0]], out\n")
    subprocess.run([sys.executable, "-c", script, str(path)], check=True, timeout=120)


def _np_swiglu_ffn(x, wg, wu, wd, sizes, dy):
    """float64 loop: y = down(silu(x @ gate) * (x @ up)) per group, and every gradient."""
    x, wg, wu, wd, dy = (a.astype(np.float64) for a in (x, wg, wu, wd, dy))
    y, dx = np.zeros_like(dy), np.zeros_like(x)
    dwg, dwu, dwd = np.zeros_like(wg), np.zeros_like(wu), np.zeros_like(wd)
    start = 0
    for e, n in enumerate(sizes):
        r = slice(start, start + n)
        start += n
        g, u = x[r] @ wg[e], x[r] @ wu[e]
        s = 1 / (1 + np.exp(-g))
        h = g * s * u
        y[r] = h @ wd[e]
        dh = dy[r] @ wd[e].T
        dg, du = dh * u * (s + g * s * (1 - s)), dh * g * s
        dx[r] = dg @ wg[e].T + du @ wu[e].T
        dwg[e], dwu[e], dwd[e] = x[r].T @ dg, x[r].T @ du, h.T @ dy[r]
    return y, (dx, dwg, dwu, dwd)


@pytest.mark.parametrize("kernel", ["own", "openblas"])
@pytest.mark.parametrize("sizes", [[700, 0, 450, 37], [0, 0, 0, 1240], [0, 0, 0, 0],
                                   [17, 31, 47, 49]])
def test_fused_swiglu_ffn_matches_float64_loop(kernel, sizes):
    # D*F*2 = 2^17 multiply-adds a row: a 700-row group is cut into several row tasks
    rng = np.random.default_rng(3)
    m, d, f = 1240, 256, 256
    x = rng.standard_normal((m, d)).astype(np.float32)
    wg, wu = (rng.standard_normal((4, d, f)).astype(np.float32) * 0.1 for _ in range(2))
    wd = rng.standard_normal((4, f, d)).astype(np.float32) * 0.1
    dy = rng.standard_normal((m, d)).astype(np.float32)
    gs = jnp.asarray(sizes, jnp.int32)
    before = openblas.gemm_calls()
    with openblas.use_kernel(kernel):
        y, pullback = jax.vjp(lambda *a: openblas.swiglu_ffn(*a, gs), x, wg, wu, wd)
        got = jax.block_until_ready(pullback(dy))
    assert _only_ran(kernel, before) or not sum(sizes)
    want_y, want = _np_swiglu_ffn(x, wg, wu, wd, sizes, dy)
    np.testing.assert_allclose(y, want_y, rtol=1e-4, atol=1e-4 * np.abs(want_y).max() + 1e-6)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * np.abs(b).max() + 1e-6)
    assert not np.asarray(y)[sum(sizes):].any() and not np.asarray(got[0])[sum(sizes):].any()


# the fused forward's edges on both kernels, against the float64 loop, its three outputs and the
# FFN's output and gradients: F with 2-vector gate/up tiles, a 1-vector tile and 8 columns summed
# one by one (216 = 6 x 32 + 16 + 8); D past the fused tile's contraction chunk (its g and u then
# written, read back and finished in the last chunk); outputs above the streaming size
@pytest.mark.parametrize("kernel", ["own", "openblas"])
@pytest.mark.parametrize("shape", ["columns", "chunks", "streamed"])
def test_fused_ffn_edges_match_float64_loop(kernel, shape):
    if shape == "streamed" and openblas.stream_min_bytes() is None:
        pytest.skip("this build has no streaming stores")
    m, d, f = {"columns": (300, 96, 216), "chunks": (150, openblas.chunk_rows()["gate_up"] + 40, 40),
               "streamed": (None, 64, 264)}[shape]
    if m is None:                      # each [M, F] output twice the streamed size
        m = -(-2 * openblas.stream_min_bytes() // (4 * f))
    sizes = [m // 2 - 5, 0, m - m // 2 - 7, 9]          # rows m - 3 .. m + 2 in no group
    rng = np.random.default_rng(6)
    x, dy = (rng.standard_normal((m + 3, d)).astype(np.float32) for _ in range(2))
    wg, wu = (rng.standard_normal((4, d, f)).astype(np.float32) / np.sqrt(d) for _ in range(2))
    wd = rng.standard_normal((4, f, d)).astype(np.float32) / np.sqrt(f)
    gs = jnp.asarray(sizes, jnp.int32)
    before = openblas.gemm_calls()
    with openblas.use_kernel(kernel):
        g, u, h = map(np.asarray, jax.jit(openblas.gate_up_swiglu)(x, wg, wu, gs))
        y, pullback = jax.vjp(lambda *a: openblas.swiglu_ffn(*a, gs), x, wg, wu, wd)
        got = jax.block_until_ready(pullback(dy))
    assert _only_ran(kernel, before)
    assert shape != "streamed" or g.nbytes > openblas.stream_min_bytes()
    want_g, want_u = (np_gmm(x.astype(np.float64), w.astype(np.float64), sizes) for w in (wg, wu))
    tol = dict(rtol=1e-4, atol=1e-4 * np.sqrt(d))
    np.testing.assert_allclose(g, want_g, **tol)
    np.testing.assert_allclose(u, want_u, **tol)
    np.testing.assert_allclose(h, want_g / (1 + np.exp(-want_g)) * want_u, **tol)
    want_y, want = _np_swiglu_ffn(x, wg, wu, wd, sizes, dy)
    np.testing.assert_allclose(y, want_y, rtol=1e-4, atol=1e-4 * np.abs(want_y).max())
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * np.abs(b).max())


def test_the_layer_runs_the_fused_ffn_on_cpu_unless_openblas_is_refused():
    import dataclasses
    from dropless import moe
    from dropless.config import MoEConfig
    from dropless.ops.gmm.registry import auto_scope
    cfg = MoEConfig(num_experts=4, top_k=2, d_model=16, d_ff=24, dtype="float32",
                    weight_dtype="float32", score_func="softmax")
    params = moe.init_params(jax.random.key(0), cfg)
    x = jax.random.normal(jax.random.key(1), (40, 16))

    def loss_and_grads(c):
        return jax.jit(jax.value_and_grad(lambda p, x: (moe.apply(p, x, c)[0] ** 2).sum(),
                                          argnums=(0, 1)))

    hlo = loss_and_grads(cfg).lower(params, x).as_text()
    assert "dropless_gate_up_swiglu_f32" in hlo and "dropless_swiglu_dlhs_f32" in hlo
    with auto_scope(refused=frozenset({("openblas", None)})):
        refused = loss_and_grads(cfg).lower(params, x).as_text()
    # every grouped matmul ran tiled (the row gathers of permute and combine are not GEMMs)
    assert not any(t in refused for t in openblas.GEMM_HANDLERS)
    want = loss_and_grads(dataclasses.replace(cfg, gmm_backend="reference"))(params, x)
    got = loss_and_grads(cfg)(params, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6 * float(np.abs(b).max()) + 1e-7)


@pytest.mark.parametrize("form", ["scalar", "vector"])
def test_fast_exp_is_within_2_ulp_of_float64_and_keeps_nan(form):
    # the fused handlers' exp, one float at a time and a vector at a time (the vector form's
    # floor is a truncation corrected where it rounded up: off by one below 0 without it)
    import ctypes
    assert openblas.problem() is None
    lib = ctypes.CDLL(str(openblas.build()))
    x = np.concatenate([np.linspace(-87, 88, 400001, dtype=np.float32),
                        np.array([np.nan, 0.0, -0.0], np.float32)])
    x = np.concatenate([x, np.zeros(-x.size % 16, np.float32)])     # whole vectors
    out = np.empty_like(x)
    fn = lib.dropless_fast_exp if form == "scalar" else lib.dropless_fast_exp_vec
    fn(x.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p),
       ctypes.c_int64(x.size))
    n = 400001
    want = np.exp(x[:n].astype(np.float64))
    assert (np.abs(out[:n] - want) / want).max() < 2 * 2.0 ** -23
    assert np.isnan(out[n]) and out[n + 1] == 1.0 and out[n + 2] == 1.0


def test_a_bad_kernel_choice_is_named():
    # read once, when the library loads: a fresh process
    code = textwrap.dedent("""
        import jax.numpy as jnp
        from dropless.ops import grouped_matmul
        grouped_matmul(jnp.ones((4, 8)), jnp.ones((1, 8, 16)), jnp.array([4], jnp.int32),
                       backend="openblas")
    """)
    env = dict(os.environ, DROPLESS_NATIVE_KERNEL="fastest")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          cwd=ROOT)
    assert proc.returncode != 0
    assert ("ValueError: DROPLESS_NATIVE_KERNEL='fastest': use one of auto, own, openblas "
            "(or leave it unset)") in proc.stderr
    with pytest.raises(ValueError, match="use_kernel='fast': use one of auto, own, openblas"):
        with openblas.use_kernel("fast"):
            pass


def test_describe_says_which_kernels_run():
    info = openblas.describe()
    assert info["native_kernel"] == "auto" and info["native_vector_floats"] in (4, 8, 16)
    with openblas.use_kernel("own"):
        assert openblas.describe()["native_kernel"] == "own"
    assert openblas.kernel() == "auto"
    # OpenBLAS's own name for its kernel set, or the OPENBLAS_CORETYPE it was told
    want = os.environ.get("OPENBLAS_CORETYPE")
    assert info["openblas_core"] and (not want or info["openblas_core"].lower() == want.lower())
