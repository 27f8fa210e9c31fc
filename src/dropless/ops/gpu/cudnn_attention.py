"""cuDNN's fused flash attention for the causal attention core (ops/attention.py's `cudnn`).

Legend: B batch, S sequence, H query heads, G key/value heads, K query/key head dim, V value
head dim, D = max(K, V).

`jax.nn.dot_product_attention(..., is_causal=True, implementation="cudnn")`, jax's binding of
cuDNN's fused attention (forward and backward; the scores stay on chip, the masked half of the
causal square is skipped). Three things are arranged around it:
- head dims: jax's public call takes one head dim for q, k and v, so where K != V (MLA:
  DeepSeek-V3's 192 / 128) the smaller is zero-padded to D. Zero columns add nothing to the
  scores, and the output's padded columns are zero and cut off; the price is the padded part
  of one of the two products (V -> K: 1.5x on P v for DeepSeek-V3).
- packed rows: the same-segment mask [B, 1, S, S] is passed as a boolean mask, which jax turns
  into cuDNN's additive bias (no gradient is computed for it); the causal part stays cuDNN's.
- grouped-query attention: the G key/value heads are passed as they are.

`problem` says why cuDNN cannot take given operands in this process (None: it can): jax's own
checks need a CUDA device to ask, so nothing here is traced elsewhere, and what they would
refuse is refused first, in one line: dtype (bfloat16 / float16), D (a multiple of 8, at most
256 from Hopper on, 128 before), the device (compute capability 8.0 or newer), cuDNN loaded,
an even S where a segment mask becomes a bias in training. Where none of those applies, the
form's forward and backward are traced abstractly (`traced_problem`) and jax's words, if it
refuses, are the answer.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dropless.ops.gpu.cudnn_ragged import cudnn_version

DTYPES = ("bfloat16", "float16")
MIN_CAPABILITY = (8, 0)


def _gpu() -> tuple[str | None, tuple[int, int] | None]:
    """(jax's default backend unless it is a CUDA GPU, in which case None; the first GPU's
    compute capability)."""
    backend = jax.default_backend()
    if backend != "gpu":
        return backend, None
    dev = jax.local_devices(backend="gpu")[0]
    if "cuda" not in getattr(dev.client, "platform_version", "cuda").lower():
        return "rocm", None
    cap = getattr(dev, "compute_capability", None)
    return None, tuple(int(x) for x in str(cap).split(".")[:2]) if cap else None


def problem_for(*, backend: str | None, capability: tuple[int, int] | None,
                cudnn: tuple[int, int, int] | None, dtypes: tuple[str, ...], k_dim: int,
                v_dim: int, seq_len: int, segments: bool) -> str | None:
    """Why cuDNN's flash attention cannot take operands of these dtypes, head dims and sequence
    on this device (None: it can). `backend`: jax's default backend when it is not CUDA."""
    if backend is not None:
        return (f"cuDNN flash attention needs an NVIDIA GPU; jax's default backend here is "
                f"{backend!r}")
    if len(set(dtypes)) != 1 or dtypes[0] not in DTYPES:
        return (f"cuDNN flash attention takes bfloat16 or float16 q, k, v, not {dtypes[0]} "
                f"(model.dtype=bfloat16 trains in bfloat16)")
    if capability is None or capability < MIN_CAPABILITY:
        return (f"cuDNN flash attention needs compute capability >= 8.0; this GPU has "
                f"{capability}")
    d, d_max = max(k_dim, v_dim), 256 if capability >= (9, 0) else 128
    if d % 8 or d > d_max:
        return (f"cuDNN flash attention takes head dims that are multiples of 8 up to {d_max} "
                f"on sm_{capability[0]}{capability[1]}; these are {k_dim} (q, k) and {v_dim} (v)")
    if cudnn is None:
        return "cuDNN flash attention: no cuDNN library found in this process"
    if segments and seq_len % 2:
        return (f"cuDNN flash attention with packed rows (a segment mask) needs an even "
                f"sequence; this one is {seq_len}")
    return None


def problem(q_BSHK, k_BSGK, v_BSGV, segments: bool = False) -> str | None:
    """Why cuDNN's flash attention cannot run on these operands in this process (None: it
    can): `problem_for`, then, where that finds nothing, what jax's own checks say when the
    forward and backward are traced (`traced_problem`)."""
    backend, capability = _gpu()
    why = problem_for(
        backend=backend, capability=capability,
        cudnn=cudnn_version() if backend is None else None,
        dtypes=tuple(str(a.dtype) for a in (q_BSHK, k_BSGK, v_BSGV)),
        k_dim=q_BSHK.shape[-1], v_dim=v_BSGV.shape[-1], seq_len=q_BSHK.shape[1],
        segments=segments)
    return why if why is not None else traced_problem(q_BSHK, k_BSGK, v_BSGV, segments)


def traced_problem(q_BSHK, k_BSGK, v_BSGV, segments: bool, attention=None) -> str | None:
    """What jax's cuDNN binding refuses when this form's (or `attention`'s, a function of (q,
    k, v, scale, segment ids) that calls it) forward and backward are traced at these shapes
    (abstractly: nothing runs), as "jax: <its words>"; None when it takes them. Its checks
    (head dims, layouts, the device's compute capability, the cuDNN version, a bias in
    training) run in Python at trace time, so a rule of a jax release that `problem_for` does
    not know still leaves `auto` on the XLA attention rather than failing the step."""
    b, s = q_BSHK.shape[:2]
    seg = jax.ShapeDtypeStruct((b, s), jnp.int32) if segments else None
    attention = attention or causal_attention

    def loss(q, k, v, *sg):
        return jnp.sum(attention(q, k, v, 1.0, sg[0] if sg else None).astype(jnp.float32))
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (q_BSHK, k_BSGK, v_BSGV)]
    try:
        jax.eval_shape(jax.grad(loss, (0, 1, 2)), *args, *([seg] if seg is not None else []))
    except (NotImplementedError, ValueError, RuntimeError, TypeError) as e:
        return f"jax: {type(e).__name__}: {e}"
    return None


def _padded(x: jax.Array, d: int) -> jax.Array:
    """x with its last axis zero-padded to d."""
    extra = d - x.shape[-1]
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)]) if extra else x


def causal_attention(q_BSHK: jax.Array, k_BSGK: jax.Array, v_BSGV: jax.Array, scale: float,
                     segment_ids_BS: jax.Array | None = None, *,
                     implementation: str = "cudnn") -> jax.Array:
    """Causal (and same-segment) attention by `jax.nn.dot_product_attention`; [B, S, H, V].
    `implementation="xla"` runs the same call on jax's XLA path, which is how the arrangement
    above is tested off the GPU."""
    d, v_dim = max(q_BSHK.shape[-1], v_BSGV.shape[-1]), v_BSGV.shape[-1]
    mask = None
    if segment_ids_BS is not None:
        mask = (segment_ids_BS[:, :, None] == segment_ids_BS[:, None, :])[:, None]
    out_BSHD = jax.nn.dot_product_attention(
        _padded(q_BSHK, d), _padded(k_BSGK, d), _padded(v_BSGV, d), mask=mask, scale=scale,
        is_causal=True, implementation=implementation)
    return out_BSHD[..., :v_dim].astype(v_BSGV.dtype)


__all__ = ["causal_attention", "problem", "problem_for", "DTYPES"]
