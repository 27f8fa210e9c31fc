"""MX block-scaled FP8 (OCP Microscaling Formats spec v1.0): quantize, dequantize, group-aware.

Legend: M rows (routed tokens, sorted by group), K columns, G groups, B blocks (a static bound on
the number of group-aware blocks), L = 32 elements in one block, nb = blocks along an axis.

An MX block is 32 consecutive elements along one axis sharing one power-of-two scale X stored as
E8M0 (an 8-bit biased exponent: code c means 2**(c - 127), code 255 is NaN). Each element is
stored as FP8 (E4M3 by default, E5M2 as an option) and means `element * X`.

The scale exponent, per the spec (section 6.3), is `floor(log2(amax)) - emax_elem` where amax is
the block's largest magnitude and emax_elem the exponent of the element format's largest normal
(8 for E4M3, 15 for E5M2); elements are then `V / X` rounded to nearest-even, with normal numbers
clamped to the format's max (so a block whose amax has a significand above 1.75 saturates its
largest elements). The `up` variant (what NVIDIA's MXFP8 recipe does) picks the smallest
exponent with `amax / X <= max_elem`, i.e. ceil(log2(amax / max_elem)): one more than `floor`
exactly when the significand of amax exceeds that of max_elem, and it never saturates.

Edge cases, as the spec and the reference implementation (microsoft/microxcaling) treat them:
  * the exponent is clamped to [-127, 127]; a zero block gets the smallest scale, code 0;
  * a block holding Inf or NaN gets the NaN scale (code 255) and its elements are NaN: the
    whole block decodes to NaN;
  * float32 subnormal inputs are flushed to (signed) zero first. XLA on CPU runs with
    denormals-are-zero anyway; flushing explicitly makes the codes the same on every platform;
  * element subnormals (values below the FP8 format's smallest normal after scaling) are kept.
All exponent arithmetic is done on the float32 bit patterns, so no log2 rounding can creep in,
and no step multiplies by a float32 subnormal.
"""
from __future__ import annotations

import dataclasses
import functools
import struct
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

BLOCK = 32
SCALE_ROUNDINGS = ("floor", "up")
SCALE_EMAX = 127  # E8M0 covers 2**-127 .. 2**127


@dataclasses.dataclass(frozen=True)
class ElemFormat:
    """An FP8 element format: its dtype, exponent of the largest normal, largest value, NaN."""

    name: str
    dtype: jnp.dtype
    emax: int
    max_normal: float
    nan_code: int
    emin: int    # exponent of the smallest normal
    mbits: int   # mantissa bits


ELEM_FORMATS = {
    "e4m3": ElemFormat("e4m3", jnp.dtype(jnp.float8_e4m3fn), 8, 448.0, 0x7F, -6, 3),
    "e5m2": ElemFormat("e5m2", jnp.dtype(jnp.float8_e5m2), 15, 57344.0, 0x7E, -14, 2),
}


class GroupedMX(NamedTuple):
    """Group-aware MX blocks along the row axis: rows of block b are exactly {r : block_M[r] == b}.

    q: element codes, the input's shape. scale_BK: E8M0 scale per (block, column) after moving
    the blocked axis first. block_M: int32 block id of each row.
    """

    q: jax.Array
    scale_BK: jax.Array
    block_M: jax.Array
    axis: int


def elem_format(elem: str) -> ElemFormat:
    """The ElemFormat named `elem` ('e4m3' or 'e5m2'); ValueError naming the value otherwise."""
    if elem not in ELEM_FORMATS:
        raise ValueError(f"elem={elem!r} is not an MX FP8 element format; known: "
                         f"{', '.join(ELEM_FORMATS)}")
    return ELEM_FORMATS[elem]


def _check_rounding(rounding: str) -> None:
    if rounding not in SCALE_ROUNDINGS:
        raise ValueError(f"rounding={rounding!r} must be one of {SCALE_ROUNDINGS}")


def _check_float(x: jax.Array, name: str) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name} must be a floating array; got dtype {x.dtype}")


def _norm_axis(axis: int, ndim: int, name: str = "axis") -> int:
    if not -ndim <= axis < ndim:
        raise ValueError(f"{name}={axis} is out of range for an array with {ndim} dims")
    return axis % ndim


# ---- float32 bit-level helpers (exact on every platform, denormals-are-zero or not) ----------

def _bits(x_f32: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(x_f32, jnp.uint32)


def flush_subnormals(x: jax.Array) -> jax.Array:
    """x as float32 with float32 subnormals replaced by zero of the same sign (bitwise)."""
    b = _bits(x.astype(jnp.float32))
    is_sub = (b & jnp.uint32(0x7F800000)) == 0
    return lax.bitcast_convert_type(jnp.where(is_sub, b & jnp.uint32(0x80000000), b),
                                    jnp.float32)


def _pow2(e: jax.Array) -> jax.Array:
    """2.0**e as float32 for integer e in [-126, 127], built from its bit pattern."""
    return lax.bitcast_convert_type(((e + 127).astype(jnp.uint32) << 23), jnp.float32)


def _mul_pow2(x_f32: jax.Array, e: jax.Array) -> jax.Array:
    """x * 2**e for e in [-254, 254], in two steps so neither factor is a float32 subnormal."""
    hi = e // 2
    return x_f32 * _pow2(hi) * _pow2(e - hi)


def _abs_bits(x_f32: jax.Array) -> jax.Array:
    """|x| as int32 bit patterns: ordered like the magnitudes, NaN above Inf above finite."""
    return (_bits(x_f32) & jnp.uint32(0x7FFFFFFF)).astype(jnp.int32)


def scale_exponent(amax_bits: jax.Array, fmt: ElemFormat, rounding: str
                   ) -> tuple[jax.Array, jax.Array]:
    """Shared exponent per block from the int32 bit pattern of the block's amax.

    Returns (exponent int32 clamped to [-127, 127], nonfinite bool: amax is Inf or NaN).
    """
    biased = amax_bits >> 23
    mant = amax_bits & 0x7FFFFF
    nonfinite = biased == 0xFF
    # amax was flushed, so biased == 0 means amax == 0: the spec's log2 of 0 is -inf -> clamp
    e = biased - 127 - fmt.emax
    if rounding == "up":
        max_mant = int(_host_bits(fmt.max_normal) & 0x7FFFFF)
        e = e + (mant > max_mant).astype(jnp.int32)
    e = jnp.clip(e, -SCALE_EMAX, SCALE_EMAX)
    return e.astype(jnp.int32), nonfinite


def _host_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def scale_to_e8m0(e: jax.Array, nonfinite: jax.Array) -> jax.Array:
    """E8M0 scales (dtype float8_e8m0fnu) from exponents; NaN where nonfinite."""
    code = jnp.where(nonfinite, 0xFF, e + 127).astype(jnp.uint8)
    return lax.bitcast_convert_type(code, jnp.float8_e8m0fnu)


def e8m0_exponent(scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(exponent int32, is_nan bool) of E8M0 scales."""
    code = lax.bitcast_convert_type(scale, jnp.uint8).astype(jnp.int32)
    return code - 127, code == 0xFF


def encode_elements(x_f32: jax.Array, e: jax.Array, nonfinite: jax.Array,
                    fmt: ElemFormat) -> jax.Array:
    """FP8 codes of x / 2**e (broadcast e, nonfinite against x): RNE, normals clamped to max.

    x must already be flushed. NaN-scaled blocks get the format's NaN in every element.
    """
    y = jnp.clip(_mul_pow2(x_f32, -e), -fmt.max_normal, fmt.max_normal)
    code = lax.bitcast_convert_type(y.astype(fmt.dtype), jnp.uint8)
    # keep the sign of values that round to zero even where the platform flushed y to +0
    sign = (_bits(x_f32) >> 24).astype(jnp.uint8) & 0x80
    code = (code & 0x7F) | sign
    code = jnp.where(nonfinite, jnp.uint8(fmt.nan_code), code)
    return lax.bitcast_convert_type(code, fmt.dtype)


def round_elements(x_f32: jax.Array, e: jax.Array, nonfinite: jax.Array,
                   fmt: ElemFormat) -> jax.Array:
    """decode_elements(encode_elements(...)) without FP8 codes: the same float32 values.

    x / 2**e (clamped) is rounded to nearest even on the format's grid in float32 arithmetic:
    its quantum is 2**(max(exponent, emin) - mbits), so round(|y| / quantum) * quantum is exact.
    Skips the FP8 convert, which XLA:CPU does in software; the tests hold both paths to the
    NumPy reference.
    """
    y = jnp.clip(_mul_pow2(x_f32, -e), -fmt.max_normal, fmt.max_normal)
    exp_y = (_abs_bits(y) >> 23) - 127
    qexp = jnp.maximum(exp_y, fmt.emin) - fmt.mbits
    r = jnp.round(y * _pow2(-qexp)) * _pow2(qexp)  # round half to even
    return jnp.where(nonfinite, jnp.float32(jnp.nan), _mul_pow2(r, e))


def decode_elements(q: jax.Array, e: jax.Array, is_nan: jax.Array) -> jax.Array:
    """float32 values q * 2**e (NaN where the scale is NaN); broadcasts e, is_nan against q."""
    v = _mul_pow2(q.astype(jnp.float32), e)
    return jnp.where(is_nan, jnp.float32(jnp.nan), v)


# ---- 1x32 blocks along one axis --------------------------------------------------------------

def quantize(x: jax.Array, axis: int = -1, *, elem: str = "e4m3", rounding: str = "floor"
             ) -> tuple[jax.Array, jax.Array]:
    """MX-quantize x in blocks of 32 consecutive elements along `axis`.

    Args:
      x: float array of any shape; upcast to float32 (exact for bf16/f16).
      axis: the blocked axis (the contraction dim of the matmul that consumes the result). Its
        length need not be a multiple of 32: it is zero-padded internally, which changes no amax.
      elem: 'e4m3' (default) or 'e5m2'.
      rounding: 'floor' (OCP spec) or 'up' (never saturates).
    Returns: (q like x with the FP8 dtype, scale: x's shape with `axis` -> ceil(n/32), dtype
      float8_e8m0fnu).
    Raises: ValueError for a non-float x, a bad axis, elem or rounding.
    """
    x = jnp.asarray(x)
    _check_float(x, "x")
    fmt = elem_format(elem)
    _check_rounding(rounding)
    return _quantize(x, _norm_axis(axis, x.ndim), fmt, rounding, False)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _quantize(x, axis: int, fmt: ElemFormat, rounding: str, values: bool):
    """(codes, scales), or with `values` the rounded float32 values only."""
    xt = jnp.moveaxis(flush_subnormals(x), axis, -1)
    n = xt.shape[-1]
    nb = -(-n // BLOCK)
    xp = jnp.pad(xt, [(0, 0)] * (xt.ndim - 1) + [(0, nb * BLOCK - n)])
    xb = xp.reshape(*xt.shape[:-1], nb, BLOCK)
    e, nonfinite = scale_exponent(jnp.max(_abs_bits(xb), axis=-1, initial=0), fmt, rounding)
    if values:
        vb = round_elements(xb, e[..., None], nonfinite[..., None], fmt)
        return jnp.moveaxis(vb.reshape(*xt.shape[:-1], nb * BLOCK)[..., :n], -1, axis)
    qb = encode_elements(xb, e[..., None], nonfinite[..., None], fmt)
    q = qb.reshape(*xt.shape[:-1], nb * BLOCK)[..., :n]
    return jnp.moveaxis(q, -1, axis), jnp.moveaxis(scale_to_e8m0(e, nonfinite), -1, axis)


def dequantize(q: jax.Array, scale: jax.Array, axis: int = -1, *,
               out_dtype=jnp.float32) -> jax.Array:
    """Values of MX blocks: q * scale, each scale repeated over its 32 elements along `axis`.

    q: FP8 codes; scale: E8M0 with q's shape except `axis` of length ceil(n/32).
    Raises: ValueError when the shapes do not match that way.
    """
    axis = _norm_axis(axis, q.ndim)
    n = q.shape[axis]
    want = q.shape[:axis] + (-(-n // BLOCK),) + q.shape[axis + 1:]
    if tuple(scale.shape) != want:
        raise ValueError(f"scale shape {tuple(scale.shape)} does not match q shape {q.shape} "
                         f"blocked by {BLOCK} along axis {axis} (expected {want})")
    return _dequantize(q, scale, axis, jnp.dtype(out_dtype))


@functools.partial(jax.jit, static_argnums=(2, 3))
def _dequantize(q, scale, axis: int, out_dtype):
    n = q.shape[axis]
    nb = scale.shape[axis]
    e, is_nan = e8m0_exponent(scale)
    e = jnp.repeat(e, BLOCK, axis=axis, total_repeat_length=nb * BLOCK)
    is_nan = jnp.repeat(is_nan, BLOCK, axis=axis, total_repeat_length=nb * BLOCK)
    idx = jnp.arange(n)
    e, is_nan = jnp.take(e, idx, axis=axis), jnp.take(is_nan, idx, axis=axis)
    return decode_elements(q, e, is_nan).astype(out_dtype)


# ---- group-aware 32-row blocks -----------------------------------------------------------------

def group_blocks(group_sizes_G: jax.Array, m: int) -> tuple[jax.Array, int]:
    """Block id of each of m rows when 32-row blocks restart at every group boundary.

    Rows past sum(group_sizes) form one more trailing part, blocked the same way, so they never
    share a block with a group. All on device (no host sync). Returns (block_M int32, B) with
    B = ceil(m/32) + G a static bound on the number of blocks: G+1 parts add < 1 block each.

    Hand-worked example, sizes [1, 0, 33], m = 40 (32-row blocks):
      part ends [1, 1, 34, 40] (the last is the tail of 6 rows), starts [0, 1, 1, 34];
      blocks per part [1, 0, 2, 1] -> first block [0, 1, 1, 3];
      row 0 -> block 0; rows 1..32 -> block 1; row 33 -> block 2; rows 34..39 -> block 3.
    """
    g = group_sizes_G.shape[0]
    gs_G = jnp.maximum(group_sizes_G.astype(jnp.int32), 0)
    ends_G = jnp.minimum(jnp.cumsum(gs_G), m)  # rows past m do not exist
    ends_P = jnp.concatenate([ends_G, jnp.full((1,), m, jnp.int32)])
    starts_P = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends_P[:-1]])
    nblocks_P = (ends_P - starts_P + BLOCK - 1) // BLOCK
    first_P = jnp.cumsum(nblocks_P) - nblocks_P
    rows_M = jnp.arange(m, dtype=jnp.int32)
    part_M = jnp.searchsorted(ends_P, rows_M, side="right")  # first part ending after the row
    block_M = first_P[part_M] + (rows_M - starts_P[part_M]) // BLOCK
    return block_M.astype(jnp.int32), -(-m // BLOCK) + g


def quantize_grouped(x: jax.Array, group_sizes_G: jax.Array, axis: int = 0, *,
                     elem: str = "e4m3", rounding: str = "floor") -> GroupedMX:
    """MX-quantize a 2-D x in 32-row blocks along `axis` that restart at every group boundary.

    For the weight-gradient matmul, which contracts over each group's tokens: no block mixes two
    groups' rows (nor a group's rows with the rows past sum(group_sizes)). Jittable; group_sizes
    stays on device.

    Args:
      x: [M, K] float (axis=0) or [K, M] (axis=1): M rows sorted by group.
      group_sizes_G: [G] int, as for grouped_matmul.
    Returns: GroupedMX(q like x, scale_BK [B, K] E8M0, block_M [M] int32, axis).
    Raises: ValueError for a non-2-D or non-float x, non-integer or non-1-D group sizes, bad
      axis, elem or rounding.
    """
    x = jnp.asarray(x)
    group_sizes_G = jnp.asarray(group_sizes_G)
    _check_grouped(x, group_sizes_G)
    fmt = elem_format(elem)
    _check_rounding(rounding)
    axis = _norm_axis(axis, 2)
    return GroupedMX(*_quantize_grouped(x, group_sizes_G, axis, fmt, rounding, False), axis)


def _check_grouped(x, group_sizes_G):
    _check_float(x, "x")
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D for grouped quantization; got shape {x.shape}")
    if group_sizes_G.ndim != 1 or not jnp.issubdtype(group_sizes_G.dtype, jnp.integer):
        raise ValueError(f"group_sizes must be a 1-D integer array; got shape "
                         f"{group_sizes_G.shape} dtype {group_sizes_G.dtype}")


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5))
def _quantize_grouped(x, group_sizes_G, axis: int, fmt: ElemFormat, rounding: str,
                      values: bool):
    """(codes, scales_BK, block_M), or with `values` the rounded float32 values only."""
    x_MK = flush_subnormals(jnp.moveaxis(x, axis, 0))
    m, k = x_MK.shape
    block_M, nblk = group_blocks(group_sizes_G, m)
    amax_BK = jnp.zeros((nblk, k), jnp.int32).at[block_M].max(_abs_bits(x_MK))
    e_BK, nonfinite_BK = scale_exponent(amax_BK, fmt, rounding)
    if values:
        v_MK = round_elements(x_MK, e_BK[block_M], nonfinite_BK[block_M], fmt)
        return jnp.moveaxis(v_MK, 0, axis)
    q_MK = encode_elements(x_MK, e_BK[block_M], nonfinite_BK[block_M], fmt)
    return jnp.moveaxis(q_MK, 0, axis), scale_to_e8m0(e_BK, nonfinite_BK), block_M


def dequantize_grouped(gq: GroupedMX, *, out_dtype=jnp.float32) -> jax.Array:
    """Values of group-aware MX blocks: q * scale_BK[block_M] (rows along gq.axis)."""
    return _dequantize_grouped(gq.q, gq.scale_BK, gq.block_M, int(gq.axis),
                               jnp.dtype(out_dtype))


@functools.partial(jax.jit, static_argnums=(3, 4))
def _dequantize_grouped(q, scale_BK, block_M, axis: int, out_dtype):
    q_MK = jnp.moveaxis(q, axis, 0)
    e_BK, nan_BK = e8m0_exponent(scale_BK)
    v_MK = decode_elements(q_MK, e_BK[block_M], nan_BK[block_M])
    return jnp.moveaxis(v_MK, 0, axis).astype(out_dtype)


def fake_quantize(x: jax.Array, axis: int = -1, *, elem: str = "e4m3",
                  rounding: str = "floor", out_dtype=None) -> jax.Array:
    """dequantize(quantize(x)): x rounded to the nearest MX value, in `out_dtype` (x's dtype).

    Computed without materialising FP8 codes (`round_elements`); same values, same errors.
    """
    x = jnp.asarray(x)
    _check_float(x, "x")
    fmt = elem_format(elem)
    _check_rounding(rounding)
    v = _quantize(x, _norm_axis(axis, x.ndim), fmt, rounding, True)
    return v.astype(out_dtype or x.dtype)


def fake_quantize_grouped(x: jax.Array, group_sizes_G: jax.Array, axis: int = 0, *,
                          elem: str = "e4m3", rounding: str = "floor",
                          out_dtype=None) -> jax.Array:
    """dequantize_grouped(quantize_grouped(x)), in `out_dtype` (default x's dtype); computed
    without materialising FP8 codes (`round_elements`)."""
    x, group_sizes_G = jnp.asarray(x), jnp.asarray(group_sizes_G)
    _check_grouped(x, group_sizes_G)
    fmt = elem_format(elem)
    _check_rounding(rounding)
    v = _quantize_grouped(x, group_sizes_G, _norm_axis(axis, 2), fmt, rounding, True)
    return v.astype(out_dtype or x.dtype)
