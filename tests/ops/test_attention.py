"""The attention core (ops/attention.py) against a float64 loop over queries, and the cuDNN
form's arrangement (ops/gpu/cudnn_attention.py: padded head dims, the segment mask, grouped
kv heads) run on jax's XLA path off the GPU; the rule that says where cuDNN runs; the one-line
refusals. On a GPU, tests/ops/gpu/test_cudnn_attention_gpu.py runs cuDNN itself.

Legend: B batch, S sequence, H query heads, G key/value heads, K q/k head dim, V value head dim.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.config import ModelConfig
from dropless.config.names import ATTENTION_KERNELS
from dropless.ops import attention as att
from dropless.ops.gpu import cudnn_attention as cudnn


def loop_attention(q_BSHK, k_BSGK, v_BSGV, scale, seg_BS=None) -> np.ndarray:
    """For each row, query and head: softmax over the keys it may see (causal, same segment),
    in float64; query head h reads key/value head h // (H / G)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q_BSHK, k_BSGK, v_BSGV))
    b, s, h, _ = q.shape
    rep = h // k.shape[2]
    out = np.zeros((b, s, h, v.shape[-1]))
    for bi in range(b):
        for i in range(s):
            seen = [j for j in range(i + 1)
                    if seg_BS is None or seg_BS[bi][j] == seg_BS[bi][i]]
            for hi in range(h):
                logits = np.array([q[bi, i, hi] @ k[bi, j, hi // rep] for j in seen]) * scale
                p = np.exp(logits - logits.max())
                p /= p.sum()
                out[bi, i, hi] = sum(pj * v[bi, j, hi // rep] for pj, j in zip(p, seen))
    return out


# (H, G, K, V): multi-head, grouped-query (2 query heads a kv head), MLA-like K > V, K < V
SHAPES = [(2, 2, 8, 8), (4, 2, 8, 8), (2, 2, 12, 8), (2, 2, 8, 16)]
# two rows: three documents (the last a padding segment 0) and one document
SEGMENTS = np.array([[1, 1, 1, 2, 2, 2, 2, 0], [3, 3, 3, 3, 3, 3, 3, 3]], np.int32)


def _operands(h, g, k, v, seed=0, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(ks[0], (2, 8, h, k), dtype),
            jax.random.normal(ks[1], (2, 8, g, k), dtype),
            jax.random.normal(ks[2], (2, 8, g, v), dtype))


def test_the_kernel_names_are_the_configs():
    assert att.KERNELS == ATTENTION_KERNELS


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("segments", [False, True])
def test_the_reference_is_the_loop(shape, segments):
    q, k, v = _operands(*shape)
    seg = jnp.asarray(SEGMENTS) if segments else None
    got = att.causal_attention(q, k, v, 0.3, seg, kernel="xla")
    np.testing.assert_allclose(got, loop_attention(q, k, v, 0.3, SEGMENTS if segments else None),
                               rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("segments", [False, True])
def test_the_cudnn_arrangement_gives_the_reference_values_and_gradients(shape, segments):
    """What the cuDNN form hands jax.nn.dot_product_attention (zero-padded head dims, the
    boolean segment mask beside is_causal, G kv heads as they are), run on jax's XLA path:
    the reference's outputs and gradients. A leak across a document boundary (MaxText issue
    4476) or a padded column left in would show here."""
    q, k, v = _operands(*shape)
    seg = jnp.asarray(SEGMENTS) if segments else None
    cot = jax.random.normal(jax.random.key(9), q.shape[:3] + (v.shape[-1],))

    def loss(fn, q, k, v):
        return jnp.sum(fn(q, k, v) * cot)
    ref = lambda q, k, v: att.causal_attention_xla(q, k, v, 0.3, seg)  # noqa: E731
    arranged = lambda q, k, v: cudnn.causal_attention(q, k, v, 0.3, seg,  # noqa: E731
                                                      implementation="xla")
    np.testing.assert_allclose(arranged(q, k, v), ref(q, k, v), rtol=1e-6, atol=1e-6)
    for got, want in zip(jax.grad(lambda *a: loss(arranged, *a), (0, 1, 2))(q, k, v),
                         jax.grad(lambda *a: loss(ref, *a), (0, 1, 2))(q, k, v)):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


H100 = dict(backend=None, capability=(9, 0), cudnn=(9, 19, 0), dtypes=("bfloat16",) * 3,
            k_dim=96, v_dim=64, seq_len=4096, segments=True)


@pytest.mark.parametrize("change,why", [
    ({}, None),                                            # deepseek3-1gpu on an H100
    ({"k_dim": 192, "v_dim": 128}, None),                  # DeepSeek-V3's MLA
    ({"dtypes": ("float16",) * 3}, None),
    ({"backend": "cpu"}, "needs an NVIDIA GPU; jax's default backend here is 'cpu'"),
    ({"backend": "rocm"}, "needs an NVIDIA GPU; jax's default backend here is 'rocm'"),
    ({"dtypes": ("float32",) * 3}, "takes bfloat16 or float16 q, k, v, not float32"),
    ({"dtypes": ("bfloat16", "bfloat16", "float32")}, "takes bfloat16 or float16"),
    ({"capability": (7, 5)}, "needs compute capability >= 8.0; this GPU has (7, 5)"),
    ({"capability": (8, 0), "k_dim": 192, "v_dim": 128},
     "multiples of 8 up to 128 on sm_80; these are 192 (q, k) and 128 (v)"),
    ({"k_dim": 264, "v_dim": 128}, "multiples of 8 up to 256 on sm_90"),
    ({"k_dim": 100}, "multiples of 8 up to 256 on sm_90; these are 100 (q, k) and 64 (v)"),
    ({"cudnn": None}, "no cuDNN library found in this process"),
    ({"seq_len": 4095}, "with packed rows (a segment mask) needs an even sequence; this one "
                        "is 4095"),
    ({"seq_len": 4095, "segments": False}, None),
])
def test_where_cudnn_runs(change, why):
    got = cudnn.problem_for(**{**H100, **change})
    assert got is None if why is None else why in got, got


def test_cudnn_asked_for_where_it_cannot_run_is_refused_in_one_line():
    q, k, v = _operands(2, 2, 8, 8)
    with pytest.raises(att.KernelUnavailable) as e:
        att.causal_attention(q, k, v, 0.3, kernel="cudnn")
    assert str(e.value) == ("model.attention_kernel=cudnn: cuDNN flash attention needs an "
                            f"NVIDIA GPU; jax's default backend here is "
                            f"{jax.default_backend()!r}; use auto or xla")
    with pytest.raises(att.KernelUnavailable, match=r"model.attention_kernel='flash' is not one "
                                                    r"of \['auto', 'xla', 'cudnn', 'cudnn_thd'\]"):
        att.causal_attention(q, k, v, 0.3, kernel="flash")
    with pytest.raises(ValueError, match=r"q \(2, 8, 3, 8\), k \(2, 8, 2, 8\).* with H a "
                                         "multiple of G"):
        att.causal_attention(q[:, :, :1].repeat(3, 2), k, v, 0.3)


def test_auto_is_the_reference_off_the_gpu():
    q, k, v = _operands(4, 2, 12, 8)
    assert att.chosen("auto", q, k, v, segments=True) == "xla"
    assert (att.causal_attention(q, k, v, 0.3, jnp.asarray(SEGMENTS))
            == att.causal_attention_xla(q, k, v, 0.3, jnp.asarray(SEGMENTS))).all()


def test_auto_where_cudnn_takes_the_operands_is_chosen_when_lowered(monkeypatch):
    """Where cuDNN takes the operands, auto puts both forms under one platform_dependent: the
    CUDA branch is the cuDNN form and every other platform runs the reference."""
    marker, real = [], cudnn.causal_attention
    monkeypatch.setattr(cudnn, "problem", lambda *a, **k: None)

    def fake_cudnn(q, k, v, scale, seg=None):
        marker.append("traced")
        return real(q, k, v, scale, seg, implementation="xla") * 2
    monkeypatch.setattr(cudnn, "causal_attention", fake_cudnn)
    q, k, v = _operands(2, 2, 8, 8)
    assert att.chosen("auto", q, k, v) == "cudnn"
    jaxpr = jax.make_jaxpr(lambda q, k, v: att.causal_attention(q, k, v, 0.3))(q, k, v)
    assert "platform_index" in str(jaxpr) and marker == ["traced"]
    got = att.causal_attention(q, k, v, 0.3)   # on this CPU: the default branch
    np.testing.assert_array_equal(got, att.causal_attention_xla(q, k, v, 0.3))


def test_the_config_names_the_field_for_an_unknown_kernel():
    with pytest.raises(ValueError, match="attention_kernel"):
        ModelConfig(vocab_size=8, d_model=8, num_layers=1, num_heads=2, d_ff=8,
                    attention_kernel="flash")
