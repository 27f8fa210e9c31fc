"""The native library's bfloat16 paths: the grouped GEMM on AMX tiles (gemm.py and
csrc/amx_gemm.cc, the `native` backend for bf16 operands) against a float64 loop rounded once
to bf16 (odd and tile-sized dims, rows and contractions past a tile or a block, empty, negative
and cut groups, several tasks, contractions past one chunk, NaNs kept to their rows and group);
SwiGLU's activation on bf16 rows (csrc/swiglu_bf16.cc) against moe/ffn.py's definition, forward
and backward; the bf16 MoE layer running both, against the `reference` backend. The AMX tests
skip on a CPU without AMX-BF16 (AMD, older Intel, the AVX2 and SSE builds), where bf16 runs
`tiled`.

Legend: M rows, K contraction dim, N output dim, G groups, F expert hidden dim.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.moe.ffn import swiglu
from dropless.ops import grouped_matmul, kernels
from dropless.ops.native import ffn, gemm, load
from tests._support.gmm_reference import np_gmm_grads

BF16 = jnp.bfloat16
amx = pytest.mark.skipif(not load.amx_ready(), reason="no AMX-BF16 tile state on this CPU/build")


def _ragged_bounds(sizes, m):
    ends = np.minimum(np.cumsum(np.maximum(sizes, 0)), m)
    return np.concatenate([[0], ends])


def _np_all(lhs, rhs, sizes, dy):
    """out, dlhs, drhs in float64 with ragged_dot's group rules (negative sizes count as 0, a
    group is cut at row M), from the bf16 operands' exact values."""
    lhs, rhs, dy = (np.asarray(a, np.float64) for a in (lhs, rhs, dy))
    b = _ragged_bounds(sizes, lhs.shape[0])
    eff = np.diff(b)
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    for g in range(len(sizes)):
        out[b[g]:b[g + 1]] = lhs[b[g]:b[g + 1]] @ rhs[g]
    m = int(b[-1])
    dlhs, drhs = np_gmm_grads(lhs[:m], rhs, eff, dy[:m])
    return out, np.concatenate([dlhs, np.zeros((lhs.shape[0] - m, lhs.shape[1]))]), drhs


def _fwd_bwd(lhs, rhs, sizes, dy):
    out, pullback = jax.vjp(lambda a, b: grouped_matmul(a, b, sizes, backend="native"), lhs, rhs)
    return (out, *pullback(dy))


def _operands(seed, m, k, n, g):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((m, k)), BF16),
            jnp.asarray(rng.standard_normal((g, k, n)), BF16),
            jnp.asarray(rng.standard_normal((m, n)), BF16))


def _assert_bf16_close(got, want, what):
    # one rounding to bf16 (half an ulp: 2^-9 relative) over float32 accumulation
    got = np.asarray(got, np.float64)
    np.testing.assert_allclose(got, want, rtol=2.0 ** -8, atol=1e-3, err_msg=what)


# (M, K, N, sizes): tile-sized dims; K, N past a tile by one; odd dims below a tile; a group
# of one row; empty groups first and last; a negative size (counts as 0); groups summing past M
# (the last is cut) and short of M (rows past them are zero); several row and K tasks.
CASES = [
    (96, 64, 64, [32, 0, 64]),
    (100, 33, 17, [30, 0, 50, 10]),
    (77, 7, 9, [5, 40, -3, 60]),
    (65, 32, 48, [1, 64]),
    (40, 96, 80, [0, 0, 0]),
    (130, 100, 70, [0, 2, 3, 100, 0]),
    (1024, 256, 256, [700, 0, 300, 24]),
]


@amx
@pytest.mark.parametrize("m,k,n,sizes", CASES)
def test_amx_grouped_gemm_matches_float64_loop(m, k, n, sizes):
    lhs, rhs, dy = _operands(0, m, k, n, len(sizes))
    gs = jnp.asarray(sizes, jnp.int32)
    got = jax.jit(_fwd_bwd)(lhs, rhs, gs, dy)
    want = _np_all(lhs, rhs, np.asarray(sizes), dy)
    for a, b, what in zip(got, want, ("out", "dlhs", "drhs")):
        assert a.dtype == BF16, what
        _assert_bf16_close(a, b, what)
    b = _ragged_bounds(np.asarray(sizes), m)
    assert not np.asarray(got[0], np.float32)[b[-1]:].any()
    for g, s in enumerate(np.diff(b)):
        if s == 0:
            assert not np.asarray(got[2], np.float32)[g].any()


@amx
def test_amx_contractions_past_one_chunk_match_float64_loop():
    # a chunk holds at most L2 / 2 of B's panels (1 MiB / 2 KiB = 512 values at N = 1024 on a
    # 2 MiB L2): K = 1100 takes three forward chunks, a 1500-row group three weight-gradient
    # chunks, both with a partial last one
    lhs, rhs, dy = _operands(1, 1600, 1100, 1024, 2)
    gs = jnp.asarray([1500, 100], jnp.int32)
    got = jax.jit(_fwd_bwd)(lhs, rhs, gs, dy)
    for a, b, what in zip(got, _np_all(lhs, rhs, np.asarray(gs), dy), ("out", "dlhs", "drhs")):
        _assert_bf16_close(a, b, what)


@amx
def test_amx_nan_stays_in_its_rows_and_group():
    lhs, rhs, dy = _operands(2, 96, 64, 48, 3)
    lhs = lhs.at[40, 5].set(jnp.nan)            # a row of group 1 (rows 32..63)
    gs = jnp.asarray([32, 32, 32], jnp.int32)
    out, dlhs, drhs = (np.asarray(a, np.float32) for a in jax.jit(_fwd_bwd)(lhs, rhs, gs, dy))
    nan_rows = np.isnan(out).any(axis=1)
    assert nan_rows[40] and nan_rows.sum() == 1
    assert not np.isnan(dlhs).any()             # dlhs reads dy and rhs only
    assert np.isnan(drhs[1]).any() and not np.isnan(drhs[[0, 2]]).any()


@amx
def test_amx_is_what_native_runs_for_bf16():
    lhs, rhs, _ = _operands(3, 20, 8, 5, 3)
    gs = jnp.asarray([7, 0, 13], jnp.int32)
    hlo = jax.jit(lambda a, b: grouped_matmul(a, b, gs, backend="native")).lower(lhs, rhs)
    assert load.BF16_TARGET in hlo.as_text() and gemm.supports(lhs, rhs, BF16)


def _swiglu_cases():
    rng = np.random.default_rng(4)
    g = rng.standard_normal((70, 33)) * 4
    g[0, :8] = [0.0, -0.0, 100.0, -100.0, 1e-30, np.inf, -np.inf, np.nan]
    u = rng.standard_normal((70, 33))
    dh = rng.standard_normal((70, 33))
    return tuple(jnp.asarray(a, BF16) for a in (g, u, dh))


def test_swiglu_bf16_matches_the_layer_definition_forward_and_backward():
    if load.problem() is not None:
        pytest.skip(load.problem())
    g, u, dh = _swiglu_cases()
    got, pull = jax.vjp(ffn.swiglu_bf16, g, u)
    want, want_pull = jax.vjp(lambda a, b: swiglu(a, b, BF16), g, u)
    assert got.dtype == BF16
    for a, b, what in ((got, want, "h"), *zip(pull(dh), want_pull(dh), ("dg", "du"))):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert (np.isnan(a) == np.isnan(b)).all(), what
        ok = ~np.isnan(b)
        # float32 inside with a different exp (about 1 ulp): at most one bf16 rounding apart
        np.testing.assert_allclose(a[ok], b[ok], rtol=2.0 ** -7, atol=1e-30, err_msg=what)


def test_swiglu_rows_takes_native_only_for_bf16_on_native_or_auto():
    if load.problem() is not None:
        pytest.skip(load.problem())
    g, u, _ = _swiglu_cases()

    def hlo(backend, dtype, a=g, b=u):
        fn = lambda a, b: kernels.swiglu_rows(a, b, dtype, backend=backend, generic=swiglu)
        return jax.jit(fn).lower(a, b).as_text()
    assert "dropless_swiglu_bf16" in hlo("auto", BF16)
    assert "dropless_swiglu_bf16" in hlo("native", BF16)
    assert "dropless_swiglu_bf16" not in hlo("tiled", BF16)
    assert "dropless_swiglu_bf16" not in hlo("auto", jnp.float32)
    assert "dropless_swiglu_bf16" not in hlo("auto", BF16, g.astype(jnp.float32))


@amx
@pytest.mark.parametrize("shared", [0, 1])
def test_bf16_layer_runs_amx_and_native_swiglu_and_matches_reference(shared):
    from dropless import moe
    from dropless.config import MoEConfig
    cfg = MoEConfig(num_experts=4, top_k=2, d_model=64, d_ff=96, dtype="bfloat16",
                    weight_dtype="bfloat16", score_func="softmax",
                    num_shared_experts=shared)
    params = moe.init_params(jax.random.key(0), cfg)
    x = jax.random.normal(jax.random.key(1), (80, 64), BF16)

    def loss_and_grads(c):
        return jax.jit(jax.value_and_grad(
            lambda p, x: (moe.apply(p, x, c)[0].astype(jnp.float32) ** 2).sum(), argnums=(0, 1)))

    hlo = loss_and_grads(cfg).lower(params, x).as_text()
    for target in (load.BF16_TARGET, "dropless_swiglu_bf16", "dropless_swiglu_bwd_bf16"):
        assert target in hlo
    got = loss_and_grads(cfg)(params, x)
    want = loss_and_grads(dataclasses.replace(cfg, gmm_backend="reference"))(params, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        # bf16 intermediates on both sides: a value rounds differently now and then, and the
        # difference travels; bounded relative to each leaf's scale
        assert np.abs(a - b).max() <= 0.02 * np.abs(b).max() + 1e-6
