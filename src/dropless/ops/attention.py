"""The attention core, softmax(q k^T * scale + mask) v, by a kernel chosen per platform.

Legend: B batch, S sequence, H query heads, G key/value heads (H a multiple of G), K query/key
head dim, V value head dim.

  kernel     what runs                                               where
  xla        the S x S scores and softmax in float32, materialised:  everywhere (the reference)
             `causal_attention_xla`
  cudnn      cuDNN's fused flash attention through                   CUDA, bfloat16/float16,
             `jax.nn.dot_product_attention(implementation="cudnn")`  head dims cuDNN takes
             (ops/gpu/cudnn_attention.py): the scores never leave
             on-chip memory, the causal half is skipped
  cudnn_thd  the same kernel through jax's own cuDNN binding          as cudnn, from Hopper,
             (ops/gpu/cudnn_thd.py): MLA's value head dim as it is,  cuDNN >= 9.10
             packed rows as cuDNN's segments (up to `max_segments`
             runs a row; a batch with more takes the masked form),
             no S x S mask made or read
  auto       cudnn where it takes the operands, else xla

The model (models/attention.py) asks for `ModelConfig.attention_kernel` and never names a
platform: `auto` is decided when the caller is lowered (`jax.lax.platform_dependent`), and the
cuDNN branch is traced only in a process whose default backend is a CUDA GPU, since tracing it
asks the loaded cuDNN and the device for their versions. `cudnn` or `cudnn_thd` asked for by
name where it cannot run raises one line saying why (`KernelUnavailable`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dropless.ops.gpu import cudnn_attention, cudnn_thd

# the names config.ATTENTION_KERNELS lists for model.attention_kernel (tests/ops/test_attention.py
# checks they are the same)
KERNELS = ("auto", "xla", "cudnn", "cudnn_thd")


class KernelUnavailable(ValueError):
    """An attention kernel asked for by name that cannot run on these operands here."""


def attention_mask(seq_len: int, segment_ids_BS: jax.Array | None = None) -> jax.Array:
    """Which keys each query sees: causal [1, 1, S, S] or, with segment ids, causal AND same
    segment [B, 1, S, S]. The diagonal is always kept, so no query (padding included: segment 0
    sees segment 0) is left without a key and softmax never divides by zero."""
    mask = jnp.tril(jnp.ones((seq_len, seq_len), bool))[None, None]
    if segment_ids_BS is None:
        return mask
    same_BSS = segment_ids_BS[:, :, None] == segment_ids_BS[:, None, :]
    return mask & same_BSS[:, None]


def causal_attention_xla(q_BSHK: jax.Array, k_BSGK: jax.Array, v_BSGV: jax.Array,
                         scale: float, segment_ids_BS: jax.Array | None = None) -> jax.Array:
    """The reference: scores and softmax in float32, probabilities in v's dtype for the second
    product. Each of the G key/value heads serves H/G query heads. Returns [B, S, H, V]."""
    rep = q_BSHK.shape[2] // k_BSGK.shape[2]
    k_BSHK = jnp.repeat(k_BSGK, rep, axis=2) if rep > 1 else k_BSGK
    v_BSHV = jnp.repeat(v_BSGV, rep, axis=2) if rep > 1 else v_BSGV
    s = q_BSHK.shape[1]
    logits_BHSS = jnp.einsum("bqhk,bshk->bhqs", q_BSHK, k_BSHK,
                             preferred_element_type=jnp.float32) * scale
    mask = attention_mask(s, segment_ids_BS)
    logits_BHSS = jnp.where(mask, logits_BHSS, jnp.finfo(jnp.float32).min)
    probs_BHSS = jax.nn.softmax(logits_BHSS, axis=-1).astype(v_BSHV.dtype)
    return jnp.einsum("bhqs,bshv->bqhv", probs_BHSS, v_BSHV, preferred_element_type=jnp.float32
                      ).astype(v_BSHV.dtype)


def _check_shapes(q_BSHK, k_BSGK, v_BSGV) -> None:
    (b, s, h, k), (b2, s2, g, k2), (b3, s3, g3, _) = q_BSHK.shape, k_BSGK.shape, v_BSGV.shape
    if not (b == b2 == b3 and s == s2 == s3 and k == k2 and g == g3 and g and h % g == 0):
        raise ValueError(f"causal_attention: q {q_BSHK.shape}, k {k_BSGK.shape}, v "
                         f"{v_BSGV.shape} are not [B,S,H,K], [B,S,G,K], [B,S,G,V] with H a "
                         "multiple of G")


def problem(kernel: str, q_BSHK, k_BSGK, v_BSGV, segments: bool = False,
            max_segments: int = 32) -> str | None:
    """Why `kernel` cannot run on these operands (with a segment mask where `segments`) in this
    process (None: it can). `auto` and `xla` always can."""
    if kernel not in KERNELS:
        return f"model.attention_kernel={kernel!r} is not one of {list(KERNELS)}"
    if kernel == "cudnn":
        why = cudnn_attention.problem(q_BSHK, k_BSGK, v_BSGV, segments)
    elif kernel == "cudnn_thd":
        why = cudnn_thd.problem(q_BSHK, k_BSGK, v_BSGV, segments, max_segments)
    else:
        return None
    return None if why is None else f"model.attention_kernel={kernel}: {why}; use auto or xla"


def chosen(kernel: str, q_BSHK, k_BSGK, v_BSGV, segments: bool = False,
           max_segments: int = 32) -> str:
    """The kernel `kernel` runs as at these operands in this process: "cudnn" or "cudnn_thd"
    (on a CUDA device) or "xla". Raises KernelUnavailable as `causal_attention` does."""
    why = problem(kernel, q_BSHK, k_BSGK, v_BSGV, segments, max_segments)
    if why is not None:
        raise KernelUnavailable(why)
    if kernel == "auto":
        ok = cudnn_attention.problem(q_BSHK, k_BSGK, v_BSGV, segments) is None
        return "cudnn" if ok else "xla"
    return kernel


def causal_attention(q_BSHK: jax.Array, k_BSGK: jax.Array, v_BSGV: jax.Array, scale: float,
                     segment_ids_BS: jax.Array | None = None, *, kernel: str = "auto",
                     max_segments: int = 32) -> jax.Array:
    """softmax(q k^T * scale + mask) v with the causal (and, given segment ids, same-segment)
    mask of `attention_mask`; [B, S, H, V] in v's dtype. `kernel`: see the module docstring;
    `max_segments`: the runs of equal segment id a row may hold in `cudnn_thd`'s fast form
    (the segment ids must be runs, as the data packers make them). Raises ValueError for
    mismatched shapes and KernelUnavailable for `cudnn` / `cudnn_thd` where it cannot run."""
    _check_shapes(q_BSHK, k_BSGK, v_BSGV)
    which = chosen(kernel, q_BSHK, k_BSGK, v_BSGV, segment_ids_BS is not None, max_segments)
    if which == "xla":
        return causal_attention_xla(q_BSHK, k_BSGK, v_BSGV, scale, segment_ids_BS)
    operands = (q_BSHK, k_BSGK, v_BSGV) + ((segment_ids_BS,) if segment_ids_BS is not None
                                           else ())

    def on_cuda(q, k, v, *seg):
        if which == "cudnn_thd":
            return cudnn_thd.causal_attention(q, k, v, scale, seg[0] if seg else None,
                                              max_segments=max_segments)
        return cudnn_attention.causal_attention(q, k, v, scale, seg[0] if seg else None)

    def elsewhere(q, k, v, *seg):
        return causal_attention_xla(q, k, v, scale, seg[0] if seg else None)
    return jax.lax.platform_dependent(*operands, cuda=on_cuda, default=elsewhere)


__all__ = ["KERNELS", "KernelUnavailable", "attention_mask", "causal_attention",
           "causal_attention_xla", "chosen", "problem"]
