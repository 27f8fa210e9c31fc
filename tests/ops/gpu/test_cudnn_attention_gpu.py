"""cuDNN's flash attention (ops/gpu/cudnn_attention.py; cudnn_thd.py) on an NVIDIA GPU, against
the float32 reference (ops/attention.py's XLA form) on the same bfloat16 inputs: outputs and
gradients no further from it than the XLA form computed in bfloat16 is; packed rows that never
see another document (MaxText issue 4476: a cuDNN path that ignored the segment ids); `auto`
choosing it and the program it lowers to holding cuDNN's fused attention. Skipped without a
GPU; the device check's tests section runs it (bench/gpu.py TEST_PATTERNS).

Legend: B batch, S sequence, H query heads, G key/value heads, K q/k head dim, V value head dim.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.ops import attention as att

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu",
                                reason="needs an NVIDIA GPU (cuDNN's flash attention)")

# name: (B, S, H, G, K, V)
CASES = {
    "deepseek3-1gpu": (2, 1024, 16, 16, 96, 64),     # MLA: K 64+32, V 64
    "deepseek-v3": (1, 512, 8, 8, 192, 128),         # MLA at DeepSeek-V3's head dims
    "qwen3-gqa": (1, 1024, 8, 2, 128, 128),          # 4 query heads a kv head
}


def _inputs(b, s, h, g, k, v, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    return (jax.random.normal(ks[0], (b, s, h, k), jnp.bfloat16),
            jax.random.normal(ks[1], (b, s, g, k), jnp.bfloat16),
            jax.random.normal(ks[2], (b, s, g, v), jnp.bfloat16),
            jax.random.normal(ks[3], (b, s, h, v), jnp.bfloat16))


def _segments(b, s):
    """Three documents a row, the second boundary off any tile edge, then padding (0)."""
    seg = np.zeros((b, s), np.int32)
    seg[:, : s // 3] = 1
    seg[:, s // 3: s - 37] = 2
    return jnp.asarray(seg)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _value_and_grads(kernel, q, k, v, cot, scale, seg, upcast=False, max_segments=32):
    def f(q, k, v):
        if upcast:
            q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
        out = att.causal_attention(q, k, v, scale, seg, kernel=kernel, max_segments=max_segments)
        return jnp.sum(out.astype(jnp.float32) * cot.astype(jnp.float32)), out
    (_, out), grads = jax.jit(jax.value_and_grad(f, (0, 1, 2), has_aux=True))(q, k, v)
    return out, grads


# each case once, packed or not, to stay inside the device check's time-boxed tests section
@pytest.mark.parametrize("name,packed", [("deepseek3-1gpu", True), ("deepseek-v3", False),
                                         ("qwen3-gqa", True)])
def test_cudnn_is_as_close_to_float32_as_xla_in_bfloat16(name, packed):
    b, s, h, g, k, v = CASES[name]
    q, kk, vv, cot = _inputs(b, s, h, g, k, v)
    scale, seg = 1 / np.sqrt(k), (_segments(b, s) if packed else None)
    assert att.chosen("auto", q, kk, vv, packed) == "cudnn"
    ref_out, ref_grads = _value_and_grads("xla", q, kk, vv, cot, scale, seg, upcast=True)
    bf_out, bf_grads = _value_and_grads("xla", q, kk, vv, cot, scale, seg)
    cu_out, cu_grads = _value_and_grads("cudnn", q, kk, vv, cot, scale, seg)
    assert cu_out.shape == (b, s, h, v) and cu_out.dtype == jnp.bfloat16
    assert _rel(cu_out, ref_out) <= 2 * _rel(bf_out, ref_out) + 2e-3
    for what, cu, bf, ref in zip("qkv", cu_grads, bf_grads, ref_grads):
        assert _rel(cu, ref) <= 2 * _rel(bf, ref) + 2e-3, what


# cudnn_thd (ops/gpu/cudnn_thd.py): MLA's dims unpadded; packed rows as segments (3 runs a row,
# max_segments 4) and, at max_segments 2, the batch that takes the masked form
@pytest.mark.parametrize("name,packed,most", [("deepseek3-1gpu", True, 4),
                                              ("deepseek3-1gpu", True, 2),
                                              ("deepseek-v3", False, 32)])
def test_cudnn_thd_is_as_close_to_float32_as_xla_in_bfloat16(name, packed, most):
    b, s, h, g, k, v = CASES[name]
    q, kk, vv, cot = _inputs(b, s, h, g, k, v)
    scale, seg = 1 / np.sqrt(k), (_segments(b, s) if packed else None)
    assert att.chosen("cudnn_thd", q, kk, vv, packed, most) == "cudnn_thd"
    ref_out, ref_grads = _value_and_grads("xla", q, kk, vv, cot, scale, seg, upcast=True)
    bf_out, bf_grads = _value_and_grads("xla", q, kk, vv, cot, scale, seg)
    cu_out, cu_grads = _value_and_grads("cudnn_thd", q, kk, vv, cot, scale, seg,
                                        max_segments=most)
    assert cu_out.shape == (b, s, h, v) and cu_out.dtype == jnp.bfloat16
    assert _rel(cu_out, ref_out) <= 2 * _rel(bf_out, ref_out) + 2e-3
    for what, cu, bf, ref in zip("qkv", cu_grads, bf_grads, ref_grads):
        assert _rel(cu, ref) <= 2 * _rel(bf, ref) + 2e-3, what


@pytest.mark.parametrize("kernel", ["cudnn", "cudnn_thd"])
def test_packed_rows_never_see_another_document(kernel):
    b, s, h, g, k, v = CASES["deepseek3-1gpu"]
    q, kk, vv, _ = _inputs(b, s, h, g, k, v)
    seg = _segments(b, s)
    first = np.asarray(seg) == 1
    # the first document's keys and values replaced: the others' outputs may not move
    kk2 = jnp.where(first[:, :, None, None], kk * 3 + 1, kk)
    vv2 = jnp.where(first[:, :, None, None], vv * -2, vv)
    run = jax.jit(lambda q, k, v: att.causal_attention(q, k, v, 0.1, seg, kernel=kernel))
    a, bb = np.asarray(run(q, kk, vv), np.float32), np.asarray(run(q, kk2, vv2), np.float32)
    np.testing.assert_array_equal(a[~first], bb[~first])
    assert not np.array_equal(a[first], bb[first])


def test_auto_lowers_to_cudnns_fused_attention():
    q, kk, vv, _ = _inputs(*CASES["deepseek3-1gpu"])
    lowered = jax.jit(lambda q, k, v: att.causal_attention(q, k, v, 0.1)).lower(q, kk, vv)
    assert "__cudnn$fmha" in lowered.as_text()
    lowered.compile()
