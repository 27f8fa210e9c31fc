"""Attention for the model: RMSNorm, rotary embeddings, Multi-head Latent Attention (`mla`) and
standard multi-head attention (`mha`: grouped-query when there are fewer kv heads than query
heads). Functional; parameters are plain dicts.

Packed rows (several documents in one row, `data.batch.Batch`): with `segment_ids_BS` a query
sees only the keys of its own segment (causal AND same segment); rotary tables gathered at
`positions_BS` (`rope_at`) give every document its own positions from 0. Without them (None,
decided at trace time) attention is plainly causal over the row and positions run 0..S-1.
The attention core itself is ops/attention.py's, by `ModelConfig.attention_kernel` (cuDNN's
flash attention on an NVIDIA GPU in bfloat16, the XLA reference elsewhere).

Legend: B batch, S sequence, D model dim, H query heads, G key/value heads, K query/key head dim,
V value head dim, R rotary dims, N no-rope (content) dims, Q q low-rank dim, L kv low-rank dim,
R2 = R // 2 rotary frequencies. Rotary tables are [S, R2] (one per position) or [B, S, R2]
(gathered per row at its positions).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from dropless.config import ModelConfig
from dropless.moe.ffn import Draw, fan_in_draw
from dropless.ops.attention import causal_attention
from dropless.ops.attention import chosen as attention_chosen

# The activations each attention kind marks (checkpoint_name) for the `offload` remat policy to
# move to host memory (as MaxText does).
OFFLOADED_NAMES = ("query_proj", "value_proj")


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """x / rms(x) * w, computed in float32, returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    return (y * w.astype(jnp.float32)).astype(x.dtype)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1 * mscale * ln(factor) + 1 (1 when factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inv_freq(dim: int, cfg: ModelConfig) -> np.ndarray:
    """YaRN frequencies [dim // 2] (float32): theta^(-2i/dim) for dims that rotate fast enough
    (more than beta_fast turns over the original context), divided by rope_factor for the slow
    ones (fewer than beta_slow turns), linearly blended in between; the correction range is
    rounded outwards (floor/ceil) as DeepSeek-V3 and `transformers` do."""
    base, factor = cfg.rope_theta, cfg.rope_factor
    orig = cfg.rope_original_max_position

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))
    low = max(math.floor(correction_dim(cfg.rope_beta_fast)), 0)
    high = min(math.ceil(correction_dim(cfg.rope_beta_slow)), dim - 1)
    if low == high:
        high += 0.001   # avoid a zero-width ramp
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolate = (1 - ramp).astype(np.float32)
    return ((1.0 / (factor * pos_freqs)) * (1 - extrapolate)
            + (1.0 / pos_freqs) * extrapolate).astype(np.float32)


def rope_tables(seq_len: int, dim: int, theta: float, cfg: ModelConfig | None = None
                ) -> tuple[jax.Array, jax.Array]:
    """cos_SR2, sin_SR2 with R2 = dim // 2 frequencies theta^(-2i/dim); with a `cfg` whose
    rope_type is "yarn", YaRN's frequencies and cos/sin scaled by its attention factor
    mscale(rope_mscale) / mscale(rope_mscale_all_dim) (or mscale(1) when either is 0)."""
    if cfg is not None and cfg.rope_type == "yarn":
        inv_freq = jnp.asarray(yarn_inv_freq(dim, cfg))
        f, m, m_all = cfg.rope_factor, cfg.rope_mscale, cfg.rope_mscale_all_dim
        attn = yarn_mscale(f, m) / yarn_mscale(f, m_all) if m and m_all else yarn_mscale(f)
    else:
        inv_freq = theta ** (-jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
        attn = 1.0
    angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(angles) * attn, jnp.sin(angles) * attn


def mla_softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(qk head dim), times mscale(rope_mscale_all_dim)^2 under YaRN (DeepSeek-V3)."""
    scale = 1.0 / math.sqrt(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    if cfg.rope_type == "yarn" and cfg.rope_mscale_all_dim:
        scale *= yarn_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim) ** 2
    return scale


def rope_at(cos_SR2: jax.Array, sin_SR2: jax.Array, positions_BS: jax.Array
            ) -> tuple[jax.Array, jax.Array]:
    """cos_BSR2, sin_BSR2: the tables' rows at each token's position (a gather, so exactly the
    values the tables hold). Positions must lie in [0, S) of the tables (a packed row's do:
    they restart per document inside the row)."""
    return cos_SR2[positions_BS], sin_SR2[positions_BS]


def apply_rope(x_BSHR: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate (first half, second half) pairs of the last axis by the position's angles; `cos`,
    `sin` are [S, R2] (positions 0..S-1 in every row) or [B, S, R2] (per row, `rope_at`)."""
    x = x_BSHR.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    if cos.ndim == 2:
        c, s = cos[None, :, None, :], sin[None, :, None, :]
    else:
        c, s = cos[:, :, None, :], sin[:, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x_BSHR.dtype)


def kernel_for(cfg: ModelConfig, seq_len: int, packed: bool) -> str:
    """What the attention core runs as for `cfg` at `seq_len` in this process, "cudnn",
    "cudnn_thd" or "xla" (packed: rows carry segment ids). Raises ops.attention.KernelUnavailable where
    cfg.attention_kernel names a kernel that cannot run here, as tracing the model would."""
    dt = jnp.dtype(cfg.dtype)
    g = cfg.kv_heads if cfg.attention == "mha" else cfg.num_heads

    def shape(heads: int, dim: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((1, seq_len, heads, dim), dt)
    return attention_chosen(cfg.attention_kernel, shape(cfg.num_heads, cfg.qk_head_dim),
                            shape(g, cfg.qk_head_dim), shape(g, cfg.v_dim), packed,
                            cfg.max_segments_per_seq)


def _dot(x: jax.Array, w: jax.Array, spec: str) -> jax.Array:
    """A projection in the compute dtype: float32 accumulation inside the matmul, the output in
    x's dtype, so the backward pass's matmuls take bfloat16 cotangents as well (a float32
    output cast down would hand them float32 ones, and a GPU runs those at float32 rate)."""
    return jnp.einsum(spec, x, w.astype(x.dtype), preferred_element_type=x.dtype)


def init_mla(key: jax.Array, cfg: ModelConfig, draw: Draw = fan_in_draw
             ) -> dict[str, jax.Array]:
    """MLA weights: wq (or wq_a, q_norm, wq_b), wkv_a, kv_norm, wkv_b (kind "attn"), wo (kind
    "attn_out"), each from `draw` over its fan-in (moe.ffn.Draw); the norms start at one."""
    d, h, wdt = cfg.d_model, cfg.num_heads, jnp.dtype(cfg.weight_dtype)
    n, r, v, l_kv, q_r = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                          cfg.kv_lora_rank, cfg.q_lora_rank)
    ks = jax.random.split(key, 5)
    p = {}
    if q_r:
        p["wq_a_DQ"] = draw(ks[0], "attn", (d, q_r), d, wdt)
        p["q_norm_Q"] = jnp.ones((q_r,), wdt)
        p["wq_b_QHK"] = draw(ks[1], "attn", (q_r, h, n + r), q_r, wdt)
    else:
        p["wq_DHK"] = draw(ks[0], "attn", (d, h, n + r), d, wdt)
    # latent (L) then the shared rope key (R)
    p["wkv_a_DL"] = draw(ks[2], "attn", (d, l_kv + r), d, wdt)
    p["kv_norm_L"] = jnp.ones((l_kv,), wdt)
    # per head: k_nope (N), then v (V)
    p["wkv_b_LHN"] = draw(ks[3], "attn", (l_kv, h, n + v), l_kv, wdt)
    p["wo_HVD"] = draw(ks[4], "attn_out", (h, v, d), h * v, wdt)
    return p


def mla(p: dict[str, jax.Array], x_BSD: jax.Array, cfg: ModelConfig,
        cos: jax.Array, sin: jax.Array, segment_ids_BS: jax.Array | None = None) -> jax.Array:
    """Multi-head Latent Attention (DeepSeek-V2/V3): keys and values come from a shared
    low-rank latent; a decoupled rotary key of R dims is shared by all heads. `cos`, `sin`:
    rotary tables ([S, R2] or per row [B, S, R2]); `segment_ids_BS`: see `causal_attention`."""
    n, r, l_kv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    if "wq_a_DQ" in p:
        c_q = rms_norm(_dot(x_BSD, p["wq_a_DQ"], "bsd,dq->bsq"), p["q_norm_Q"],
                       cfg.mla_norm_eps)
        q_BSHK = _dot(c_q, p["wq_b_QHK"], "bsq,qhk->bshk")
    else:
        q_BSHK = _dot(x_BSD, p["wq_DHK"], "bsd,dhk->bshk")
    q_BSHK = checkpoint_name(q_BSHK, "query_proj")
    kv_a = _dot(x_BSD, p["wkv_a_DL"], "bsd,dl->bsl")
    c_kv_BSL = rms_norm(kv_a[..., :l_kv], p["kv_norm_L"], cfg.mla_norm_eps)
    k_rope_BS1R = apply_rope(kv_a[..., None, l_kv:], cos, sin)
    kv_BSHN = _dot(c_kv_BSL, p["wkv_b_LHN"], "bsl,lhn->bshn")
    k_nope, v_BSHV = kv_BSHN[..., :n], kv_BSHN[..., n:]
    v_BSHV = checkpoint_name(v_BSHV, "value_proj")
    q_rope = apply_rope(q_BSHK[..., n:], cos, sin)
    q_BSHK = jnp.concatenate([q_BSHK[..., :n], q_rope], axis=-1)
    k_BSHK = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope_BS1R, k_nope.shape[:-1] + (r,))],
                             axis=-1)
    out_BSHV = causal_attention(q_BSHK, k_BSHK, v_BSHV, mla_softmax_scale(cfg), segment_ids_BS,
                                kernel=cfg.attention_kernel,
                                max_segments=cfg.max_segments_per_seq)
    return _dot(out_BSHV, p["wo_HVD"], "bshv,hvd->bsd")


def init_mha(key: jax.Array, cfg: ModelConfig, draw: Draw = fan_in_draw
             ) -> dict[str, jax.Array]:
    """Standard (`attention="mha"`) weights: wq, wk, wv (G kv heads; kind "attn"), wo (kind
    "attn_out"), each from `draw` over its fan-in, and q/k norms (ones) when qk_norm."""
    d, h, g, k, wdt = (cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.mha_head_dim,
                       jnp.dtype(cfg.weight_dtype))
    ks = jax.random.split(key, 4)
    p = {"wq_DHK": draw(ks[0], "attn", (d, h, k), d, wdt),
         "wk_DGK": draw(ks[1], "attn", (d, g, k), d, wdt),
         "wv_DGK": draw(ks[2], "attn", (d, g, k), d, wdt),
         "wo_HKD": draw(ks[3], "attn_out", (h, k, d), h * k, wdt)}
    if cfg.qk_norm:
        p["q_norm_K"] = jnp.ones((k,), wdt)
        p["k_norm_K"] = jnp.ones((k,), wdt)
    return p


def mha(p: dict[str, jax.Array], x_BSD: jax.Array, cfg: ModelConfig,
        cos: jax.Array, sin: jax.Array, segment_ids_BS: jax.Array | None = None) -> jax.Array:
    """Standard multi-head attention (`attention="mha"`) with G = num_kv_heads key/value heads:
    each serves H/G query heads, i.e. grouped-query attention when G < H (Mixtral, Qwen3),
    plain multi-head attention when G = H. `cos`, `sin`, `segment_ids_BS` as for `mla`."""
    q_BSHK = checkpoint_name(_dot(x_BSD, p["wq_DHK"], "bsd,dhk->bshk"), "query_proj")
    k_BSGK = _dot(x_BSD, p["wk_DGK"], "bsd,dgk->bsgk")
    v_BSGK = checkpoint_name(_dot(x_BSD, p["wv_DGK"], "bsd,dgk->bsgk"), "value_proj")
    if "q_norm_K" in p:
        q_BSHK = rms_norm(q_BSHK, p["q_norm_K"], cfg.norm_eps)
        k_BSGK = rms_norm(k_BSGK, p["k_norm_K"], cfg.norm_eps)
    q_BSHK = apply_rope(q_BSHK, cos, sin)
    k_BSGK = apply_rope(k_BSGK, cos, sin)
    out = causal_attention(q_BSHK, k_BSGK, v_BSGK, 1.0 / math.sqrt(cfg.mha_head_dim),
                           segment_ids_BS, kernel=cfg.attention_kernel,
                           max_segments=cfg.max_segments_per_seq)
    return _dot(out, p["wo_HKD"], "bshk,hkd->bsd")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionSpec:
    """One attention kind (ModelConfig.attention, config.ATTENTION_KINDS).

    init: (key, cfg, draw=moe.ffn.fan_in_draw) -> its parameters, each weight from `draw`.
    apply: (params, x_BSD, cfg, cos, sin, segment_ids_BS=None) -> y_BSD (rotary tables [S, R2]
      or [B, S, R2]; with segment ids, attention stays inside each segment).
    offloaded: the activations it marks (checkpoint_name) that the `offload` remat policy
      moves to host memory.
    """

    init: Callable[..., dict[str, jax.Array]]
    apply: Callable[..., jax.Array]
    offloaded: tuple[str, ...] = OFFLOADED_NAMES


# keyed by config.ATTENTION_KINDS (tests/models/test_attention.py checks they are the same)
ATTENTION: dict[str, AttentionSpec] = {
    "mla": AttentionSpec(init=init_mla, apply=mla),
    "mha": AttentionSpec(init=init_mha, apply=mha),
}
