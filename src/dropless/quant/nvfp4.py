"""NVFP4 (E2M1 elements, an E4M3 scale per 16 elements, an FP32 tensor scale), emulated exactly.

Legend: M rows (routed tokens, sorted by group), K columns, N output columns, G groups,
P rows of the group-aligned layout (each group padded to a multiple of 16 rows), L = 16 elements
in one block, nb blocks along an axis.

The format, as NVIDIA's NVFP4 pre-training recipe describes it (arXiv:2509.25149); the order of
the float32 operations below is this module's definition (the NumPy test reference follows it):
  * elements are E2M1: sign, 2 exponent bits, 1 mantissa bit; magnitudes {0, 0.5, 1, 1.5, 2, 3,
    4, 6} (0.5 is the one subnormal), no Inf or NaN;
  * a block is 16 consecutive elements along the contraction axis ("1d", activations and
    gradients) or a 16x16 tile ("2d", weights: the same quantized weight serves the forward and
    the input-gradient matmul, which contract over different axes);
  * a block's scale is stored as E4M3 (float8_e4m3fn, max 448, subnormals down to 2**-9);
  * a second-level FP32 scale per tensor maps the largest block scale onto E4M3's range.
In float32, each step correctly rounded:
  s_enc     = 6 * 448 / amax(tensor)      (1.0 when amax is 0; at most float32 max)
  scale_b   = e4m3_rne(min(amax_b / 6 * s_enc, 448))
  y         = x * (s_enc / scale_b)       (0 where scale_b is 0), clamped to [-6, 6]
  q         = e2m1(y)                     round to nearest even, or stochastic rounding
  value     = q * scale_b * s_dec         with s_dec = 1 / s_enc, the tensor's decode scale
Without the second-level scale (`tensor_scale=False`) s_enc = s_dec = 1.

Edge cases (chosen to mirror `dropless.quant.mxfp8`): float32 subnormal inputs are flushed to
signed zero first; a block holding Inf or NaN gets the NaN scale (E4M3 code 0x7F) and decodes to
NaN, and the tensor amax is taken over the finite elements only, so one bad block leaves the
others' codes as they were; E2M1 zeros keep the input's sign.

Stochastic rounding (`sr_bits`, uint32 per element): y between the E2M1 neighbours lo < hi
rounds to hi with probability (|y| - lo) / (hi - lo), decided by the top 24 bits of its random
word (u = bits >> 8, up iff u < frac * 2**24). frac is a multiple of 2**-22 (|y| has 24 bits,
the E2M1 step is at least 2**-1 of its binade), so the probability is exact: unbiased.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dropless.quant.mxfp8 import flush_subnormals

BLOCK = 16
FP4_MAX = 6.0
SCALE_MAX = 448.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)   # magnitude of code 0..7
BLOCK_KINDS = ("1d", "2d")
F32_MAX = float(jnp.finfo(jnp.float32).max)
E4M3_NAN = 0x7F


class NVFP4(NamedTuple):
    """Quantized tensor. q: uint8 E2M1 codes (sign << 3 | magnitude index), x's shape.
    scale: float8_e4m3fn block scales ("1d": x's shape with the blocked axis -> ceil(n/16);
    "2d": the last two axes -> ceil/16 each). tensor_scale: float32 scalar, the decode scale
    s_dec = 1 / s_enc."""

    q: jax.Array
    scale: jax.Array
    tensor_scale: jax.Array


# ---- rounding on a small float grid, in float32 arithmetic -----------------------------------

def _abs_bits(x_f32: jax.Array) -> jax.Array:
    return (lax.bitcast_convert_type(x_f32, jnp.uint32) & jnp.uint32(0x7FFFFFFF)).astype(jnp.int32)


def _pow2(e: jax.Array) -> jax.Array:
    """2.0**e as float32 for integer e in [-126, 127], from its bit pattern."""
    return lax.bitcast_convert_type(((e + 127).astype(jnp.uint32) << 23), jnp.float32)


def grid_round(a: jax.Array, emin: int, mbits: int, sr_bits: jax.Array | None = None
               ) -> jax.Array:
    """Magnitudes a >= 0 (float32, finite, already clamped to the format's max) rounded onto a
    float grid with `mbits` mantissa bits and smallest normal exponent `emin` (subnormals below
    it): to nearest even, or stochastically with `sr_bits` (uint32, a's shape).

    In the binade of a the grid step is 2**(max(floor(log2 a), emin) - mbits); a / step is exact.
    """
    e = jnp.maximum((_abs_bits(a) >> 23) - 127, emin) - mbits
    t = a * _pow2(-e)
    if sr_bits is None:
        r = jnp.round(t)                                   # half to even
    else:
        lo = jnp.floor(t)
        u = (sr_bits >> 8).astype(jnp.float32)             # 24 random bits, exact in float32
        r = lo + (u < (t - lo) * jnp.float32(2.0 ** 24)).astype(jnp.float32)
    return r * _pow2(e)


def e2m1_round(y: jax.Array, sr_bits: jax.Array | None = None) -> jax.Array:
    """y (float32) clamped to [-6, 6] and rounded onto E2M1; zeros keep y's sign."""
    a = jnp.minimum(jnp.abs(y), FP4_MAX)
    return jnp.copysign(grid_round(a, 0, 1, sr_bits), y)


def e4m3_round(s: jax.Array) -> jax.Array:
    """Non-negative float32 scales clamped to 448 and rounded to nearest even onto E4M3."""
    return grid_round(jnp.minimum(s, SCALE_MAX), -6, 3)


def e2m1_codes(v: jax.Array) -> jax.Array:
    """uint8 E2M1 codes of values already on the grid: sign << 3 | index of |v| in E2M1_VALUES."""
    idx = jnp.searchsorted(jnp.asarray(E2M1_VALUES, jnp.float32), jnp.abs(v)).astype(jnp.uint8)
    sign = (lax.bitcast_convert_type(v, jnp.uint32) >> 31).astype(jnp.uint8) << 3
    return idx | sign


def e2m1_decode(q: jax.Array) -> jax.Array:
    """float32 values of uint8 E2M1 codes."""
    mag = jnp.asarray(E2M1_VALUES, jnp.float32)[(q & 7).astype(jnp.int32)]
    return jnp.where((q & 8) != 0, -mag, mag)


# ---- the two-level scales ----------------------------------------------------------------------

def encode_scale(amax: jax.Array) -> jax.Array:
    """The tensor's encode scale s_enc = 6 * 448 / amax (float32), 1.0 for amax 0, <= f32 max."""
    s = jnp.float32(FP4_MAX * SCALE_MAX) / jnp.where(amax > 0, amax, jnp.float32(1.0))
    return jnp.where(amax > 0, jnp.minimum(s, jnp.float32(F32_MAX)), jnp.float32(1.0))


def _blocked_quantize(xb: jax.Array, block_axes: tuple[int, ...], tensor_scale: bool,
                      sr_bits: jax.Array | None):
    """Core on a blocked view (blocks along `block_axes`, keepdims): returns (q values signed
    E2M1 float32, scale_b float32 keepdims with NaN for non-finite blocks, s_dec scalar)."""
    bits = _abs_bits(xb)
    nonfinite = bits >= 0x7F800000
    amax_b = lax.bitcast_convert_type(jnp.max(jnp.where(nonfinite, 0, bits), block_axes,
                                              keepdims=True), jnp.float32)
    bad_b = jnp.any(nonfinite, block_axes, keepdims=True)
    if tensor_scale:
        s_enc = encode_scale(jnp.max(amax_b))
    else:
        s_enc = jnp.float32(1.0)
    scale_b = e4m3_round(amax_b / jnp.float32(FP4_MAX) * s_enc)
    enc_b = jnp.where(scale_b > 0, jnp.minimum(s_enc / jnp.where(scale_b > 0, scale_b, 1.0),
                                               jnp.float32(F32_MAX)), 0.0)
    q = e2m1_round(jnp.where(nonfinite, 0.0, xb) * enc_b, sr_bits)
    q = jnp.where(bad_b, jnp.float32(jnp.nan), q)
    scale_b = jnp.where(bad_b, jnp.float32(jnp.nan), scale_b)
    return q, scale_b, jnp.float32(1.0) / s_enc


def _to_blocks(x: jax.Array, blocks: str):
    """(blocked view, block axes, unblock fn) of x with the blocked axis (1d) or axes (2d) last."""
    if blocks == "1d":
        n = x.shape[-1]
        nb = -(-n // BLOCK)
        xb = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, nb * BLOCK - n)])
        xb = xb.reshape(*x.shape[:-1], nb, BLOCK)

        def back(v):
            return v.reshape(*x.shape[:-1], nb * BLOCK)[..., :n]
        return xb, (-1,), back
    k, n = x.shape[-2:]
    kb, nb = -(-k // BLOCK), -(-n // BLOCK)
    xb = jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, kb * BLOCK - k), (0, nb * BLOCK - n)])
    xb = xb.reshape(*x.shape[:-2], kb, BLOCK, nb, BLOCK)

    def back(v):
        return v.reshape(*x.shape[:-2], kb * BLOCK, nb * BLOCK)[..., :k, :n]
    return xb, (-3, -1), back


def _check(x, axis: int, blocks: str, sr_bits) -> int:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x must be a floating array; got dtype {x.dtype}")
    if blocks not in BLOCK_KINDS:
        raise ValueError(f"blocks={blocks!r} must be one of {BLOCK_KINDS}")
    if blocks == "2d" and x.ndim < 2:
        raise ValueError(f"blocks='2d' needs an array of >= 2 dims; got shape {x.shape}")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis={axis} is out of range for an array with {x.ndim} dims")
    if sr_bits is not None and (sr_bits.shape != x.shape or sr_bits.dtype != jnp.uint32):
        raise ValueError(f"sr_bits must be uint32 of x's shape {x.shape}; got "
                         f"{sr_bits.dtype} {sr_bits.shape}")
    return axis % x.ndim


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 5))
def _quantize(x, axis: int, blocks: str, tensor_scale: bool, sr_bits, codes: bool):
    """(q values or codes, scales, s_dec) with the blocked axis moved back into place (1d)."""
    xt = flush_subnormals(x)
    if blocks == "1d":
        xt = jnp.moveaxis(xt, axis, -1)
        sr_bits = None if sr_bits is None else jnp.moveaxis(sr_bits, axis, -1)
    xb, block_axes, back = _to_blocks(xt, blocks)
    srb = None if sr_bits is None else _to_blocks(sr_bits, blocks)[0]
    q, scale_b, s_dec = _blocked_quantize(xb, block_axes, tensor_scale, srb)
    if codes:
        scale = jnp.squeeze(scale_b, block_axes)
        out_q = back(e2m1_codes(q))
        out_q = jnp.where(back(jnp.isnan(q)), jnp.uint8(0), out_q)  # E2M1 has no NaN code
        if blocks == "1d":
            out_q, scale = jnp.moveaxis(out_q, -1, axis), jnp.moveaxis(scale, -1, axis)
        return out_q, scale.astype(jnp.float8_e4m3fn), s_dec
    v = back(q * scale_b)
    return (jnp.moveaxis(v, -1, axis) if blocks == "1d" else v), None, s_dec


def quantize(x: jax.Array, axis: int = -1, *, blocks: str = "1d", tensor_scale: bool = True,
             sr_bits: jax.Array | None = None) -> NVFP4:
    """NVFP4-quantize x: 16-element blocks along `axis` ("1d") or 16x16 tiles over the last two
    axes ("2d", `axis` ignored), with the FP32 tensor scale unless `tensor_scale=False`.

    Args:
      x: float array (upcast to float32, exact for bf16); lengths need not be multiples of 16
        (zero padding changes no amax).
      sr_bits: uint32 random words of x's shape for stochastic rounding; None rounds to nearest
        even.
    Returns: NVFP4(q uint8 codes, scale float8_e4m3fn, tensor_scale float32 s_dec).
    Raises: ValueError for a non-float x, a bad axis or blocks, sr_bits of the wrong shape/dtype.
    """
    x = jnp.asarray(x)
    axis = _check(x, axis, blocks, sr_bits)
    return NVFP4(*_quantize(x.astype(jnp.float32), axis, blocks, bool(tensor_scale), sr_bits,
                            True))


def dequantize(nv: NVFP4, axis: int = -1, *, blocks: str = "1d") -> jax.Array:
    """float32 values q * scale * tensor_scale (NaN where the block scale is NaN)."""
    q = jnp.asarray(nv.q)
    axis = _check(q.astype(jnp.float32), axis, blocks, None)
    return _dequantize(q, nv.scale, nv.tensor_scale, axis, blocks)


@functools.partial(jax.jit, static_argnums=(3, 4))
def _dequantize(q, scale, tensor_scale, axis: int, blocks: str):
    s = scale.astype(jnp.float32)
    if blocks == "1d":
        n = q.shape[axis]
        s = jnp.take(jnp.repeat(s, BLOCK, axis=axis), jnp.arange(n), axis=axis)
    else:
        k, n = q.shape[-2:]
        s = jnp.repeat(jnp.repeat(s, BLOCK, axis=-2), BLOCK, axis=-1)[..., :k, :n]
    return e2m1_decode(q) * s * tensor_scale


def quantize_values(x: jax.Array, axis: int = -1, *, blocks: str = "1d",
                    tensor_scale: bool = True, sr_bits: jax.Array | None = None
                    ) -> tuple[jax.Array, jax.Array]:
    """(q * scale_b as float32, s_dec): the block-scaled values a tensor core multiplies, and
    the tensor decode scale its epilogue applies. q * scale_b has at most 6 significant bits, so
    it is exact in bfloat16 and products of two are exact in float32."""
    x = jnp.asarray(x)
    axis = _check(x, axis, blocks, sr_bits)
    v, _, s_dec = _quantize(x.astype(jnp.float32), axis, blocks, bool(tensor_scale), sr_bits,
                            False)
    return v, s_dec


def fake_quantize(x: jax.Array, axis: int = -1, *, blocks: str = "1d",
                  tensor_scale: bool = True, sr_bits: jax.Array | None = None,
                  out_dtype=None) -> jax.Array:
    """dequantize(quantize(x)) in `out_dtype` (default x's dtype)."""
    v, s_dec = quantize_values(x, axis, blocks=blocks, tensor_scale=tensor_scale,
                               sr_bits=sr_bits)
    return (v * s_dec).astype(out_dtype or jnp.asarray(x).dtype)


# ---- the weight-gradient operands: group-aligned rows, random Hadamard transform --------------

def group_aligned_rows(group_sizes_G: jax.Array, m: int) -> tuple[jax.Array, jax.Array, int]:
    """Where each of m rows goes when every group is padded to a multiple of 16 rows.

    Returns (dest_M int32, padded_sizes_G int32, P) with P a static bound (m + 15 G rounded up
    to 16): group g's rows land at 16-aligned offsets, so 16-row blocks of the padded layout
    never mix two groups, and the pad rows (zeros) add nothing to x_g^T dy_g. Rows past
    sum(group_sizes) get dest P (dropped by a scatter with mode="drop").

    Hand-worked example, sizes [1, 0, 20], m = 24 (rows 21..23 are past the sum):
      padded sizes [16, 0, 32], padded starts [0, 16, 16], P = 80 (24 + 45 rounded up);
      row 0 -> 0; rows 1..20 -> 16..35; rows 21, 22, 23 -> 80 (dropped).
    """
    gs_G = jnp.maximum(group_sizes_G.astype(jnp.int32), 0)
    ends_G = jnp.minimum(jnp.cumsum(gs_G), m)
    starts_G = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends_G[:-1]])
    sizes_G = ends_G - starts_G
    padded_G = (sizes_G + BLOCK - 1) // BLOCK * BLOCK
    pstarts_G = jnp.cumsum(padded_G) - padded_G
    p = -(-(m + (BLOCK - 1) * group_sizes_G.shape[0]) // BLOCK) * BLOCK
    rows_M = jnp.arange(m, dtype=jnp.int32)
    g_M = jnp.searchsorted(ends_G, rows_M, side="right")        # G for rows past the sum
    inside = g_M < group_sizes_G.shape[0]
    gc_M = jnp.minimum(g_M, group_sizes_G.shape[0] - 1)
    dest_M = jnp.where(inside, pstarts_G[gc_M] + rows_M - starts_G[gc_M], p)
    return dest_M.astype(jnp.int32), padded_G, p


def to_aligned(x_MK: jax.Array, dest_M: jax.Array, p: int) -> jax.Array:
    """x's rows scattered to their group-aligned places in a zero [P, K] array."""
    return jnp.zeros((p, x_MK.shape[1]), x_MK.dtype).at[dest_M].set(x_MK, mode="drop")


def hadamard_matrix(seed: int) -> jax.Array:
    """The 16x16 random Hadamard transform H16 @ diag(signs) / 4 (orthogonal), float32.

    H16 is Sylvester's Hadamard matrix; the sign vector is fixed by `seed` (the recipe uses one
    random sign vector for the whole run): signs[i] = -1 where bit 0 of
    jax.random.bits(jax.random.key(seed), (16,)) is set.
    """
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < BLOCK:
        h = np.block([[h, h], [h, -h]])
    bits = jax.random.bits(jax.random.key(seed), (BLOCK,), jnp.uint32)
    signs = jnp.where((bits & 1) == 1, -1.0, 1.0).astype(jnp.float32)
    return h * signs[None, :] / 4.0


def hadamard_rows(x_PK: jax.Array, h_LL: jax.Array) -> jax.Array:
    """Each 16-row block b of x (P a multiple of 16) replaced by H @ b, in float32."""
    p, k = x_PK.shape
    xb = x_PK.astype(jnp.float32).reshape(p // BLOCK, BLOCK, k)
    return jnp.einsum("ij,bjk->bik", h_LL, xb,
                      precision=lax.Precision.HIGHEST).reshape(p, k)
