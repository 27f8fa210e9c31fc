"""An independent plain-Python/NumPy implementation of NVFP4 quantization, for tests only.

Legend: R rows, n elements along the blocked axis, M rows sorted by group, K, N columns,
G groups, P rows of the group-aligned layout.

Written from the format's definition (NVIDIA, arXiv:2509.25149; see dropless/quant/nvfp4.py's
docstring for the formulas), not from dropless.quant: E2M1 rounding by searching the 8
magnitudes for the nearest one (a tie goes to the even code, mantissa bit 0), stochastic
rounding from the two neighbours and an exact float64 probability, E4M3 rounding by
math.frexp and round() on the binade's quantum, E4M3 codes assembled from their fields by hand.
The scale arithmetic is done in np.float32, one correctly rounded operation at a time, in the
order the definition gives. No JAX, no ml_dtypes casts.
"""
import math

import numpy as np

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
BLOCK = 16
F32_MIN_NORMAL = 2.0 ** -126
F32_MAX = float(np.finfo(np.float32).max)


def flush(v: float) -> float:
    return math.copysign(0.0, v) if abs(v) < F32_MIN_NORMAL else v


def e2m1_code(y: float, bits: int | None = None) -> int:
    """E2M1 code of a finite float (saturating at 6): nearest, ties to the even code; or with
    `bits` (a uint32) round up with probability (|y| - lo) / (hi - lo) using bits >> 8."""
    sign = 8 if math.copysign(1.0, y) < 0 else 0
    a = min(abs(y), 6.0)
    if bits is None:
        best = min(range(8), key=lambda i: (abs(E2M1[i] - a), i % 2))
        return sign | best
    lo = max(i for i in range(8) if E2M1[i] <= a)
    if E2M1[lo] == a:
        return sign | lo
    frac = (a - E2M1[lo]) / (E2M1[lo + 1] - E2M1[lo])       # exact in float64
    return sign | (lo + 1 if (bits >> 8) < frac * 2.0 ** 24 else lo)


def e4m3_round(s: float) -> float:
    """A non-negative float clamped to 448 and rounded to nearest even onto E4M3."""
    s = min(s, 448.0)
    if s == 0.0:
        return 0.0
    _, ex = math.frexp(s)                 # s = m * 2**ex, 0.5 <= m < 1
    q = 2.0 ** (max(ex - 1, -6) - 3)      # the step in s's binade (subnormal below 2**-6)
    return round(s / q) * q


def e4m3_code(s: float) -> int:
    """float8_e4m3fn code of a non-negative E4M3 value (NaN -> 0x7F)."""
    if math.isnan(s):
        return 0x7F
    if s == 0.0:
        return 0
    _, ex = math.frexp(s)
    exp = ex - 1
    if exp < -6:
        return int(s / 2.0 ** -9)                          # exponent field 0
    return ((exp + 7) << 3) | int(s / 2.0 ** exp * 8 - 8)


def encode_scale(amax: np.float32) -> np.float32:
    """s_enc = 6 * 448 / amax in float32, 1 for amax 0, clamped to float32 max."""
    if amax == 0:
        return np.float32(1.0)
    with np.errstate(over="ignore"):
        s = np.float32(2688.0) / np.float32(amax)
    return np.float32(min(float(s), F32_MAX))


def quantize_blocks(blocks, tensor_scale: bool = True, bits=None):
    """Quantize a list of blocks (each a list of float32 values; one tensor).

    Returns (codes: list of lists of E2M1 codes, scales: list of E4M3 codes, s_dec float32).
    `bits`: per-element uint32 lists of the same structure for stochastic rounding.
    """
    blocks = [[flush(float(np.float32(v))) for v in b] for b in blocks]
    finite = [v for b in blocks for v in b if math.isfinite(v)]
    amax_t = np.float32(max([abs(v) for v in finite], default=0.0))
    s_enc = encode_scale(amax_t) if tensor_scale else np.float32(1.0)
    codes, scales = [], []
    for i, b in enumerate(blocks):
        if any(not math.isfinite(v) for v in b):
            codes.append([0] * len(b))
            scales.append(0x7F)
            continue
        amax_b = np.float32(max([abs(v) for v in b], default=0.0))
        with np.errstate(over="ignore", under="ignore"):
            pre = np.float32(np.float32(amax_b / np.float32(6.0)) * s_enc)
        scale = np.float32(e4m3_round(float(pre)))
        if scale > 0:
            with np.errstate(over="ignore"):
                enc = np.float32(min(float(np.float32(s_enc / scale)), F32_MAX))
        else:
            enc = np.float32(0.0)
        row = []
        for j, v in enumerate(b):
            with np.errstate(over="ignore", under="ignore"):
                y = float(np.float32(np.float32(v) * enc))
            y = math.copysign(y, v) if y == 0.0 else y
            row.append(e2m1_code(y, None if bits is None else int(bits[i][j])))
        codes.append(row)
        scales.append(e4m3_code(float(scale)))
    return codes, scales, np.float32(np.float32(1.0) / s_enc)


def decode(code: int, scale_code: int, s_dec) -> float:
    """float64 value of one element: e2m1 * e4m3 * s_dec (NaN for the NaN scale)."""
    if scale_code == 0x7F:
        return math.nan
    e, m = scale_code >> 3, scale_code & 7
    scale = m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    v = E2M1[code & 7] * scale * float(s_dec)
    return -v if code & 8 else v


def quantize_rows(x_RN: np.ndarray, tensor_scale: bool = True, bits_RN=None):
    """1x16 blocks along the last axis of a 2-D array: (codes [R, n], scale codes
    [R, ceil(n/16)], s_dec)."""
    r, n = x_RN.shape
    nb = -(-n // BLOCK)
    blocks, bblocks = [], []
    for i in range(r):
        for b in range(nb):
            blocks.append(list(x_RN[i, b * BLOCK:(b + 1) * BLOCK]))
            if bits_RN is not None:
                bblocks.append(list(bits_RN[i, b * BLOCK:(b + 1) * BLOCK]))
    codes, scales, s_dec = quantize_blocks(blocks, tensor_scale, bblocks if bits_RN is not None
                                           else None)
    q = np.zeros((r, n), np.uint8)
    for i in range(r):
        for b in range(nb):
            c = codes[i * nb + b]
            q[i, b * BLOCK:b * BLOCK + len(c)] = c
    return q, np.array(scales, np.uint8).reshape(r, nb), s_dec


def quantize_tiles(w_GKN: np.ndarray, tensor_scale: bool = True):
    """16x16 tiles over the last two axes of [G, K, N] (one tensor scale for all of it):
    (codes [G, K, N], scale codes [G, ceil(K/16), ceil(N/16)], s_dec)."""
    g, k, n = w_GKN.shape
    kb, nb = -(-k // BLOCK), -(-n // BLOCK)
    blocks, where = [], []
    for e in range(g):
        for i in range(kb):
            for j in range(nb):
                t = w_GKN[e, i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK]
                blocks.append(list(t.reshape(-1)))
                where.append((e, i, j, t.shape))
    codes, scales, s_dec = quantize_blocks(blocks, tensor_scale)
    q = np.zeros((g, k, n), np.uint8)
    s = np.zeros((g, kb, nb), np.uint8)
    for c, sc, (e, i, j, shape) in zip(codes, scales, where):
        q[e, i * BLOCK:i * BLOCK + shape[0], j * BLOCK:j * BLOCK + shape[1]] = \
            np.array(c, np.uint8).reshape(shape)
        s[e, i, j] = sc
    return q, s, s_dec


def dequantize_rows(q_RN, scales_RB, s_dec) -> np.ndarray:
    r, n = q_RN.shape
    return np.array([[decode(int(q_RN[i, j]), int(scales_RB[i, j // BLOCK]), s_dec)
                      for j in range(n)] for i in range(r)])


def dequantize_tiles(q_GKN, scales_GIJ, s_dec) -> np.ndarray:
    g, k, n = q_GKN.shape
    out = np.zeros((g, k, n))
    for e in range(g):
        for i in range(k):
            for j in range(n):
                out[e, i, j] = decode(int(q_GKN[e, i, j]), int(scales_GIJ[e, i // BLOCK,
                                                                              j // BLOCK]), s_dec)
    return out


def aligned_rows(x_MK: np.ndarray, sizes_G) -> tuple[np.ndarray, list[int]]:
    """Each group's rows copied into a zero array at offsets that are multiples of 16 (groups
    padded to multiples of 16; rows past sum(sizes) left out). Returns (x [P, K], padded sizes);
    P here is just the padded total."""
    parts, padded, start = [], [], 0
    for s in sizes_G:
        s = int(s)
        ps = -(-s // BLOCK) * BLOCK
        part = np.zeros((ps, x_MK.shape[1]), x_MK.dtype)
        part[:s] = x_MK[start:start + s]
        parts.append(part)
        padded.append(ps)
        start += s
    return (np.concatenate(parts) if parts else np.zeros((0, x_MK.shape[1]))), padded


def sylvester_hadamard(n: int = BLOCK) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def hadamard_rows(x_PK: np.ndarray, signs_L: np.ndarray) -> np.ndarray:
    """Each 16-row block b replaced by (H16 diag(signs) / 4) @ b, in float64, then float32."""
    t = sylvester_hadamard() * signs_L[None, :] / 4.0
    p, k = x_PK.shape
    xb = x_PK.astype(np.float64).reshape(p // BLOCK, BLOCK, k)
    return np.einsum("ij,bjk->bik", t, xb).reshape(p, k).astype(np.float32)
