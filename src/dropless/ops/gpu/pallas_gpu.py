"""`pallas_gpu`: a grouped matmul written as Pallas kernels lowered through Triton (NVIDIA GPUs).

Legend: M rows (sorted by group), K contraction dim, N output dim, G groups, W work items
(one [group, row tile] pair each), C the contraction dim of a kernel call and O its output dim
(C=K, O=N forward; C=N, O=K for dlhs), bm/bc/bo the block sizes along M/C/O, P programs.

Three kernels under one custom VJP, all with the group sizes on device (no host sync, one
compile for every routing):
  forward  out[rows of g] = lhs[rows of g] @ rhs[g]     P = W * O/bo, an item's O-blocks adjacent
  dlhs     dlhs[rows of g] = dy[rows of g] @ rhs[g]^T   the same kernel, rhs read transposed
  drhs     drhs[g] = lhs[rows of g]^T @ dy[rows of g]   P = G * K/bk * N/bn, group-major,
                                                        largest group first; rows looped

Why a work list (the megablox idea, our code): each group's rows are cut into tiles of bm rows
that start at the group's first row, so a group of s rows costs cdiv(s, bm) tiles (tiles
aligned to bm in the global M axis cost one more visit at every boundary inside a tile: at
G=64 on 8192 rows that was about 2x the useful rows). A tile stores only its group's rows (a
masked store), so no two programs write one element and no atomics are needed. The tiles are
listed on device; W = (M + (G+1)(bm-1)) // bm bounds their number, so the grid is static and
surplus items do nothing. Rows past sum(group_sizes) form one more pseudo-group whose tiles
store zeros, so every output row is written exactly once (`ragged_dot`'s "zeros past the sum").

Aligned segments (`group_alignment=A`, the layout of `MoEConfig.align_expert_rows`): when A is a
multiple of bm every group starts and ends on a bm-row tile boundary, so the forward and dlhs
grid is plain: T = cdiv(M, bm) row tiles, tile t's group found from its first row t*bm (one
[T, G] comparison on device, no work list), every tile inside one group or the zero tail, no
row masks (only the tail's store at M when bm does not divide M), no surplus programs; drhs
loops over whole bm-row slices that start at its group's first row (no row masks). With
block_m given and not dividing A, or A = 1, the work list runs as above.

Program order (see pallas_plan.py for the model and the figures the bench prints): the forward
grid runs an item's O-blocks back to back, so its lhs tile is read from HBM once and then hit
in L2 (a work-items-fastest grid would run them W programs apart and re-read lhs O/bo times). drhs runs all
(K, N) blocks of one group together (its rows stay in L2) and the largest group first, so
under skew the long programs start early instead of forming the tail.

On CPU the same kernels run in Pallas interpret mode (slow, exact): that is how the numerics
are tested without a GPU. The platform is chosen at lowering time (`lax.platform_dependent`),
so a jitted function that calls this lowers to `__gpu$xla.gpu.triton` custom calls for CUDA.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from dropless.ops.gpu import pallas_plan


@dataclasses.dataclass(frozen=True, kw_only=True)
class PallasGpuConfig:
    """Block sizes and launch settings; None means the per-dtype default (`pallas_plan`).

    Defaults: 16-bit 64-deep steps, 128-wide outputs, 4 warps, 4 stages (wgmma on Hopper);
    float32 32x64 blocks, 3 stages (it runs without tensor cores and spilled at 128x128).
    block_m by default comes from the static shape: the largest of (128, 64) (f32: 64, 32) whose
    modeled rows computed per useful row stays <= 1.10, so with many small groups the tiles
    shrink (`pallas_plan.choose_block_m`). Every block size must be a power of two >= 16
    (Triton's `tl.dot`); blocks larger than a (small) operand are shrunk to fit it. A
    configuration whose pipeline needs more than an H100/H200 block's 227 KiB of shared memory
    is refused when traced (ValueError naming the options and the budget).
    `interpret`: None runs Triton on GPU and Pallas interpret mode on CPU, chosen per platform
    when lowering; True forces interpret mode everywhere (debugging).
    """

    block_m: int | None = None
    block_k: int | None = None
    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    interpret: bool | None = None

    def __post_init__(self):
        for name in ("block_m", "block_k", "block_n"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 16 or v & (v - 1)):
                raise ValueError(f"pallas_gpu {name}={v!r} must be a power of two >= 16")
        if self.num_warps is not None and (not isinstance(self.num_warps, int)
                                           or self.num_warps not in (1, 2, 4, 8, 16)):
            raise ValueError(f"pallas_gpu num_warps={self.num_warps!r} must be 1, 2, 4, 8 or 16")
        if self.num_stages is not None and (not isinstance(self.num_stages, int)
                                            or self.num_stages < 1):
            raise ValueError(f"pallas_gpu num_stages={self.num_stages!r} must be an int >= 1")
        if self.interpret not in (None, True, False):
            raise ValueError(f"pallas_gpu interpret={self.interpret!r} must be None, True or "
                             f"False")


OPTIONS = tuple(f.name for f in dataclasses.fields(PallasGpuConfig))


def _fit(block: int, dim: int) -> int:
    """The block, shrunk to the next power of two >= dim (at least 16) for small operands."""
    return min(block, max(16, pl.next_power_of_2(max(dim, 1))))


def kernel_blocks(cfg: PallasGpuConfig, kernel: str, dtype, m: int, c: int, o: int,
                  g: int, align: int = 1) -> pallas_plan.Blocks:
    """The concrete blocks of one kernel call: cfg's values or the dtype's defaults, shrunk to
    the operands. (c, o) are the kernel's contraction and output dims: fwd (K, N), dlhs (N, K),
    drhs (K, N) as its [bk, bn] output tile; `align` the call's `group_alignment` (the default
    bm divides it where a candidate does). Raises ValueError if shared memory cannot fit."""
    d = pallas_plan.DEFAULTS[pallas_plan.dtype_class(dtype)]
    bm = cfg.block_m if cfg.block_m is not None else pallas_plan.choose_block_m(m, g, dtype,
                                                                                align)
    blocks = pallas_plan.Blocks(
        bm=_fit(bm, m), bk=_fit(cfg.block_k or d["block_k"], c),
        bn=_fit(cfg.block_n or d["block_n"], o), num_warps=cfg.num_warps or d["num_warps"],
        num_stages=cfg.num_stages or d["num_stages"])
    explicit = {f: getattr(cfg, f) for f in OPTIONS[:5] if getattr(cfg, f) is not None}
    pallas_plan.check_smem(kernel, blocks, dtype, explicit)
    return blocks


def group_offsets(group_sizes_G: jax.Array, m: int) -> jax.Array:
    """[G+3] row offsets: groups 0..G-1, then the pseudo-group of rows past the sum (its rows
    must come out zero), then an empty pseudo-group that surplus work items point at.

    Example: sizes [5, 0, 3], m=10 -> [0, 5, 5, 8, 10, 10].
    """
    ends_G = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes_G, 0)), m).astype(jnp.int32)
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), ends_G, jnp.full((2,), m, jnp.int32)])


def num_work_items(m: int, num_groups: int, bm: int) -> int:
    """W: an upper bound on sum_g cdiv(s_g, bm) over the G groups and the zero tail."""
    return pallas_plan.row_tiles_launched(m, num_groups, bm, aligned=False)


def tile_groups(group_sizes_G: jax.Array, m: int, bm: int) -> jax.Array:
    """[cdiv(M, bm)] the group of each bm-row tile, from its first row t*bm: the g with
    start_g <= t*bm < end_g, G for tiles past the sum (the zero tail). Exact when every group
    size is a multiple of bm (aligned segments: no tile holds two groups).

    Hand-worked: sizes [4, 0, 8], m=16, bm=4 -> tiles at rows 0, 4, 8, 12 -> [0, 2, 2, 3].
    """
    ends_G = jnp.cumsum(jnp.maximum(group_sizes_G, 0)).astype(jnp.int32)
    row0_T = jnp.arange(pallas_plan.row_tiles_launched(m, 0, bm, aligned=True),
                        dtype=jnp.int32) * bm
    # compare_all: one fused [T, G] comparison (the default is a while loop on XLA:GPU)
    return jnp.searchsorted(ends_G, row0_T, side="right", method="compare_all").astype(
        jnp.int32)


def work_items(offsets: jax.Array, m: int, bm: int):
    """(group_W, row0_W): each work item's group and first row, all on device.

    Pseudo-groups 0..G (G = the zero tail) are cut into bm-row tiles from their first row;
    W = num_work_items(m, G, bm) bounds the count, surplus items get group G+1 (empty).

    Hand-worked: sizes [5, 0, 3], m=10, bm=4 -> offsets [0, 5, 5, 8, 10, 10]; g0 rows 0-4 ->
    tiles at rows 0, 4; g1 none; g2 rows 5-7 -> row 5; tail rows 8-9 -> row 8.
    W = (10 + 4 * 3) // 4 = 5: group_W = [0, 0, 2, 3, 4], row0_W = [0, 4, 5, 8, 0].
    """
    num = offsets.shape[0] - 2          # real groups + the zero tail
    starts, ends = offsets[:num], offsets[1:num + 1]
    n_tiles = (ends - starts + bm - 1) // bm
    cum = jnp.cumsum(n_tiles)
    item_W = jnp.arange(num_work_items(m, num - 1, bm), dtype=jnp.int32)
    # compare_all: one [W, G+1] comparison and row count, fused by XLA (the default "scan"
    # method is a binary search XLA:GPU runs as a while loop of log2(G+2) steps, its body's
    # kernels once a step, on every call; tests/ops/gpu/test_pallas_gpu_launches_gpu_compile.py)
    group_W = jnp.searchsorted(cum, item_W, side="right", method="compare_all").astype(
        jnp.int32)
    valid_W = item_W < cum[-1]
    safe_W = jnp.minimum(group_W, num - 1)
    row0_W = starts[safe_W] + (item_W - (cum - n_tiles)[safe_W]) * bm
    return (jnp.where(valid_W, group_W, num).astype(jnp.int32),
            jnp.where(valid_W, row0_W, 0).astype(jnp.int32))


def _in_bounds(ok_R, ok_C, shape, load=True) -> dict:
    """The mask keywords of a load (other=0) or store of a `shape` block whose rows ok_R and
    columns ok_C are in bounds (None: all of them); none at all when nothing can overhang."""
    if ok_R is None and ok_C is None:
        return {}
    ok_R = jnp.ones(shape[:1], bool) if ok_R is None else ok_R
    ok_C = jnp.ones(shape[1:], bool) if ok_C is None else ok_C
    return {"mask": ok_R[:, None] & ok_C[None, :], **({"other": 0} if load else {})}


def _dot(a, b, *, trans_a=False, trans_b=False):
    """f32-accumulating block product; full f32 precision for f32 inputs (no TF32)."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b, precision=precision)


def _gmm_kernel(group_ref, row0_ref, offsets_ref, lhs_ref, rhs_ref, out_ref, *, bm, bc, bo,
                c, o, num_groups, transpose_rhs, compute_dtype):
    """One (work item, output block): the bm rows of one group's tile times rhs[group]."""
    pid = pl.program_id(0)
    n_o = pl.cdiv(o, bo)
    item, j = pid // n_o, pid % n_o   # an item's output blocks run back to back (L2 reuse)
    g, row0 = group_ref[item], row0_ref[item]
    start, end = offsets_ref[g], offsets_ref[g + 1]
    rows_B = row0 + jnp.arange(bm)
    cols_O = j * bo + jnp.arange(bo)
    mine_B = (rows_B >= start) & (rows_B < end)   # surplus items: start = end = M, no rows
    real = g < num_groups     # the zero tail and surplus items do no arithmetic
    g_safe = jnp.minimum(g, num_groups - 1)

    def body(kk, acc):
        ks_C = kk * bc + jnp.arange(bc)
        x = plgpu.load(lhs_ref.at[pl.ds(row0, bm), pl.ds(kk * bc, bc)],
                       mask=mine_B[:, None] & (ks_C < c)[None, :], other=0)
        if transpose_rhs:   # rhs is [G, O, C]
            w = plgpu.load(rhs_ref.at[g_safe, pl.ds(j * bo, bo), pl.ds(kk * bc, bc)],
                           mask=(cols_O < o)[:, None] & (ks_C < c)[None, :], other=0)
        else:               # rhs is [G, C, O]
            w = plgpu.load(rhs_ref.at[g_safe, pl.ds(kk * bc, bc), pl.ds(j * bo, bo)],
                           mask=(ks_C < c)[:, None] & (cols_O < o)[None, :], other=0)
        return acc + _dot(x.astype(compute_dtype), w.astype(compute_dtype),
                          trans_b=transpose_rhs)

    # int32 on both sides: weak-typed literals lower as an i1 select, and scf.for needs its
    # bounds to share one type (XLA's Triton parser rejects the module otherwise)
    trips = jnp.where(real, jnp.int32(pl.cdiv(c, bc)), jnp.int32(0))
    acc = lax.fori_loop(jnp.int32(0), trips, body, jnp.zeros((bm, bo), jnp.float32))
    plgpu.store(out_ref.at[pl.ds(row0, bm), pl.ds(j * bo, bo)], acc.astype(out_ref.dtype),
                mask=mine_B[:, None] & (cols_O < o)[None, :])


def _aligned_kernel(group_ref, lhs_ref, rhs_ref, out_ref, *, bm, bc, bo, m, c, o,
                    num_groups, transpose_rhs, compute_dtype):
    """One (row tile, output block) of the aligned grid: the tile's bm rows all belong to
    group_ref[tile] (G: the zero tail), so only the K/N edges and, past M, the store mask."""
    pid = pl.program_id(0)
    n_o = pl.cdiv(o, bo)
    t, j = pid // n_o, pid % n_o      # a tile's output blocks run back to back (L2 reuse)
    g = group_ref[t]
    row0 = pl.multiple_of(t * bm, bm)
    cols_O = j * bo + jnp.arange(bo)
    real = g < num_groups             # the zero tail does no arithmetic
    g_safe = jnp.minimum(g, num_groups - 1)

    ok_O = None if o % bo == 0 else cols_O < o

    def body(kk, acc):
        ks_C = kk * bc + jnp.arange(bc)
        ok_C = None if c % bc == 0 else ks_C < c
        x = plgpu.load(lhs_ref.at[pl.ds(row0, bm), pl.ds(kk * bc, bc)],
                       **_in_bounds(None, ok_C, (bm, bc)))
        if transpose_rhs:   # rhs is [G, O, C]
            w = plgpu.load(rhs_ref.at[g_safe, pl.ds(j * bo, bo), pl.ds(kk * bc, bc)],
                           **_in_bounds(ok_O, ok_C, (bo, bc)))
        else:               # rhs is [G, C, O]
            w = plgpu.load(rhs_ref.at[g_safe, pl.ds(kk * bc, bc), pl.ds(j * bo, bo)],
                           **_in_bounds(ok_C, ok_O, (bc, bo)))
        return acc + _dot(x.astype(compute_dtype), w.astype(compute_dtype),
                          trans_b=transpose_rhs)

    trips = jnp.where(real, jnp.int32(pl.cdiv(c, bc)), jnp.int32(0))
    acc = lax.fori_loop(jnp.int32(0), trips, body, jnp.zeros((bm, bo), jnp.float32))
    ok_B = None if m % bm == 0 else row0 + jnp.arange(bm) < m   # only the tail's last tile
    plgpu.store(out_ref.at[pl.ds(row0, bm), pl.ds(j * bo, bo)], acc.astype(out_ref.dtype),
                **_in_bounds(ok_B, ok_O, (bm, bo), load=False))


def _gmm_call(lhs_MC, rhs, group_sizes_G, out_dtype, cfg, transpose_rhs, interpret, align=1):
    m, c = lhs_MC.shape
    num_groups = rhs.shape[0]
    o = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    compute_dtype = jnp.promote_types(lhs_MC.dtype, rhs.dtype)
    b = kernel_blocks(cfg, "dlhs" if transpose_rhs else "fwd", compute_dtype, m, c, o,
                      num_groups, align)
    name = "dropless_gmm_dlhs" if transpose_rhs else "dropless_gmm"
    params = plgpu.CompilerParams(num_warps=b.num_warps, num_stages=b.num_stages)
    if pallas_plan.is_aligned(align, b.bm):
        group_T = tile_groups(group_sizes_G, m, b.bm)
        kernel = functools.partial(
            _aligned_kernel, bm=b.bm, bc=b.bk, bo=b.bn, m=m, c=c, o=o, num_groups=num_groups,
            transpose_rhs=transpose_rhs, compute_dtype=compute_dtype)
        return pl.pallas_call(
            kernel, out_shape=jax.ShapeDtypeStruct((m, o), out_dtype),
            grid=(group_T.shape[0] * pl.cdiv(o, b.bn),), interpret=interpret,
            compiler_params=params, name=name + "_aligned",
        )(group_T, lhs_MC, rhs)
    offsets = group_offsets(group_sizes_G, m)
    group_W, row0_W = work_items(offsets, m, b.bm)
    kernel = functools.partial(
        _gmm_kernel, bm=b.bm, bc=b.bk, bo=b.bn, c=c, o=o, num_groups=num_groups,
        transpose_rhs=transpose_rhs, compute_dtype=compute_dtype)
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((m, o), out_dtype),
        grid=(group_W.shape[0] * pl.cdiv(o, b.bn),), interpret=interpret,
        compiler_params=params, name=name,
    )(group_W, row0_W, offsets, lhs_MC, rhs)


def _drhs_kernel(order_ref, offsets_ref, lhs_ref, dy_ref, out_ref, *, bm, bk, bn, k, n,
                 compute_dtype, aligned):
    """One (group, K block, N block) of drhs: loop over the group's rows in bm steps. Aligned:
    the group starts on a bm boundary and holds whole slices, so rows need no mask."""
    pid = pl.program_id(0)
    n_k, n_n = pl.cdiv(k, bk), pl.cdiv(n, bn)
    rank, rest = pid // (n_k * n_n), pid % (n_k * n_n)
    g, i, j = order_ref[rank], rest // n_n, rest % n_n   # one group's blocks together
    start, end = offsets_ref[g], offsets_ref[g + 1]
    ks_K = i * bk + jnp.arange(bk)
    cols_N = j * bn + jnp.arange(bn)

    def body(t, acc):
        row0 = start + t * bm
        if aligned:
            row0 = pl.multiple_of(row0, bm)
        mine_B = None if aligned else row0 + jnp.arange(bm) < end
        x = plgpu.load(lhs_ref.at[pl.ds(row0, bm), pl.ds(i * bk, bk)],
                       **_in_bounds(mine_B, None if k % bk == 0 else ks_K < k, (bm, bk)))
        dy = plgpu.load(dy_ref.at[pl.ds(row0, bm), pl.ds(j * bn, bn)],
                        **_in_bounds(mine_B, None if n % bn == 0 else cols_N < n, (bm, bn)))
        return acc + _dot(x.astype(compute_dtype), dy.astype(compute_dtype), trans_a=True)

    acc = lax.fori_loop(jnp.int32(0), pl.cdiv(end - start, bm), body,
                        jnp.zeros((bk, bn), jnp.float32))
    plgpu.store(out_ref.at[g, pl.ds(i * bk, bk), pl.ds(j * bn, bn)], acc.astype(out_ref.dtype),
                mask=(ks_K < k)[:, None] & (cols_N < n)[None, :])


def group_order(group_sizes_G: jax.Array) -> jax.Array:
    """[G] groups by decreasing size (stable): drhs launches the longest row loops first."""
    return jnp.argsort(-jnp.maximum(group_sizes_G, 0), stable=True).astype(jnp.int32)


def _drhs_call(lhs_MK, dy_MN, group_sizes_G, out_dtype, cfg, interpret, align=1):
    m, k = lhs_MK.shape
    n, g = dy_MN.shape[1], group_sizes_G.shape[0]
    compute_dtype = jnp.promote_types(lhs_MK.dtype, dy_MN.dtype)
    b = kernel_blocks(cfg, "drhs", compute_dtype, m, k, n, g, align)
    offsets = group_offsets(group_sizes_G, m)
    kernel = functools.partial(_drhs_kernel, bm=b.bm, bk=b.bk, bn=b.bn, k=k, n=n,
                               compute_dtype=compute_dtype,
                               aligned=pallas_plan.is_aligned(align, b.bm))
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((g, k, n), out_dtype),
        grid=(g * pl.cdiv(k, b.bk) * pl.cdiv(n, b.bn),), interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=b.num_warps, num_stages=b.num_stages),
        name="dropless_gmm_drhs",
    )(group_order(group_sizes_G), offsets, lhs_MK, dy_MN)


def _per_platform(call, cfg, *args):
    """Interpret mode on CPU, Triton elsewhere, picked when lowering (or forced by cfg)."""
    if cfg.interpret is not None:
        return call(*args, interpret=cfg.interpret)
    return lax.platform_dependent(*args, cpu=functools.partial(call, interpret=True),
                                  default=functools.partial(call, interpret=False))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _pallas_gmm(lhs_MK, rhs_GKN, group_sizes_G, out_dtype, cfg, align):
    call = functools.partial(_gmm_call, out_dtype=out_dtype, cfg=cfg, transpose_rhs=False,
                             align=align)
    return _per_platform(call, cfg, lhs_MK, rhs_GKN, group_sizes_G)


def _pallas_fwd(lhs_MK, rhs_GKN, group_sizes_G, out_dtype, cfg, align):
    return (_pallas_gmm(lhs_MK, rhs_GKN, group_sizes_G, out_dtype, cfg, align),
            (lhs_MK, rhs_GKN, group_sizes_G))


def _pallas_bwd(out_dtype, cfg, align, res, dy_MN):
    lhs_MK, rhs_GKN, group_sizes_G = res
    dlhs = functools.partial(_gmm_call, out_dtype=lhs_MK.dtype, cfg=cfg, transpose_rhs=True,
                             align=align)
    dlhs_MK = _per_platform(dlhs, cfg, dy_MN, rhs_GKN, group_sizes_G)
    drhs = functools.partial(_drhs_call, out_dtype=rhs_GKN.dtype, cfg=cfg, align=align)
    drhs_GKN = _per_platform(drhs, cfg, lhs_MK, dy_MN, group_sizes_G)
    return dlhs_MK, drhs_GKN, None


_pallas_gmm.defvjp(_pallas_fwd, _pallas_bwd)


def pallas_gpu_gmm(lhs_MK, rhs_GKN, group_sizes_G, *, out_dtype, group_alignment: int = 1,
                   **options):
    """Grouped matmul by Pallas/Triton kernels; options are `PallasGpuConfig` fields.

    `group_alignment`: every group size is a multiple of it (checked by `grouped_matmul` where
    the sizes are concrete; under jit it is the caller's promise, as the aligned layout keeps
    it); where it is a multiple of the row block the aligned grid runs (module docstring).
    Shapes are checked by the caller (`grouped_matmul`). Raises ValueError naming a bad option.
    """
    cfg = PallasGpuConfig(**options)
    m, n = lhs_MK.shape[0], rhs_GKN.shape[2]
    if m == 0 or rhs_GKN.shape[0] == 0 or lhs_MK.shape[1] == 0:
        return jnp.zeros((m, n), out_dtype)
    return _pallas_gmm(lhs_MK, rhs_GKN, group_sizes_G, jnp.dtype(out_dtype), cfg,
                       int(group_alignment))
