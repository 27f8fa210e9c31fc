"""`pallas_gpu`: a grouped matmul written as Pallas kernels lowered through Triton (NVIDIA GPUs).

Legend: M rows (sorted by group), K contraction dim, N output dim, G groups, W work items
(one [row tile, group] pair each), C the contraction dim of a kernel call and O its output dim
(C=K, O=N forward; C=N, O=K for dlhs), bm/bc/bo the block sizes along M/C/O.

Three kernels under one custom VJP, all with the group sizes on device (no host sync, one
compile for every routing):
  forward  out[rows of g] = lhs[rows of g] @ rhs[g]          grid (W, O/bo)
  dlhs     dlhs[rows of g] = dy[rows of g] @ rhs[g]^T        the same kernel, rhs read transposed
  drhs     drhs[g] = lhs[rows of g]^T @ dy[rows of g]        grid (G, K/bc, N/bo), rows looped

Why a work list (the megablox idea, our code): the row tiles are aligned to `bm` in the global
M axis; a tile whose rows belong to several groups is visited once per group, and each visit
stores only its own group's rows (a masked store), so visits of one tile never write the same
element and need no atomics. The visits are listed on device: W = cdiv(M, bm) + G bounds their
number (each group boundary adds at most one visit), so the grid is static and surplus items
do nothing. Rows past sum(group_sizes) form one more pseudo-group whose visits store zeros,
so every output row is written exactly once, and `ragged_dot`'s "zeros past the sum" holds.

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


@dataclasses.dataclass(frozen=True, kw_only=True)
class PallasGpuConfig:
    """Block sizes and launch settings; one set for all three kernels.

    The defaults suit Hopper (H100/H200) bf16: 128x128 output tiles with a 64-deep contraction
    step keep a 4-stage software pipeline in shared memory (4 * (128*64 + 64*128) * 2 bytes =
    128 KiB of the 228 KiB per SM). Every block size must be a power of two >= 16 (Triton's
    `tl.dot` needs that); blocks larger than a (small) operand are shrunk to fit it.
    `interpret`: None runs Triton on GPU and Pallas interpret mode on CPU, chosen per platform
    when lowering; True forces interpret mode everywhere (debugging).
    """

    block_m: int = 128
    block_k: int = 64
    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 4
    interpret: bool | None = None

    def __post_init__(self):
        for name in ("block_m", "block_k", "block_n"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 16 or v & (v - 1):
                raise ValueError(f"pallas_gpu {name}={v!r} must be a power of two >= 16")
        if not isinstance(self.num_warps, int) or self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"pallas_gpu num_warps={self.num_warps!r} must be 1, 2, 4, 8 or 16")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"pallas_gpu num_stages={self.num_stages!r} must be an int >= 1")
        if self.interpret not in (None, True, False):
            raise ValueError(f"pallas_gpu interpret={self.interpret!r} must be None, True or "
                             f"False")


OPTIONS = tuple(f.name for f in dataclasses.fields(PallasGpuConfig))


def _fit(block: int, dim: int) -> int:
    """The block, shrunk to the next power of two >= dim (at least 16) for small operands."""
    return min(block, max(16, pl.next_power_of_2(max(dim, 1))))


def group_offsets(group_sizes_G: jax.Array, m: int) -> jax.Array:
    """[G+3] row offsets: groups 0..G-1, then the pseudo-group of rows past the sum (its rows
    must come out zero), then an empty pseudo-group that surplus work items point at.

    Example: sizes [5, 0, 3], m=10 -> [0, 5, 5, 8, 10, 10].
    """
    ends_G = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes_G, 0)), m).astype(jnp.int32)
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), ends_G, jnp.full((2,), m, jnp.int32)])


def work_items(offsets: jax.Array, m: int, bm: int):
    """(group_W, tile_W): the (group, row tile) visits of the forward grid, all on device.

    Pseudo-groups 0..G (G = the zero tail) each visit the bm-aligned tiles their rows touch;
    W = cdiv(m, bm) + G is an upper bound on the visits, and surplus items get group G+1 (empty).

    Hand-worked: sizes [5, 0, 3], m=10, bm=4 -> offsets [0, 5, 5, 8, 10, 10]; tiles touched:
    g0 rows 0-4 -> tiles 0, 1; g1 none; g2 rows 5-7 -> tile 1; tail rows 8-9 -> tile 2.
    W = 3 + 3 = 6: group_W = [0, 0, 2, 3, 4, 4], tile_W = [0, 1, 1, 2, 0, 0].
    """
    num = offsets.shape[0] - 2          # real groups + the zero tail
    starts, ends = offsets[:num], offsets[1:num + 1]
    first = starts // bm
    n_tiles = jnp.where(ends > starts, (ends - 1) // bm - first + 1, 0)
    cum = jnp.cumsum(n_tiles)
    w = pl.cdiv(m, bm) + num - 1
    item_W = jnp.arange(w, dtype=jnp.int32)
    group_W = jnp.searchsorted(cum, item_W, side="right").astype(jnp.int32)
    valid_W = item_W < cum[-1]
    safe_W = jnp.minimum(group_W, num - 1)
    tile_W = first[safe_W] + item_W - (cum - n_tiles)[safe_W]
    return (jnp.where(valid_W, group_W, num).astype(jnp.int32),
            jnp.where(valid_W, tile_W, 0).astype(jnp.int32))


def _dot(a, b, *, trans_a=False, trans_b=False):
    """f32-accumulating block product; full f32 precision for f32 inputs (no TF32)."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b, precision=precision)


def _gmm_kernel(group_ref, tile_ref, offsets_ref, lhs_ref, rhs_ref, out_ref, *, bm, bc, bo,
                c, o, num_groups, transpose_rhs, compute_dtype):
    """One (work item, output block): rows of one group in one row tile times rhs[group]."""
    item, j = pl.program_id(0), pl.program_id(1)
    g, tile = group_ref[item], tile_ref[item]
    start, end = offsets_ref[g], offsets_ref[g + 1]
    rows_B = tile * bm + jnp.arange(bm)
    cols_O = j * bo + jnp.arange(bo)
    mine_B = (rows_B >= start) & (rows_B < end)
    real = g < num_groups  # the zero tail and surplus items do no arithmetic
    g_safe = jnp.minimum(g, num_groups - 1)

    def body(kk, acc):
        ks_C = kk * bc + jnp.arange(bc)
        x = plgpu.load(lhs_ref.at[pl.ds(tile * bm, bm), pl.ds(kk * bc, bc)],
                       mask=mine_B[:, None] & (ks_C < c)[None, :], other=0)
        if transpose_rhs:   # rhs is [G, O, C]
            w = plgpu.load(rhs_ref.at[g_safe, pl.ds(j * bo, bo), pl.ds(kk * bc, bc)],
                           mask=(cols_O < o)[:, None] & (ks_C < c)[None, :], other=0)
        else:               # rhs is [G, C, O]
            w = plgpu.load(rhs_ref.at[g_safe, pl.ds(kk * bc, bc), pl.ds(j * bo, bo)],
                           mask=(ks_C < c)[:, None] & (cols_O < o)[None, :], other=0)
        return acc + _dot(x.astype(compute_dtype), w.astype(compute_dtype),
                          trans_b=transpose_rhs)

    trips = jnp.where(real & (end > start), pl.cdiv(c, bc), 0)
    acc = lax.fori_loop(0, trips, body, jnp.zeros((bm, bo), jnp.float32))
    plgpu.store(out_ref.at[pl.ds(tile * bm, bm), pl.ds(j * bo, bo)], acc.astype(out_ref.dtype),
                mask=mine_B[:, None] & (cols_O < o)[None, :])


def _gmm_call(lhs_MC, rhs, group_sizes_G, out_dtype, cfg, transpose_rhs, interpret):
    m, c = lhs_MC.shape
    num_groups = rhs.shape[0]
    o = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    bm, bc, bo = _fit(cfg.block_m, m), _fit(cfg.block_k, c), _fit(cfg.block_n, o)
    offsets = group_offsets(group_sizes_G, m)
    group_W, tile_W = work_items(offsets, m, bm)
    kernel = functools.partial(
        _gmm_kernel, bm=bm, bc=bc, bo=bo, c=c, o=o, num_groups=num_groups,
        transpose_rhs=transpose_rhs, compute_dtype=jnp.promote_types(lhs_MC.dtype, rhs.dtype))
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((m, o), out_dtype),
        grid=(group_W.shape[0], pl.cdiv(o, bo)), interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps,
                                             num_stages=cfg.num_stages),
        name="dropless_gmm_dlhs" if transpose_rhs else "dropless_gmm",
    )(group_W, tile_W, offsets, lhs_MC, rhs)


def _drhs_kernel(offsets_ref, lhs_ref, dy_ref, out_ref, *, bm, bk, bn, k, n, compute_dtype):
    """One (group, K block, N block) of drhs: loop over the group's rows in bm steps."""
    g, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, end = offsets_ref[g], offsets_ref[g + 1]
    ks_K = i * bk + jnp.arange(bk)
    cols_N = j * bn + jnp.arange(bn)

    def body(t, acc):
        rows_B = start + t * bm + jnp.arange(bm)
        mine_B = rows_B < end
        x = plgpu.load(lhs_ref.at[pl.ds(start + t * bm, bm), pl.ds(i * bk, bk)],
                       mask=mine_B[:, None] & (ks_K < k)[None, :], other=0)
        dy = plgpu.load(dy_ref.at[pl.ds(start + t * bm, bm), pl.ds(j * bn, bn)],
                        mask=mine_B[:, None] & (cols_N < n)[None, :], other=0)
        return acc + _dot(x.astype(compute_dtype), dy.astype(compute_dtype), trans_a=True)

    acc = lax.fori_loop(0, pl.cdiv(end - start, bm), body, jnp.zeros((bk, bn), jnp.float32))
    plgpu.store(out_ref.at[g, pl.ds(i * bk, bk), pl.ds(j * bn, bn)], acc.astype(out_ref.dtype),
                mask=(ks_K < k)[:, None] & (cols_N < n)[None, :])


def _drhs_call(lhs_MK, dy_MN, group_sizes_G, out_dtype, cfg, interpret):
    m, k = lhs_MK.shape
    n, g = dy_MN.shape[1], group_sizes_G.shape[0]
    bm, bk, bn = _fit(cfg.block_m, m), _fit(cfg.block_k, k), _fit(cfg.block_n, n)
    offsets = group_offsets(group_sizes_G, m)
    kernel = functools.partial(_drhs_kernel, bm=bm, bk=bk, bn=bn, k=k, n=n,
                               compute_dtype=jnp.promote_types(lhs_MK.dtype, dy_MN.dtype))
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((g, k, n), out_dtype),
        grid=(g, pl.cdiv(k, bk), pl.cdiv(n, bn)), interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps,
                                             num_stages=cfg.num_stages),
        name="dropless_gmm_drhs",
    )(offsets, lhs_MK, dy_MN)


def _per_platform(call, cfg, *args):
    """Interpret mode on CPU, Triton elsewhere, picked when lowering (or forced by cfg)."""
    if cfg.interpret is not None:
        return call(*args, interpret=cfg.interpret)
    return lax.platform_dependent(*args, cpu=functools.partial(call, interpret=True),
                                  default=functools.partial(call, interpret=False))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _pallas_gmm(lhs_MK, rhs_GKN, group_sizes_G, out_dtype, cfg):
    call = functools.partial(_gmm_call, out_dtype=out_dtype, cfg=cfg, transpose_rhs=False)
    return _per_platform(call, cfg, lhs_MK, rhs_GKN, group_sizes_G)


def _pallas_fwd(lhs_MK, rhs_GKN, group_sizes_G, out_dtype, cfg):
    return (_pallas_gmm(lhs_MK, rhs_GKN, group_sizes_G, out_dtype, cfg),
            (lhs_MK, rhs_GKN, group_sizes_G))


def _pallas_bwd(out_dtype, cfg, res, dy_MN):
    lhs_MK, rhs_GKN, group_sizes_G = res
    dlhs = functools.partial(_gmm_call, out_dtype=lhs_MK.dtype, cfg=cfg, transpose_rhs=True)
    dlhs_MK = _per_platform(dlhs, cfg, dy_MN, rhs_GKN, group_sizes_G)
    drhs = functools.partial(_drhs_call, out_dtype=rhs_GKN.dtype, cfg=cfg)
    drhs_GKN = _per_platform(drhs, cfg, lhs_MK, dy_MN, group_sizes_G)
    return dlhs_MK, drhs_GKN, None


_pallas_gmm.defvjp(_pallas_fwd, _pallas_bwd)


def pallas_gpu_gmm(lhs_MK, rhs_GKN, group_sizes_G, *, out_dtype, **options):
    """Grouped matmul by Pallas/Triton kernels; options are `PallasGpuConfig` fields.

    Shapes are checked by the caller (`grouped_matmul`). Raises ValueError naming a bad option.
    """
    cfg = PallasGpuConfig(**options)
    m, n = lhs_MK.shape[0], rhs_GKN.shape[2]
    if m == 0 or rhs_GKN.shape[0] == 0 or lhs_MK.shape[1] == 0:
        return jnp.zeros((m, n), out_dtype)
    return _pallas_gmm(lhs_MK, rhs_GKN, group_sizes_G, jnp.dtype(out_dtype), cfg)
