"""The grouped SwiGLU expert FFN as a float64 NumPy loop, and every gradient: the reference the
native library's fused FFN is checked against; random float32 operands; the comparison.

Legend: M rows (sorted by group), D model dim, F expert hidden dim, G groups.
"""
import numpy as np


def ffn_operands(m: int, d: int, f: int, groups: int = 4, seed: int = 3, scale: float = 0.1):
    """Random float32 x_MD, wg_GDF, wu_GDF (times `scale`), wd_GFD (times `scale`), dy_MD."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, d)).astype(np.float32)
    wg, wu = (rng.standard_normal((groups, d, f)).astype(np.float32) * scale for _ in range(2))
    wd = rng.standard_normal((groups, f, d)).astype(np.float32) * scale
    dy = rng.standard_normal((m, d)).astype(np.float32)
    return x, wg, wu, wd, dy


def np_swiglu_ffn(x, wg, wu, wd, sizes, dy):
    """float64 loop: y = down(silu(x @ gate) * (x @ up)) per group, and every gradient
    (dx, dwg, dwu, dwd); rows past the sum of `sizes` are zero."""
    x, wg, wu, wd, dy = (np.asarray(a, np.float64) for a in (x, wg, wu, wd, dy))
    y, dx = np.zeros_like(dy), np.zeros_like(x)
    dwg, dwu, dwd = np.zeros_like(wg), np.zeros_like(wu), np.zeros_like(wd)
    start = 0
    for e, n in enumerate(sizes):
        r = slice(start, start + n)
        start += n
        g, u = x[r] @ wg[e], x[r] @ wu[e]
        s = 1 / (1 + np.exp(-g))
        h = g * s * u
        y[r] = h @ wd[e]
        dh = dy[r] @ wd[e].T
        dg, du = dh * u * (s + g * s * (1 - s)), dh * g * s
        dx[r] = dg @ wg[e].T + du @ wu[e].T
        dwg[e], dwu[e], dwd[e] = x[r].T @ dg, x[r].T @ du, h.T @ dy[r]
    return y, (dx, dwg, dwu, dwd)


def assert_matches_np_swiglu_ffn(y, grads, x, wg, wu, wd, sizes, dy, floor: float = 1e-6):
    """`y` and `grads` (dx, dwg, dwu, dwd) against the float64 loop: rtol 1e-4 and an atol of
    1e-4 of each output's largest magnitude (float32 sums over D or F terms), plus `floor` for
    outputs that are all zero (empty groups)."""
    want_y, want = np_swiglu_ffn(x, wg, wu, wd, sizes, dy)
    np.testing.assert_allclose(y, want_y, rtol=1e-4, atol=1e-4 * np.abs(want_y).max() + floor)
    for name, a, b in zip(("dx", "dwg", "dwu", "dwd"), grads, want):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * np.abs(b).max() + floor,
                                   err_msg=name)
