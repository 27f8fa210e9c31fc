"""The fused SwiGLU expert FFN on the native library (ffn.py): its forward, its three outputs and
every gradient on both GEMM kernels against a float64 loop (several row tasks, the fused tile's
column edges, past one contraction chunk, streamed outputs); the layer runs it on CPU unless
`native` is refused; the fused handlers' exp within 2 ulp.

Legend: M rows, D model dim, F expert hidden dim.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.ops.native import choice, ffn, load
from tests._support.ffn_reference import assert_matches_np_swiglu_ffn, ffn_operands
from tests._support.gmm_reference import np_gmm
from tests._support.native_kernels import KERNELS


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("sizes", [[700, 0, 450, 37], [0, 0, 0, 1240], [0, 0, 0, 0],
                                   [17, 31, 47, 49]])
def test_fused_swiglu_ffn_matches_float64_loop(only_ran, kernel, sizes):
    # D*F*2 = 2^17 multiply-adds a row: a 700-row group is cut into several row tasks
    x, wg, wu, wd, dy = ffn_operands(m=1240, d=256, f=256)
    gs = jnp.asarray(sizes, jnp.int32)
    before = choice.gemm_calls()
    with choice.use_kernel(kernel):
        y, pullback = jax.vjp(lambda *a: ffn.swiglu_ffn(*a, gs), x, wg, wu, wd)
        got = jax.block_until_ready(pullback(dy))
    assert only_ran(kernel, before) or not sum(sizes)
    assert_matches_np_swiglu_ffn(y, got, x, wg, wu, wd, sizes, dy)
    assert not np.asarray(y)[sum(sizes):].any() and not np.asarray(got[0])[sum(sizes):].any()


# the fused forward's edges on both kernels, against the float64 loop, its three outputs and the
# FFN's output and gradients: F with 2-vector gate/up tiles, a 1-vector tile and 8 columns summed
# one by one (216 = 6 x 32 + 16 + 8); D past the fused tile's contraction chunk (its g and u then
# written, read back and finished in the last chunk); outputs above the streaming size
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("shape", ["columns", "chunks", "streamed"])
def test_fused_ffn_edges_match_float64_loop(only_ran, kernel, shape):
    if shape == "streamed" and choice.stream_min_bytes() is None:
        pytest.skip("this build has no streaming stores")
    m, d, f = {"columns": (300, 96, 216), "chunks": (150, choice.chunk_rows()["gate_up"] + 40, 40),
               "streamed": (None, 64, 264)}[shape]
    if m is None:                      # each [M, F] output twice the streamed size
        m = -(-2 * choice.stream_min_bytes() // (4 * f))
    sizes = [m // 2 - 5, 0, m - m // 2 - 7, 9]          # rows m - 3 .. m + 2 in no group
    rng = np.random.default_rng(6)
    x, dy = (rng.standard_normal((m + 3, d)).astype(np.float32) for _ in range(2))
    wg, wu = (rng.standard_normal((4, d, f)).astype(np.float32) / np.sqrt(d) for _ in range(2))
    wd = rng.standard_normal((4, f, d)).astype(np.float32) / np.sqrt(f)
    gs = jnp.asarray(sizes, jnp.int32)
    before = choice.gemm_calls()
    with choice.use_kernel(kernel):
        g, u, h = map(np.asarray, jax.jit(ffn.gate_up_swiglu)(x, wg, wu, gs))
        y, pullback = jax.vjp(lambda *a: ffn.swiglu_ffn(*a, gs), x, wg, wu, wd)
        got = jax.block_until_ready(pullback(dy))
    assert only_ran(kernel, before)
    assert shape != "streamed" or g.nbytes > choice.stream_min_bytes()
    want_g, want_u = (np_gmm(x.astype(np.float64), w.astype(np.float64), sizes) for w in (wg, wu))
    tol = dict(rtol=1e-4, atol=1e-4 * np.sqrt(d))
    np.testing.assert_allclose(g, want_g, **tol)
    np.testing.assert_allclose(u, want_u, **tol)
    np.testing.assert_allclose(h, want_g / (1 + np.exp(-want_g)) * want_u, **tol)
    assert_matches_np_swiglu_ffn(y, got, x, wg, wu, wd, sizes, dy, floor=0.0)


def test_the_layer_runs_the_fused_ffn_on_cpu_unless_native_is_refused():
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
    with auto_scope(refused=frozenset({("native", None)})):
        refused = loss_and_grads(cfg).lower(params, x).as_text()
    # every grouped matmul ran tiled (the row gathers of permute and combine are not GEMMs)
    assert not any(t in refused for t in load.GEMM_HANDLERS)
    want = loss_and_grads(dataclasses.replace(cfg, gmm_backend="reference"))(params, x)
    got = loss_and_grads(cfg)(params, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6 * float(np.abs(b).max()) + 1e-7)


@pytest.mark.parametrize("form", ["scalar", "vector"])
def test_fast_exp_is_within_2_ulp_of_float64_and_keeps_nan(form):
    # the fused handlers' exp, one float at a time and a vector at a time (the vector form's
    # floor is a truncation corrected where it rounded up: off by one below 0 without it)
    import ctypes
    assert load.problem() is None
    lib = ctypes.CDLL(str(load.build()))
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
