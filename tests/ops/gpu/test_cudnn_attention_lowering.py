"""cuDNN's flash attention as jax's own binding checks and lowers it, without a GPU: the cuDNN
form's operands (zero-padded head dims, the segment mask, G kv heads) pass jax's layout and
flash-attention checks and lower, forward and backward, to cuDNN's fused-attention custom calls
for CUDA, and a model lowered for CUDA with `auto` attention holds those calls and no
materialised S x S scores. jax asks the device for its compute capability and the loaded cuDNN
for its version when it traces; here they are answered as an H100 with cuDNN 9.19 would answer
(the GPU image's cuDNN). Runs in the main suite and in both GPU-leg venvs (Makefile GPU_TESTS);
on a GPU, test_cudnn_attention_gpu.py runs the kernel itself.

Legend: B batch, S sequence, H query heads, G key/value heads, K q/k head dim, V value head dim.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from dropless.ops import attention as att
from tests._support.cudnn_h100 import (bf16_operands, cuda_text, cudnn_calls,
                                       h100)  # noqa: F401 (a fixture)

fused = pytest.importorskip("jax._src.cudnn.fused_attention_stablehlo")


def _scores(text: str, b: int, h: int, s: int) -> bool:
    """Whether a product materialises [B, H, S, S] float32 scores. (The CUDA branch of the
    platform_dependent may carry a zero placeholder of that shape for the other branch's
    residual; XLA drops it with the branch it belongs to.)"""
    return re.search(rf"dot_general.*-> tensor<{b}x{h}x{s}x{s}xf32>", text) is not None


# (H, G, K, V)
@pytest.mark.parametrize("shape", [(16, 16, 96, 64), (8, 8, 192, 128), (8, 2, 128, 128)])
@pytest.mark.parametrize("packed", [False, True])
def test_the_cudnn_form_lowers_forward_and_backward(h100, shape, packed):
    (h, g, k, v), (b, s) = shape, (2, 256)
    q, kk, vv, seg = bf16_operands(shape, packed, b, s)
    assert att.chosen("auto", q, kk, vv, packed) == "cudnn"

    def loss(q, kk, vv):
        return jnp.sum(att.causal_attention(q, kk, vv, 0.1, seg).astype(jnp.float32))
    text = cuda_text(jax.grad(loss, (0, 1, 2)), q, kk, vv)
    kind = "ScaleBiasSoftmax" if packed else "Softmax"   # packed: the segment mask as a bias
    assert cudnn_calls(text) == {f"__cudnn$fmha{kind}", f"__cudnn$fmha{kind}Backward"}
    assert not _scores(text, b, h, s)


def test_a_model_lowered_for_cuda_runs_cudnn_attention_in_every_layer(h100):
    from dropless.models import decoder
    from dropless.presets import get_preset
    # dense layers: the MoE layer's CUDA kernels are lowered in their own tests
    cfg = get_preset("deepseek3-test").replace(dtype="bfloat16", moe=None, first_k_dense=0)
    params = decoder.init_params(jax.random.key(0), cfg)
    s = 64
    tokens = jnp.zeros((2, s), jnp.int32)
    seg = jnp.ones((2, s), jnp.int32)
    text = cuda_text(lambda p, t: decoder.forward(p, t, cfg, segment_ids_BS=seg), params, tokens)
    assert len(re.findall(r"__cudnn\$fmhaScaleBiasSoftmax\(", text)) == cfg.num_layers
    assert not _scores(text, 2, cfg.num_heads, s)
    # the same model with the reference asked for materialises the scores
    ref = cfg.replace(attention_kernel="xla")
    text = cuda_text(lambda p, t: decoder.forward(p, t, ref, segment_ids_BS=seg), params, tokens)
    assert not cudnn_calls(text) and _scores(text, 2, cfg.num_heads, s)


def test_what_jaxs_own_checks_refuse_leaves_auto_on_the_reference(h100, monkeypatch):
    """A rule of jax's binding that ours does not know (here: a stand-in refusal of every
    shape) is found when auto traces the cuDNN form abstractly: auto takes the XLA attention,
    and cudnn asked for by name is refused with jax's words."""
    def refuse(*a, **k):
        raise NotImplementedError("Unsupported sequence length Q 256, KV 256.")
    monkeypatch.setattr(fused, "check_is_flash_attention", refuse)
    q = jnp.zeros((2, 256, 4, 64), jnp.bfloat16)
    assert att.chosen("auto", q, q, q, True) == "xla"
    with pytest.raises(att.KernelUnavailable, match=r"model.attention_kernel=cudnn: jax: "
                       r"NotImplementedError: Unsupported sequence length Q 256, KV 256\."):
        att.chosen("cudnn", q, q, q, True)
    text = cuda_text(lambda q: att.causal_attention(q, q, q, 0.1), q)
    assert not cudnn_calls(text)
