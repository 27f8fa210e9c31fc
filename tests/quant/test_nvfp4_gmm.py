"""The NVFP4 grouped matmul against a slow per-group reference built on the NumPy quantizer
(forward, dx, dw), the recipe options, reproducible stochastic rounding, the MoE seam and the
config validation.

Legend: M rows sorted by group, K contraction dim, N output dim, G groups, P group-aligned rows.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless import MoEConfig
from dropless.config_file import build_config
from dropless.moe import experts
from dropless.quant import NVFP4Config, nvfp4_grouped_matmul
from dropless.quant import nvfp4 as nv
from dropless.quant import nvfp4_gmm as ng
from tests._support import nvfp4_numpy_reference as ref

M, K, N = 40, 32, 24
SIZES = np.array([9, 0, 25])        # an empty expert, a group that is not a multiple of 16,
# and 6 rows past the sum


@pytest.fixture(scope="module")
def operands():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = (rng.standard_normal((3, K, N)) / 6).astype(np.float32)
    dy = rng.standard_normal((M, N)).astype(np.float32)
    return x, w, dy


@functools.lru_cache(maxsize=None)
def _compiled(cfg: NVFP4Config):
    """(x, w, dy, counter) -> (out, dx, dw), jitted once per config."""
    @jax.jit
    def f(x, w, dy, c):
        gs = jnp.asarray(SIZES, jnp.int32)
        out, pull = jax.vjp(lambda a, b: nvfp4_grouped_matmul(a, b, gs, config=cfg, counter=c),
                            x, w)
        return (out, *pull(dy))
    return f


def _run(cfg, x, w, dy, counter=0):
    """(out, dx, dw) of the NVFP4 grouped matmul."""
    return [np.asarray(a) for a in _compiled(cfg)(x, w, dy, jnp.uint32(counter))]


def _rows(x, tensor_scale, bits=None):
    return ref.dequantize_rows(*ref.quantize_rows(x, tensor_scale, bits))


def _weights_for(w, cfg, axis):
    """Dequantized w [G, K, N] blocked for the matmul that contracts over `axis` (1: K, 2: N)."""
    if cfg.weight_blocks == "2d":
        return ref.dequantize_tiles(*ref.quantize_tiles(w, cfg.tensor_scale))
    wt = np.moveaxis(w, axis, 2)               # blocked axis last
    g, a, b = wt.shape
    v = _rows(wt.reshape(g * a, b), cfg.tensor_scale).reshape(g, a, b)
    return np.moveaxis(v, 2, axis)


def reference(cfg: NVFP4Config, x, w, dy, counter=0):
    """out, dx, dw from the NumPy quantizer and float64 per-group loops."""
    starts = np.concatenate([[0], np.cumsum(SIZES)[:-1]])
    xq = _rows(x, cfg.tensor_scale)
    wq = _weights_for(w, cfg, 1)
    dy_bits = (np.asarray(ng.sr_bits(cfg.seed, jnp.uint32(counter), jnp.asarray(dy),
                                     ng.TAG_DGRAD)) if cfg.stochastic_rounding else None)
    dyq = _rows(dy, cfg.tensor_scale, dy_bits)
    wq_n = _weights_for(w, cfg, 2)
    out, dx = np.zeros((M, N)), np.zeros((M, K))
    for g, (s, n) in enumerate(zip(starts, SIZES)):
        out[s:s + n] = xq[s:s + n] @ wq[g]
        dx[s:s + n] = dyq[s:s + n] @ wq_n[g].T
    # weight gradient: group-aligned rows (zero-padded to the layout's static size), Hadamard,
    # 16-row blocks along the rows
    xa, padded = ref.aligned_rows(x, SIZES)
    dya, _ = ref.aligned_rows(dy, SIZES)
    p = 16 * -(-(M + 15 * len(SIZES)) // 16)
    xa = np.concatenate([xa, np.zeros((p - len(xa), K), np.float32)])
    dya = np.concatenate([dya, np.zeros((p - len(dya), N), np.float32)])
    if cfg.rht:
        signs = np.sign(np.asarray(nv.hadamard_matrix(cfg.seed))[0])
        xa, dya = ref.hadamard_rows(xa, signs), ref.hadamard_rows(dya, signs)
    wg_bits = (np.asarray(ng.sr_bits(cfg.seed, jnp.uint32(counter), jnp.asarray(dya),
                                     ng.TAG_WGRAD)) if cfg.stochastic_rounding else None)
    xaq = _rows(xa.T, cfg.tensor_scale).T
    dyaq = _rows(dya.T, cfg.tensor_scale, None if wg_bits is None else wg_bits.T).T
    dw = np.zeros(w.shape)
    pstarts = np.concatenate([[0], np.cumsum(padded)[:-1]])
    for g, (s, n) in enumerate(zip(pstarts, padded)):
        dw[g] = xaq[s:s + n].T @ dyaq[s:s + n]
    return out, dx, dw


def _close(got, want, rtol):
    err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
    assert err <= rtol, f"relative error {err:.3g} > {rtol}"


def test_recipe_matches_the_reference(operands):
    """2d weights, tensor scales, SR on dy (the Hadamard transform is covered below): equal to
    the reference up to float32 accumulation, the tail rows zero."""
    cfg = NVFP4Config(backend="ragged_dot", rht=False)
    x, w, dy = operands
    got = _run(cfg, x, w, dy, counter=3)
    want = reference(cfg, x, w, dy, counter=3)
    for g, r in zip(got, want):
        _close(g, r, 1e-6)
    assert not got[0][sum(SIZES):].any() and not got[1][sum(SIZES):].any()
    assert not got[2][1].any()                  # the empty expert's weight gradient


def test_hadamard_1d_weights_no_tensor_scale_no_sr(operands):
    cfg = NVFP4Config(backend="tiled", weight_blocks="1d", tensor_scale=False, rht=True,
                      stochastic_rounding=False)
    x, w, dy = operands
    got = _run(cfg, x, w, dy)
    want = reference(cfg, x, w, dy)
    _close(got[0], want[0], 1e-6)
    _close(got[1], want[1], 1e-6)
    # the transform is float32 sums in XLA and float64-then-float32 in the reference: a last-
    # bit difference can move a value across a rounding boundary, so dw is equal to rounding
    _close(got[2], want[2], 2e-3)


def test_full_recipe_is_reproducible_and_near_exact(operands):
    cfg = NVFP4Config(backend="ragged_dot")
    x, w, dy = operands
    a, b, c = _run(cfg, x, w, dy, counter=1), _run(cfg, x, w, dy, counter=1), \
        _run(cfg, x, w, dy, counter=2)
    for u, v in zip(a, b):
        np.testing.assert_array_equal(u, v)
    np.testing.assert_array_equal(a[0], c[0])    # the forward has no randomness
    assert not np.array_equal(a[2], c[2])        # another counter, other rounding draws
    starts = np.concatenate([[0], np.cumsum(SIZES)[:-1]])
    dw = np.stack([x[s:s + n].T.astype(np.float64) @ dy[s:s + n]
                   for s, n in zip(starts, SIZES)])
    _close(a[2], dw, 0.3)                        # 4-bit operands: ~15% per matmul


def test_the_moe_seam_uses_the_nvfp4_options():
    cfg = MoEConfig(num_experts=3, top_k=1, d_model=K, d_ff=N, gmm_backend="ragged_dot",
                    gmm_quantization="nvfp4", nvfp4_rht=False, nvfp4_weight_blocks="1d")
    fn = experts.gmm_for(cfg)
    assert fn.keywords["config"] == NVFP4Config(backend="ragged_dot", rht=False,
                                                weight_blocks="1d")


def test_bad_options_name_the_key():
    for kw, key in ((dict(nvfp4_weight_blocks="3d"), "nvfp4_weight_blocks"),
                    (dict(nvfp4_rht="yes"), "nvfp4_rht"), (dict(nvfp4_seed=-1), "nvfp4_seed"),
                    (dict(gmm_quantization="nvfp8"), "gmm_quantization")):
        with pytest.raises(ValueError, match=f"MoEConfig.{key}="):
            MoEConfig(num_experts=4, top_k=2, d_model=16, d_ff=16, **kw)
    with pytest.raises(ValueError, match="nvfp4_weight_blocks"):
        build_config([("model.moe.nvfp4_weight_blocks", "3d")])
    for kw, key in ((dict(weight_blocks="3d"), "weight_blocks"), (dict(rht=1), "rht"),
                    (dict(seed=2 ** 32), "seed"), (dict(backend="loop"), "backend"),
                    (dict(compute_dtype="float16"), "compute_dtype")):
        with pytest.raises(ValueError, match=f"NVFP4Config.{key}="):
            NVFP4Config(**kw)
