"""The MXFP8 grouped matmul: forward and both gradients against dequantize-then-matmul, where
the dequantized operands come from the plain-NumPy OCP MX reference and the matmuls are a
per-group float64 loop.

Legend: M rows sorted by group, K contraction dim, N output dim, G groups, D model, F hidden.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests._support import mx_numpy_reference as ref
from dropless import MoEConfig
from dropless.moe import layer
from dropless.quant import MXFP8Config, mxfp8_grouped_matmul, quantized_gmm

SIZES = [1, 31, 33, 44, 0]
M, K, N = 120, 40, 24  # K, N not multiples of 32; 11 rows past sum(SIZES)


def operands(seed=0, m=M, k=K, n=N, g=len(SIZES)):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((g, k, n)).astype(np.float32)
    dy = rng.standard_normal((m, n)).astype(np.float32)
    return x, w, dy


def ref_gmm_and_grads(x_MK, w_GKN, dy_MN, sizes, fwd="e4m3", grad="e4m3", rounding="floor"):
    """Forward and VJP of the MXFP8 gmm by dequantize-then-matmul with the NumPy reference."""
    m = x_MK.shape[0]
    xq_row = ref.fake_quantize(x_MK, 1, fwd, rounding)
    dyq_row = ref.fake_quantize(dy_MN, 1, grad, rounding)
    xq_col = ref.fake_quantize_grouped(x_MK, sizes, fwd, rounding)
    dyq_col = ref.fake_quantize_grouped(dy_MN, sizes, grad, rounding)
    out = np.zeros((m, w_GKN.shape[2]))
    dx = np.zeros(x_MK.shape)
    dw = np.zeros(w_GKN.shape)
    for g, (s, e) in enumerate(ref.grouped_parts(sizes, m)[:-1]):
        w_along_k = ref.fake_quantize(w_GKN[g], 0, fwd, rounding)     # blocks along K
        w_along_n = ref.fake_quantize(w_GKN[g], 1, fwd, rounding)     # blocks along N
        out[s:e] = xq_row[s:e] @ w_along_k
        dx[s:e] = dyq_row[s:e] @ w_along_n.T
        dw[g] = xq_col[s:e].T @ dyq_col[s:e]
    return out, dx, dw


def run(x, w, dy, sizes, config):
    """(out, dx, dw) as float64, forward and VJP compiled as one function."""
    @jax.jit
    def f(x, w, gs, dy):
        out, pullback = jax.vjp(lambda x, w: mxfp8_grouped_matmul(x, w, gs, config=config), x, w)
        return (out, *pullback(dy.astype(out.dtype)))
    got = f(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes, jnp.int32), jnp.asarray(dy))
    return tuple(np.asarray(a, np.float64) for a in got)


def assert_close(got, want, what):
    # exact products, float32 accumulation in a different order: ~1e-6 relative to the scale
    tol = 2e-5 * max(np.abs(want).max(), 1.0)
    np.testing.assert_allclose(got, want, rtol=0, atol=tol, err_msg=what)


@pytest.mark.parametrize("backend", ["tiled", "ragged_dot", "reference", "padded"])
def test_forward_and_grads_match_dequantize_then_matmul(backend):
    x, w, dy = operands()
    got = run(x, w, dy, SIZES, MXFP8Config(backend=backend))
    want = ref_gmm_and_grads(x, w, dy, SIZES)
    for g, r, what in zip(got, want, ("out", "dlhs", "drhs")):
        assert_close(g, r, f"{backend}: {what}")
    assert not got[0][sum(SIZES):].any() and not got[1][sum(SIZES):].any()


@pytest.mark.parametrize("grad,rounding,compute",
                         [("e5m2", "floor", "bfloat16"), ("e4m3", "up", "float32")])
def test_options_e5m2_gradients_round_up_scales(grad, rounding, compute):
    x, w, dy = operands(1)
    dy = dy * 1e3  # gradients with range: e5m2 and e4m3 codes differ
    cfg = MXFP8Config(backend="ragged_dot", grad_elem=grad, scale_rounding=rounding,
                      compute_dtype=compute)
    got = run(x, w, dy, SIZES, cfg)
    want = ref_gmm_and_grads(x, w, dy, SIZES, grad=grad, rounding=rounding)
    for g, r, what in zip(got, want, ("out", "dlhs", "drhs")):
        assert_close(g, r, what)


def test_drhs_blocks_restart_at_group_boundaries():
    # rows of group 0 are huge, group 1 tiny: a block straddling the boundary at row 20 would
    # flush group 1's rows to zero and its weight gradient with them
    x, w, dy = operands(2, m=40, g=2)
    x[:20] *= 2.0 ** 20
    sizes = [20, 20]
    _, _, dw = run(x, w, dy, sizes, MXFP8Config(backend="ragged_dot"))
    want_dw = ref_gmm_and_grads(x, w, dy, sizes)[2]
    assert_close(dw[1], want_dw[1], "drhs of the small group")
    exact = x[20:].T.astype(np.float64) @ dy[20:]
    assert np.linalg.norm(dw[1] - exact) / np.linalg.norm(exact) < 0.1


def test_error_on_standard_normal_is_within_5_percent_of_f32():
    x, w, _ = operands(3, m=256, k=256, n=128, g=4)
    sizes = [64, 100, 0, 92]
    f = jax.jit(lambda x, w, gs: mxfp8_grouped_matmul(x, w, gs, config=MXFP8Config(
        backend="ragged_dot")))
    out = np.asarray(f(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes)))
    exact = np.zeros_like(out, np.float64)
    for g, (s, e) in enumerate(ref.grouped_parts(sizes, 256)[:-1]):
        exact[s:e] = x[s:e].astype(np.float64) @ w[g]
    assert np.linalg.norm(out - exact) / np.linalg.norm(exact) < 0.05


def test_bfloat16_operands_keep_their_dtypes():
    x, w, dy = operands(4)
    xb, wb = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    gs = jnp.asarray(SIZES)
    f = lambda x, w: mxfp8_grouped_matmul(x, w, gs, config=MXFP8Config(backend="ragged_dot"))

    @jax.jit
    def fwd_bwd(x, w, d):
        out, pullback = jax.vjp(f, x, w)
        return (out, *pullback(d))
    out, dx, dw = fwd_bwd(xb, wb, jnp.asarray(dy, jnp.bfloat16))
    assert (out.dtype, dx.dtype, dw.dtype) == (jnp.bfloat16,) * 3
    want = ref_gmm_and_grads(np.asarray(xb, np.float32), np.asarray(wb, np.float32),
                             np.asarray(jnp.asarray(dy, jnp.bfloat16), np.float32), SIZES)
    for g, r in zip((out, dx, dw), want):
        np.testing.assert_allclose(np.asarray(g, np.float64), r, rtol=0,
                                   atol=1e-2 * np.abs(r).max())


def test_empty_inputs():
    out = mxfp8_grouped_matmul(jnp.zeros((0, 8)), jnp.ones((2, 8, 4)), jnp.array([0, 0]))
    assert out.shape == (0, 4)


def tiny_moe(**kw):
    return MoEConfig(num_experts=4, top_k=2, d_model=32, d_ff=40, **kw)


def test_moe_layer_with_mxfp8_is_close_to_unquantized_and_trains():
    cfg = tiny_moe(gmm_backend="ragged_dot")  # the seam is the point here; tiled is tested above
    qcfg = cfg.replace(gmm_quantization="mxfp8")
    params = layer.init_params(jax.random.key(0), cfg)
    x = jax.random.normal(jax.random.key(1), (2, 24, 32))

    def loss(p, c):
        y = layer.apply(p, x, c)[0]
        return jnp.mean(y ** 2), y
    # the output and the gradients from one compiled function per config
    grad = jax.jit(jax.grad(loss, has_aux=True), static_argnums=1)
    (g, y), (gq, yq) = grad(params, cfg), grad(params, qcfg)
    assert float(jnp.linalg.norm(yq - y) / jnp.linalg.norm(y)) < 0.1
    g, gq = g["experts"], gq["experts"]
    for name in g:
        rel = float(jnp.linalg.norm(gq[name] - g[name]) / jnp.linalg.norm(g[name]))
        assert rel < 0.2, (name, rel)


def test_quantized_gmm_wraps_the_configured_backend():
    f = quantized_gmm(tiny_moe(gmm_backend="ragged_dot", gmm_quantization="mxfp8"),
                      MXFP8Config(grad_elem="e5m2"))
    assert f.keywords["config"] == MXFP8Config(backend="ragged_dot", grad_elem="e5m2")


def test_bad_configs_name_field_and_value():
    with pytest.raises(ValueError, match="gmm_quantization='none'"):
        quantized_gmm(tiny_moe())
    for field, value in (("fwd_elem", "e2m1"), ("grad_elem", "int8"),
                         ("scale_rounding", "nearest"), ("compute_dtype", "float16"),
                         ("backend", "cublas"), ("backend", "loop")):
        with pytest.raises(ValueError, match=f"MXFP8Config.(backend|{field})"):
            MXFP8Config(**{field: value})
    with pytest.raises(ValueError, match="lhs must be floating"):
        mxfp8_grouped_matmul(jnp.ones((4, 8), jnp.int32), jnp.ones((1, 8, 2)), jnp.array([4]))
    with pytest.raises(ValueError, match="lhs K=8 does not match"):
        mxfp8_grouped_matmul(jnp.ones((4, 8)), jnp.ones((1, 9, 2)), jnp.array([4]))
    assert dataclasses.is_dataclass(MXFP8Config)


def test_moe_config_mx_options_reach_the_quantized_gmm():
    import functools
    from dropless import MoEConfig
    from dropless.quant import quantized_gmm
    cfg = MoEConfig(num_experts=4, top_k=2, d_model=32, d_ff=32, gmm_quantization="mxfp8",
                    mx_scale_rounding="up", mx_grad_elem="e5m2")
    fn = quantized_gmm(cfg)
    assert isinstance(fn, functools.partial)
    assert fn.keywords["config"].scale_rounding == "up"
    assert fn.keywords["config"].grad_elem == "e5m2"
    with pytest.raises(ValueError, match="MoEConfig.mx_scale_rounding='ceil'"):
        MoEConfig(num_experts=4, top_k=2, d_model=32, d_ff=32, mx_scale_rounding="ceil")
