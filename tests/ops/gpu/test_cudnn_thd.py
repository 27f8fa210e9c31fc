"""ops/gpu/cudnn_thd.py without a GPU: the segment layout against a per-row loop; the attention
that layout describes (each listed run attended causally on its own, as jax documents its
packed form) equal to the masked reference wherever a row holds at most M runs; the form
lowering for CUDA, forward and backward, to cuDNN's fused attention with MLA's value head dim
unpadded and, for packed rows, no S x S mask outside the branch a batch of too many runs takes;
and each refusal in one line. jax's device and cuDNN questions are answered as on an H100 with
cuDNN 9.19 (the GPU image's), as in test_cudnn_attention_lowering.py. On a GPU,
test_cudnn_attention_gpu.py runs the kernel itself.

Legend: B batch, S sequence, H query heads, G key/value heads, K q/k head dim, V value head dim,
M runs a row may hold.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.ops import attention as att
from dropless.ops.gpu import cudnn_attention as cudnn
from dropless.ops.gpu import cudnn_thd
from tests._support.cudnn_h100 import (bf16_operands, cuda_text, cudnn_calls,
                                       h100)  # noqa: F401 (a fixture)

fused = pytest.importorskip("jax._src.cudnn.fused_attention_stablehlo")


def _runs(row):
    """[(start, length)] of the row's runs of equal values, by a loop."""
    out, start = [], 0
    for i in range(1, len(row) + 1):
        if i == len(row) or row[i] != row[start]:
            out.append((start, i - start))
            start = i
    return out


ROWS = {
    "one document": [5] * 16,
    "documents then padding": [1] * 5 + [2] * 7 + [0] * 4,
    "every token its own": list(range(1, 17)),
    "more runs than M": [1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8],
    "exactly M runs": [1] * 4 + [2] * 4 + [3] * 4 + [4] * 4,
}


@pytest.mark.parametrize("m", [2, 4, 6])
def test_segment_layout_lists_each_rows_runs(m):
    seg = jnp.asarray(list(ROWS.values()), jnp.int32)
    offsets, lengths, runs = (np.asarray(a) for a in cudnn_thd.segment_layout(seg, m))
    assert offsets.shape == (len(ROWS), m + 1) and lengths.shape == (len(ROWS), m)
    for r, row in enumerate(ROWS.values()):
        want = _runs(row)
        assert runs[r] == len(want)
        n = min(len(want), m)
        assert offsets[r, :n].tolist() == [a for a, _ in want[:n]]
        assert lengths[r, :n].tolist() == [b for _, b in want[:n]]
        assert (offsets[r, n:] == -1).all() and (lengths[r, n:] == -1).all()


def _by_segments(q, k, v, scale, offsets, lengths):
    """The attention jax's packed form describes, by a loop: each listed run of each row
    attended causally on its own (the reference form on the run's slice)."""
    out = np.zeros(q.shape[:3] + (v.shape[-1],), np.float32)
    for b in range(q.shape[0]):
        for a, n in zip(offsets[b], lengths[b]):
            if n < 0:
                continue
            sl = slice(int(a), int(a + n))
            out[b, sl] = att.causal_attention_xla(q[b:b + 1, sl], k[b:b + 1, sl],
                                                  v[b:b + 1, sl], scale)[0]
    return out


def test_the_layout_describes_the_masked_attention():
    # MLA's head dims and grouped heads; rows of 1, 3 and 4 runs, padding among them
    b, s, h, g, kd, vd = 3, 16, 4, 2, 12, 8
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (b, s, h, kd), jnp.float32)
    k = jax.random.normal(ks[1], (b, s, g, kd), jnp.float32)
    v = jax.random.normal(ks[2], (b, s, g, vd), jnp.float32)
    seg = jnp.asarray([ROWS["one document"], ROWS["documents then padding"],
                       ROWS["exactly M runs"]], jnp.int32)
    offsets, lengths, runs = (np.asarray(a) for a in cudnn_thd.segment_layout(seg, 4))
    assert (runs <= 4).all()
    rep = h // g
    want = att.causal_attention_xla(q, k, v, 0.3, seg)
    got = _by_segments(q, jnp.repeat(k, rep, 2), jnp.repeat(v, rep, 2), 0.3, offsets, lengths)
    np.testing.assert_allclose(got, np.asarray(want), rtol=1e-5, atol=1e-6)


# (H, G, K, V)
@pytest.mark.parametrize("shape", [(16, 16, 96, 64), (8, 2, 128, 128)])
@pytest.mark.parametrize("packed", [False, True])
def test_the_form_lowers_forward_and_backward(h100, shape, packed):
    (h, g, k, v), (b, s) = shape, (2, 256)
    q, kk, vv, seg = bf16_operands(shape, packed, b, s)
    assert att.chosen("cudnn_thd", q, kk, vv, packed, 8) == "cudnn_thd"

    def loss(q, kk, vv):
        return jnp.sum(att.causal_attention(q, kk, vv, 0.1, seg, kernel="cudnn_thd",
                                            max_segments=8).astype(jnp.float32))
    text = cuda_text(jax.grad(loss, (0, 1, 2)), q, kk, vv)
    segment_form = {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"}
    if not packed:
        assert cudnn_calls(text) == segment_form
        # the value head dim as it is (the cudnn form pads it to K: a stablehlo.pad)
        assert "stablehlo.pad" not in text
        if k != v:
            ref = cuda_text(jax.grad(lambda q, kk, vv: jnp.sum(att.causal_attention(
                q, kk, vv, 0.1, kernel="cudnn").astype(jnp.float32)), (0, 1, 2)), q, kk, vv)
            assert "stablehlo.pad" in ref
        return
    # the segment form, and, in the branch of a batch with a row of more than M runs, the
    # cudnn kernel's masked form: the only S x S tensor is that branch's mask
    assert cudnn_calls(text) == segment_form | {"__cudnn$fmhaScaleBiasSoftmax",
                                           "__cudnn$fmhaScaleBiasSoftmaxBackward"}
    assert "stablehlo.case" in text or "stablehlo.if" in text


def test_a_model_lowered_for_cuda_runs_the_segment_form_in_every_layer(h100):
    from dropless.models import decoder
    from dropless.presets import get_preset
    cfg = get_preset("deepseek3-test").replace(dtype="bfloat16", moe=None, first_k_dense=0,
                                               attention_kernel="cudnn_thd",
                                               max_segments_per_seq=4)
    params = decoder.init_params(jax.random.key(0), cfg)
    tokens, seg = jnp.zeros((2, 64), jnp.int32), jnp.ones((2, 64), jnp.int32)
    text = cuda_text(lambda p, t: decoder.forward(p, t, cfg, segment_ids_BS=seg), params, tokens)
    assert len(re.findall(r"__cudnn\$fmhaSoftmax\(", text)) == cfg.num_layers
    # the model's bound reaches the layout: offsets [B, M + 1]
    assert "tensor<2x5xi32>" in text


@pytest.mark.parametrize("setup, words", [
    (lambda mp: mp.setattr(cudnn, "_gpu", lambda: (None, (8, 0))),
     "needs compute capability >= 9.0; this GPU has (8, 0)"),
    (lambda mp: mp.setattr(cudnn, "cudnn_version", lambda: (9, 8, 0)),
     "needs cuDNN >= 9.10; this process loads 9.8.0"),
    (lambda mp: mp.setattr(cudnn_thd, "_binding", lambda: None),
     "this jax has no jax._src.cudnn.fused_attention_stablehlo.dot_product_attention"),
])
def test_what_cannot_run_is_refused_in_one_line_and_auto_is_unchanged(h100, monkeypatch,
                                                                       setup, words):
    setup(monkeypatch)
    q = jnp.zeros((1, 64, 2, 64), jnp.bfloat16)
    with pytest.raises(att.KernelUnavailable) as e:
        att.chosen("cudnn_thd", q, q, q, True)
    msg = str(e.value)
    assert msg.startswith("model.attention_kernel=cudnn_thd: ") and words in msg, msg
    assert msg.endswith("; use auto or xla") and "\n" not in msg


def test_off_a_gpu_it_is_refused_and_the_config_holds_its_bound():
    q = jnp.zeros((1, 64, 2, 64), jnp.bfloat16)
    with pytest.raises(att.KernelUnavailable, match="needs an NVIDIA GPU"):
        att.causal_attention(q, q, q, 0.1, kernel="cudnn_thd")
    from dropless.presets import get_preset
    cfg = get_preset("deepseek3-test")
    for bad in (1, 0, 2.5):
        with pytest.raises(ValueError, match=rf"^ModelConfig.max_segments_per_seq={bad!r} "
                                             r"must be an int"):
            cfg.replace(max_segments_per_seq=bad)
