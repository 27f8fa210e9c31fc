"""An independent plain-Python/NumPy implementation of the OCP MX v1.0 rules, for tests only.

Legend: M rows sorted by group, K columns, R rows, n elements along the blocked axis.

Written from the spec, not from dropless.quant: float64 arithmetic with math.frexp, element
rounding by Python's round() (half to even) on a per-binade quantum, codes assembled from their
sign / exponent / mantissa fields by hand. No JAX, no ml_dtypes casts.

Rules (OCP Microscaling Formats v1.0, section 6.3, and microsoft/microxcaling's clamping):
  shared exponent e = floor(log2(amax)) - emax_elem ('floor'), or the smallest e with
  amax <= max_elem * 2**e ('up'); clamped to [-127, 127]; a zero block gets -127; a block with
  Inf/NaN gets the NaN scale (code 255) and NaN elements. Elements: V / 2**e rounded to nearest
  even, normals clamped to max_elem, subnormals kept. float32 subnormal inputs count as zero.
"""
import math

import numpy as np

FORMATS = {
    "e4m3": dict(mbits=3, bias=7, emax=8, max=448.0, nan=0x7F),
    "e5m2": dict(mbits=2, bias=15, emax=15, max=57344.0, nan=0x7E),
}
BLOCK = 32
F32_MIN_NORMAL = 2.0 ** -126


def flush(v: float) -> float:
    return math.copysign(0.0, v) if abs(v) < F32_MIN_NORMAL else v


def shared_exponent(block, elem: str, rounding: str):
    """Scale exponent of a block (list of floats), or None for the NaN scale."""
    f = FORMATS[elem]
    vals = [flush(float(v)) for v in block]
    if any(not math.isfinite(v) for v in vals):
        return None
    amax = max(abs(v) for v in vals) if vals else 0.0
    if amax == 0.0:
        return -127
    _, ex = math.frexp(amax)          # amax = m * 2**ex, 0.5 <= m < 1
    e = (ex - 1) - f["emax"]
    if rounding == "up" and amax > f["max"] * 2.0 ** e:
        e += 1
    return min(max(e, -127), 127)


def encode(v: float, elem: str) -> int:
    """FP8 code of a value already representable in the format (magnitude <= max)."""
    f = FORMATS[elem]
    sign = 0x80 if math.copysign(1.0, v) < 0 else 0
    a = abs(v)
    if a == 0.0:
        return sign
    emin = 1 - f["bias"]
    _, ex = math.frexp(a)
    exp = ex - 1
    if exp < emin:                                   # subnormal: exponent field 0
        mant = a / 2.0 ** (emin - f["mbits"])
        field = 0
    else:
        mant = (a / 2.0 ** exp - 1.0) * 2 ** f["mbits"]
        field = exp + f["bias"]
    assert mant == int(mant), (v, elem)
    return sign | (field << f["mbits"]) | int(mant)


def round_element(y: float, elem: str) -> int:
    """Code of y rounded to nearest even in the element format, normals clamped to max."""
    f = FORMATS[elem]
    a = min(abs(y), f["max"])
    sgn = -1.0 if math.copysign(1.0, y) < 0 else 1.0
    if a == 0.0:
        return encode(sgn * 0.0, elem)
    emin = 1 - f["bias"]
    _, ex = math.frexp(a)
    quantum = 2.0 ** (max(ex - 1, emin) - f["mbits"])
    r = round(a / quantum) * quantum                 # round() is half-to-even
    return encode(sgn * min(r, f["max"]), elem)


def decode(code: int, elem: str) -> float:
    f = FORMATS[elem]
    sign = -1.0 if code & 0x80 else 1.0
    field = (code & 0x7F) >> f["mbits"]
    mant = code & ((1 << f["mbits"]) - 1)
    if (code & 0x7F) == f["nan"] or (elem == "e5m2" and field == 31 and mant):
        return math.nan
    if field == 0:
        return sign * mant * 2.0 ** (1 - f["bias"] - f["mbits"])
    return sign * (1 + mant / 2 ** f["mbits"]) * 2.0 ** (field - f["bias"])


def quantize_block(block, elem: str, rounding: str):
    """(element codes, scale code) of one block."""
    e = shared_exponent(block, elem, rounding)
    if e is None:
        return [FORMATS[elem]["nan"]] * len(block), 255
    return [round_element(flush(float(v)) / 2.0 ** e, elem) for v in block], e + 127


def quantize_last_axis(x, elem="e4m3", rounding="floor"):
    """Blocks of 32 along the last axis of a 2-D array: (codes uint8 like x, scales [R, nb])."""
    x = np.asarray(x, np.float32).astype(np.float64)
    rows, n = x.shape
    nb = -(-n // BLOCK)
    codes = np.zeros((rows, n), np.uint8)
    scales = np.zeros((rows, nb), np.uint8)
    for r in range(rows):
        for b in range(nb):
            c, s = quantize_block(list(x[r, b * BLOCK:(b + 1) * BLOCK]), elem, rounding)
            codes[r, b * BLOCK:b * BLOCK + len(c)] = c
            scales[r, b] = s
    return codes, scales


def dequantize_last_axis(codes, scales, elem="e4m3"):
    rows, n = codes.shape
    out = np.zeros((rows, n), np.float64)
    for r in range(rows):
        for i in range(n):
            s = int(scales[r, i // BLOCK])
            out[r, i] = math.nan if s == 255 else decode(int(codes[r, i]), elem) * 2.0 ** (s - 127)
    return out


def fake_quantize(x, axis, elem="e4m3", rounding="floor"):
    """dequantize(quantize(x)) along `axis` of a 2-D array, float64."""
    xt = np.moveaxis(np.asarray(x, np.float32), axis, -1)
    codes, scales = quantize_last_axis(xt, elem, rounding)
    return np.moveaxis(dequantize_last_axis(codes, scales, elem), -1, axis)


def grouped_parts(sizes, m):
    """[(start, end)] of each group, then the rows past the sum (sizes clipped to m rows)."""
    parts, start = [], 0
    for s in sizes:
        end = min(start + max(int(s), 0), m)
        parts.append((start, end))
        start = end
    parts.append((start, m))
    return parts


def quantize_grouped_rows(x_MK, sizes, elem="e4m3", rounding="floor"):
    """Group-aware 32-row blocks along axis 0: (codes [M, K], per-row scale codes [M, K])."""
    x = np.asarray(x_MK, np.float32).astype(np.float64)
    m, k = x.shape
    codes = np.zeros((m, k), np.uint8)
    row_scales = np.zeros((m, k), np.uint8)
    for start, end in grouped_parts(sizes, m):
        for b0 in range(start, end, BLOCK):
            b1 = min(b0 + BLOCK, end)
            for j in range(k):
                c, s = quantize_block(list(x[b0:b1, j]), elem, rounding)
                codes[b0:b1, j] = c
                row_scales[b0:b1, j] = s
    return codes, row_scales


def fake_quantize_grouped(x_MK, sizes, elem="e4m3", rounding="floor"):
    codes, row_scales = quantize_grouped_rows(x_MK, sizes, elem, rounding)
    m, k = codes.shape
    out = np.zeros((m, k), np.float64)
    for r in range(m):
        for j in range(k):
            s = int(row_scales[r, j])
            out[r, j] = math.nan if s == 255 else decode(int(codes[r, j]), elem) * 2.0 ** (s - 127)
    return out
