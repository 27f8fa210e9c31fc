"""cuDNN's fused flash attention through jax's own cuDNN binding: MLA's two head dims as they
are, and packed rows as cuDNN's segments instead of an S x S mask (ops/attention.py's
`cudnn_thd`).

Legend: B batch, S sequence, H query heads, G key/value heads, K query/key head dim, V value
head dim, M segments a row may hold (`model.max_segments_per_seq`).

`jax._src.cudnn.fused_attention_stablehlo.dot_product_attention` (the function
`jax.nn.dot_product_attention(implementation="cudnn")` calls, and MaxText's `cudnn_flash_jax`
imports) takes two things the public call does not:
- a value head dim other than the query/key one (cuDNN >= 9.10 on Hopper: jax's
  `check_is_flash_attention`), so MLA's V is not zero-padded to K (the `cudnn` form's price:
  1.5x on P v for DeepSeek-V3's 192 / 128);
- packed rows as segments: per row, the offset and length of each of up to M runs of equal
  segment id (`segment_layout`; cuDNN's ragged "THD" layout, Transformer Engine's name for it,
  as MaxText's `cudnn_flash_te` uses with packing and `max_segments_per_seq`), each attended
  causally on its own. No [B, 1, S, S] mask or bias is made or read; the `cudnn` form turns the
  mask into a bias that cuDNN reads for every head.
A batch holding a row of more than M runs takes the `cudnn` form instead (the same-segment
mask, ops/gpu/cudnn_attention.py), chosen on device by a `lax.cond` on the batch: exact either
way, the segment form where the rows allow. The segment ids
must be runs (each id one contiguous stretch of its row), as data.loader and data.sft pack
them; equal ids apart would be separate segments here and one in the mask.

`problem` says why the form cannot run in this process (None: it can): the `cudnn` form's rules
(ops/gpu/cudnn_attention.problem_for, on max(K, V)), Hopper and cuDNN >= 9.10, the binding
present in this jax, then jax's own checks when the form is traced abstractly.
"""
from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp

from dropless.ops.gpu import cudnn_attention as public

MIN_CAPABILITY = (9, 0)          # jax: packed layouts and MLA need Hopper
MIN_CUDNN = (9, 10, 0)           # jax: MLA (K != V) needs cuDNN >= 9.10


def _binding():
    """jax's cuDNN attention module, or None where this jax lacks the call this form makes."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fused
    except ImportError:
        return None
    fn = getattr(fused, "dot_product_attention", None)
    if fn is None or not hasattr(fused, "MaskType"):
        return None
    try:
        takes = {"q_offsets", "kv_offsets", "mask_type"} <= set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
    return fused if takes else None


def segment_layout(segment_ids_BS: jax.Array, max_segments: int
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(offsets [B, M + 1], lengths [B, M], runs [B]) of each row's runs of equal segment id,
    in jax's packed form: run j of row b starts at offsets[b, j] and holds lengths[b, j]
    tokens; entries past a row's runs are -1 (offsets[:, M] always). `runs[b]` counts row b's
    runs, so a row of more than M runs is seen (its first M are described)."""
    b, s = segment_ids_BS.shape
    start_BS = jnp.concatenate([jnp.ones((b, 1), bool),
                                segment_ids_BS[:, 1:] != segment_ids_BS[:, :-1]], axis=1)
    first_BM1 = jax.vmap(lambda r: jnp.nonzero(r, size=max_segments + 1, fill_value=-1)[0]
                         )(start_BS).astype(jnp.int32)
    nxt_BM = first_BM1[:, 1:]
    end_BM = jnp.where(nxt_BM >= 0, nxt_BM, s)
    lengths_BM = jnp.where(first_BM1[:, :-1] >= 0, end_BM - first_BM1[:, :-1], -1)
    offsets_BM1 = first_BM1.at[:, max_segments].set(-1)
    return offsets_BM1, lengths_BM.astype(jnp.int32), start_BS.sum(axis=1, dtype=jnp.int32)


def causal_attention(q_BSHK: jax.Array, k_BSGK: jax.Array, v_BSGV: jax.Array, scale: float,
                     segment_ids_BS: jax.Array | None = None, *, max_segments: int = 32
                     ) -> jax.Array:
    """Causal attention within each row (within each segment, given segment ids) by cuDNN
    through jax's binding; [B, S, H, V] in v's dtype. Traced only in a CUDA process."""
    fused = _binding()
    call = functools.partial(fused.dot_product_attention, scale=scale, qkv_layout="BTNH")
    if segment_ids_BS is None:
        out = call(q_BSHK, k_BSGK, v_BSGV, mask_type=fused.MaskType.CAUSAL)
        return out.astype(v_BSGV.dtype)
    offsets_BM1, lengths_BM, runs_B = segment_layout(segment_ids_BS, max_segments)

    def segments(q, k, v):
        return call(q, k, v, None, None, lengths_BM, lengths_BM, offsets_BM1, offsets_BM1,
                    mask_type=fused.MaskType.PADDING_CAUSAL)

    def masked(q, k, v):
        return public.causal_attention(q, k, v, scale, segment_ids_BS)
    fits = jnp.all(runs_B <= max_segments)
    return jax.lax.cond(fits, segments, masked, q_BSHK, k_BSGK, v_BSGV).astype(v_BSGV.dtype)


def problem(q_BSHK, k_BSGK, v_BSGV, segments: bool = False, max_segments: int = 32
            ) -> str | None:
    """Why this form cannot run on these operands in this process (None: it can)."""
    backend, capability = public._gpu()
    version = public.cudnn_version() if backend is None else None
    why = public.problem_for(
        backend=backend, capability=capability, cudnn=version,
        dtypes=tuple(str(a.dtype) for a in (q_BSHK, k_BSGK, v_BSGV)),
        k_dim=q_BSHK.shape[-1], v_dim=v_BSGV.shape[-1], seq_len=q_BSHK.shape[1],
        segments=segments)
    if why is not None:
        return why
    if capability < MIN_CAPABILITY:
        return (f"cuDNN flash attention through jax's binding (MLA head dims, packed segments) "
                f"needs compute capability >= 9.0; this GPU has {capability}")
    if version < MIN_CUDNN:
        return (f"cuDNN flash attention through jax's binding needs cuDNN >= 9.10; this "
                f"process loads {'.'.join(map(str, version))}")
    if _binding() is None:
        return ("this jax has no jax._src.cudnn.fused_attention_stablehlo.dot_product_attention "
                "taking q_offsets (model.attention_kernel=cudnn does without it)")
    form = functools.partial(causal_attention, max_segments=max_segments)
    return public.traced_problem(q_BSHK, k_BSGK, v_BSGV, segments, attention=form)


__all__ = ["causal_attention", "problem", "segment_layout", "MIN_CAPABILITY", "MIN_CUDNN"]
