"""cuDNN attention's lowering without a GPU, for the tests that lower it: jax's device and cuDNN
questions (and ours, ops/gpu/cudnn_attention.py) answered as an H100 with cuDNN 9.19 (the GPU
image's) would answer them, and the CUDA text's cuDNN fused-attention calls."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from dropless.ops.gpu import cudnn_attention as cudnn


def answer_as_h100(monkeypatch, fused) -> None:
    """Answer jax's (`fused`: jax._src.cudnn.fused_attention_stablehlo) and our device and
    cuDNN questions as an H100 with cuDNN 9.19."""
    monkeypatch.setattr(fused, "check_cudnn_version", lambda: 91900)
    monkeypatch.setattr(fused, "check_compute_capability", lambda cap: (9, 0) >= tuple(
        int(x) for x in cap.split(".")))
    monkeypatch.setattr(fused, "is_cuda_compute_capability_equal", lambda cap: cap == "9.0")
    monkeypatch.setattr(cudnn, "_gpu", lambda: (None, (9, 0)))
    monkeypatch.setattr(cudnn, "cudnn_version", lambda: (9, 19, 0))


def bf16_operands(shape: tuple[int, int, int, int], packed: bool, b: int = 2, s: int = 256):
    """(q [B,S,H,K], k [B,S,G,K], v [B,S,G,V] zeros in bfloat16, one segment a row or None) for
    shape = (H, G, K, V)."""
    h, g, k, v = shape
    return (jnp.zeros((b, s, h, k), jnp.bfloat16), jnp.zeros((b, s, g, k), jnp.bfloat16),
            jnp.zeros((b, s, g, v), jnp.bfloat16),
            jnp.ones((b, s), jnp.int32) if packed else None)


def cuda_text(fn, *args) -> str:
    """`fn` traced at `args` and lowered for CUDA, as text."""
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def cudnn_calls(text: str) -> set[str]:
    """The cuDNN fused-attention custom calls in lowered text."""
    return set(re.findall(r"__cudnn\$fmha[A-Za-z]*", text))


@pytest.fixture
def h100(monkeypatch):
    answer_as_h100(monkeypatch, pytest.importorskip("jax._src.cudnn.fused_attention_stablehlo"))
