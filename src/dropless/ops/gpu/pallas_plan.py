"""How `pallas_gpu` sizes and orders its work: per-dtype defaults, `block_m` from the static
shape, the shared-memory budget check, and the cost model the bench prints.

Legend: M rows (sorted by group), K contraction dim, N output dim, G groups, W work items,
S programs resident on the GPU at once, bm/bk/bn block sizes, s_g rows of group g.

Everything here is plain Python/NumPy on static shapes (and, for the figures, on host-side
group sizes): nothing is traced, so it costs nothing at run time and is the same on every
platform. The figures are a model, not a measurement: no device has timed these kernels yet.

Work items (see pallas_gpu.py) start at each group's first row, so a group of s_g rows costs
cdiv(s_g, bm) tiles; bm-aligned tiles (the baseline the bench compares with) cost one more
visit at each group boundary inside a tile. Rows computed per useful row:
  group_start = sum_g cdiv(s_g, bm) * bm / sum_g s_g
  aligned     = sum_g (tiles s_g's rows touch) * bm / sum_g s_g
With aligned segments (`group_alignment` a multiple of bm: every group starts and ends on a
tile boundary) the kernel's grid is cdiv(M, bm) plain row tiles instead of the work list's
bound W (`row_tiles_launched`); the tiles doing arithmetic are sum_g cdiv(s_g, bm) either way
(`row_tiles_as_run`), the aligned layout's zero padding rows included.
"""
from __future__ import annotations

import dataclasses
import heapq

import numpy as np

H200_SMEM_PER_BLOCK = 227 * 1024   # bytes of shared memory one block may use (sm_90)
H200_SMEM_PER_SM = 228 * 1024
H200_SMS = 132
WASTE_TARGET = 1.10                 # largest bm whose modeled rows ratio stays under this
# the rows pallas_gpu wants expert segments aligned to (its registry `row_block`): the largest
# block_m candidate; every candidate of every dtype divides it, so each runs the aligned grid
ALIGNED_ROW_BLOCK = 128

# Per dtype class: block_m candidates (largest first) and the other defaults. 16-bit: 128x128
# output tiles, 64-deep steps, 4 stages (wgmma; 64 is wgmma's native rows per warpgroup, so
# bm=64 keeps it). float32 (full precision, no tensor cores): smaller tiles and 3 stages keep
# the accumulator and operands in registers (the 128x128 f32 tiles spilled, 255 registers).
DEFAULTS = {
    "16bit": dict(block_m=(128, 64), block_k=64, block_n=128, num_warps=4, num_stages=4),
    "float32": dict(block_m=(64, 32), block_k=32, block_n=64, num_warps=4, num_stages=3),
}


@dataclasses.dataclass(frozen=True)
class Blocks:
    """The concrete launch settings of one kernel call (after defaults and shrinking)."""

    bm: int
    bk: int
    bn: int
    num_warps: int
    num_stages: int


def dtype_class(dtype) -> str:
    """'float32' for 4-byte compute dtypes, else '16bit' (bf16, f16)."""
    return "float32" if np.dtype(dtype).itemsize >= 4 else "16bit"


def modeled_rows_ratio(m: int, g: int, bm: int) -> float:
    """Expected rows computed per useful row for group-start tiles, from (M, G) alone.

    Each group of about M/G rows wastes about (bm-1)/2 rows in its last tile; a group smaller
    than bm costs a whole tile. E.g. M=8192, G=64: bm=128 -> 1.50, bm=64 -> 1.25.
    """
    if m <= 0 or g <= 0:
        return 1.0
    return max(1.0 + g * (bm - 1) / (2.0 * m), min(g, m) * bm / m)


def choose_block_m(m: int, g: int, dtype, align: int = 1) -> int:
    """With segments aligned to `align` rows (`group_alignment`), the largest candidate that
    divides it (no tile straddles two groups, so no rows are wasted); else the largest
    candidate whose modeled rows ratio is <= WASTE_TARGET, else the smallest candidate (small
    groups: the smallest tile wastes least)."""
    cands = DEFAULTS[dtype_class(dtype)]["block_m"]
    fits = [bm for bm in cands if is_aligned(align, bm)]
    if fits:
        return fits[0]
    for bm in cands:
        if modeled_rows_ratio(m, g, bm) <= WASTE_TARGET:
            return bm
    return cands[-1]


def is_aligned(align: int, bm: int) -> bool:
    """Whether a call with `group_alignment=align` runs the aligned grid at row block bm:
    every group then starts and ends at a multiple of bm (align > 1 and a multiple of bm)."""
    return align > 1 and align % bm == 0


def row_tiles_launched(m: int, g: int, bm: int, aligned: bool) -> int:
    """Row tiles in the fwd/dlhs grid (each runs cdiv(O, bo) programs): aligned, one per bm
    rows, cdiv(M, bm); else the work list's static bound W = (M + (G+1)(bm-1)) // bm (group-start
    tiles of the G groups and the zero tail; surplus items do nothing)."""
    if aligned:
        return max(1, -(-m // bm))
    return max(1, (m + (g + 1) * (bm - 1)) // bm)


def row_tiles_as_run(sizes_G, m: int, dtype, align: int = 1, block_m: int | None = None) -> dict:
    """pallas_gpu's fwd/dlhs row tiles for these (host-side) group sizes over m rows, as the
    kernel runs them: `block_m` (default: the one it chooses), whether the aligned grid runs,
    `tiles_launched` (the grid's row tiles) and `tiles_computed` (those doing arithmetic:
    sum_g cdiv(s_g, bm) on either path; the rest store zeros or nothing). With align > 1 the
    sizes are the aligned layout's (each a multiple of align) and m its rows."""
    s = np.asarray(sizes_G, np.int64)
    bm = block_m or choose_block_m(m, len(s), dtype, align)
    aligned = is_aligned(align, bm)
    return {"block_m": bm, "aligned": aligned,
            "tiles_launched": row_tiles_launched(m, len(s), bm, aligned),
            "tiles_computed": int((-(-s // bm)).sum())}


def uses_wgmma(kernel: str, blocks: Blocks, dtype) -> bool:
    """Whether Triton emits Hopper wgmma: 16-bit operands and >= 64 rows of the MMA's M side
    per warpgroup (fwd/dlhs: bm; drhs, whose output tile is [bk, bn]: bk)."""
    rows = blocks.bk if kernel == "drhs" else blocks.bm
    return dtype_class(dtype) == "16bit" and rows >= 64 * max(1, blocks.num_warps // 4)


def smem_bytes(kernel: str, blocks: Blocks, dtype) -> int:
    """Shared memory Triton's software pipeline allocates for one block of `kernel`.

    Per stage one tile of each operand: fwd/dlhs [bm, bk] + [bk, bn], drhs [bm, bk] + [bm, bn].
    Triton keeps num_stages buffers on the wgmma path and num_stages - 1 on the others (as
    triton 3.6 compiles these kernels for cuda:90; tests/ops/gmm/test_triton_check_sm90.py checks it).
    """
    b = blocks
    a_tile = b.bm * b.bk
    b_tile = b.bm * b.bn if kernel == "drhs" else b.bk * b.bn
    item = np.dtype(dtype).itemsize
    buffers = b.num_stages if uses_wgmma(kernel, b, dtype) else max(1, b.num_stages - 1)
    return buffers * (a_tile + b_tile) * item


def check_smem(kernel: str, blocks: Blocks, dtype, explicit: dict) -> None:
    """Raise ValueError (one line naming the options and the budget) if `kernel` cannot fit a
    block's shared memory on an H100/H200."""
    need = smem_bytes(kernel, blocks, dtype)
    if need <= H200_SMEM_PER_BLOCK:
        return
    named = ", ".join(f"{k}={v}" for k, v in explicit.items()) or "the defaults"
    raise ValueError(
        f"pallas_gpu {named}: the {kernel} kernel in {np.dtype(dtype).name} needs "
        f"{need // 1024} KiB of shared memory per block (num_stages={blocks.num_stages}, "
        f"blocks {blocks.bm}x{blocks.bk}x{blocks.bn}); an H100/H200 block has "
        f"{H200_SMEM_PER_BLOCK // 1024} KiB: lower num_stages or a block size")


# ---- figures for the bench and the docs (host-side sizes) ----

def rows_computed_ratio(sizes_G, bm: int, scheme: str = "group_start") -> float:
    """Exact rows computed per useful row for these group sizes (see the module docstring)."""
    s = np.asarray(sizes_G, np.int64)
    useful = int(s.sum())
    if useful == 0:
        return 1.0
    if scheme == "group_start":
        tiles = -(-s // bm)
    elif scheme == "aligned":
        ends = np.cumsum(s)
        starts = ends - s
        tiles = np.where(s > 0, (ends - 1) // bm - starts // bm + 1, 0)
    else:
        raise ValueError(f"scheme={scheme!r} must be 'group_start' or 'aligned'")
    return float(tiles.sum() * bm / useful)


def _items(sizes_G, bm: int, scheme: str):
    """(group, first row) of every real work item, in launch order."""
    s = np.asarray(sizes_G, np.int64)
    ends = np.cumsum(s)
    starts = ends - s
    out = []
    for g in range(len(s)):
        if s[g] == 0:
            continue
        if scheme == "group_start":
            out += [(g, int(r)) for r in range(int(starts[g]), int(ends[g]), bm)]
        else:
            out += [(g, t * bm) for t in range(int(starts[g]) // bm, (int(ends[g]) - 1) // bm + 1)]
    return out


def resident_programs(kernel: str, blocks: Blocks, dtype) -> int:
    """S: programs running at once (blocks per SM by shared memory, times the SMs)."""
    per_sm = max(1, H200_SMEM_PER_SM // max(1, smem_bytes(kernel, blocks, dtype)))
    return H200_SMS * per_sm


def _wave_bytes(reads, s: int) -> int:
    """HBM bytes if programs run in launch order in waves of s, each distinct block read once
    per wave (L2 holds what one wave shares, nothing across waves: a pessimistic cache)."""
    total = 0
    for w in range(0, len(reads), s):
        seen = {}
        for prog in reads[w:w + s]:
            for key, nbytes in prog:
                seen[key] = nbytes
        total += sum(seen.values())
    return total


def gmm_traffic(sizes_G, k: int, n: int, blocks: Blocks, dtype, *, order: str = "new") -> dict:
    """Modeled HBM bytes per useful FLOP of the forward kernel (dlhs: swap k and n).

    order 'new': each work item's N-blocks are adjacent (this kernel); 'old': work items
    fastest (the baseline grid), so one lhs tile's N-blocks run W programs apart.
    """
    item = np.dtype(dtype).itemsize
    bm, bk, bn = blocks.bm, blocks.bk, blocks.bn
    scheme = "group_start" if order == "new" else "aligned"
    items = _items(sizes_G, bm, scheme)
    nb = -(-n // bn)
    progs = [(w, j) for w in range(len(items)) for j in range(nb)] if order == "new" else \
            [(w, j) for j in range(nb) for w in range(len(items))]
    reads = [((("x", items[w][1]), bm * k * item), (("w", items[w][0], j), k * bn * item))
             for w, j in progs]
    flops = 2.0 * float(np.sum(sizes_G)) * k * n
    hbm = _wave_bytes(reads, resident_programs("fwd", blocks, dtype)) + \
        float(np.sum(sizes_G)) * n * item
    return {"hbm_bytes": hbm, "bytes_per_flop": hbm / max(flops, 1.0),
            "lhs_reads": _wave_bytes([r[:1] for r in reads], resident_programs(
                "fwd", blocks, dtype)) / max(float(np.sum(sizes_G)) * k * item, 1.0)}


def drhs_schedule(sizes_G, k: int, n: int, blocks: Blocks, dtype, *,
                  order: str = "new") -> dict:
    """Modeled drhs: HBM bytes per useful FLOP and the makespan of greedy scheduling on S slots,
    each program lasting (its group's row-loop trips + 1), relative to a perfect split.

    order 'new': group-major, largest group first (this kernel); 'old': groups fastest.
    """
    item = np.dtype(dtype).itemsize
    s = np.asarray(sizes_G, np.int64)
    g_count, kb, nb = len(s), -(-k // blocks.bk), -(-n // blocks.bn)
    trips = -(-s // blocks.bm)
    if order == "new":
        ranks = np.argsort(-s, kind="stable")
        progs = [(int(g), i, j) for g in ranks for i in range(kb) for j in range(nb)]
    else:
        progs = [(g, i, j) for j in range(nb) for i in range(kb) for g in range(g_count)]
    reads = [((("x", g, i), int(s[g]) * blocks.bk * item), (("dy", g, j), int(s[g]) * blocks.bn * item))
             for g, i, j in progs]
    slots = resident_programs("drhs", blocks, dtype)
    hbm = _wave_bytes(reads, slots) + g_count * k * n * item
    flops = 2.0 * float(s.sum()) * k * n
    heap = [0.0] * slots
    for g, _, _ in progs:   # list scheduling in launch order: the next program takes a free slot
        heapq.heapreplace(heap, heap[0] + float(trips[g]) + 1.0)
    ideal = float(np.sum((trips + 1.0) * kb * nb)) / slots
    return {"bytes_per_flop": hbm / max(flops, 1.0), "makespan_vs_ideal": max(heap) / ideal,
            "max_trips": int(trips.max(initial=0)), "mean_trips": float(trips.mean())}


def model_figures(sizes_G, m: int, k: int, n: int, dtype) -> dict:
    """The bench's model record: rows computed per useful row before (aligned tiles, bm=128)
    and after (group-start tiles at the chosen bm), and modeled bytes per FLOP and drhs
    makespan, old vs new program order, at this kernel's default blocks."""
    d = DEFAULTS[dtype_class(dtype)]
    g = len(sizes_G)
    bm = choose_block_m(m, g, dtype)
    old = Blocks(128, 64, 128, 4, 4)          # the baseline blocks, every dtype
    new = Blocks(bm, d["block_k"], d["block_n"], d["num_warps"], d["num_stages"])
    f_old, f_new = gmm_traffic(sizes_G, k, n, old, dtype, order="old"), \
        gmm_traffic(sizes_G, k, n, new, dtype)
    r_old, r_new = drhs_schedule(sizes_G, k, n, old, dtype, order="old"), \
        drhs_schedule(sizes_G, k, n, new, dtype)
    return {"block_m": bm,
            "rows_per_useful_row": {"before": rows_computed_ratio(sizes_G, 128, "aligned"),
                                    "after": rows_computed_ratio(sizes_G, bm)},
            "fwd_bytes_per_flop": {"before": f_old["bytes_per_flop"],
                                   "after": f_new["bytes_per_flop"]},
            "fwd_lhs_reads": {"before": f_old["lhs_reads"], "after": f_new["lhs_reads"]},
            "drhs_bytes_per_flop": {"before": r_old["bytes_per_flop"],
                                    "after": r_new["bytes_per_flop"]},
            "drhs_makespan_vs_ideal": {"before": r_old["makespan_vs_ideal"],
                                       "after": r_new["makespan_vs_ideal"]}}
