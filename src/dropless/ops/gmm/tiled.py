"""`tiled`: a pure-JAX grouped matmul for CPU, with hand-written forward and backward.

Legend: M rows (routed tokens, sorted by group), K contraction dim, N output dim, G groups,
B rows in one tile, P tiles in one size class (a static budget; the real count is traced).

Why this shape of kernel: `jax.lax.ragged_dot` lowers on CPU to a masked dense dot that does G
times the useful work. Here every group is cut into row tiles that start at the group's first row:
full tiles of the largest size B first, then one masked tile for the remainder, of the smallest
size that covers it (with sizes 1024, 992, ..., 416, 384, ...: a group of 1400 rows runs one
1024-row tile and one 384-row tile masked to 376 rows). Each size class is one `fori_loop` whose
trip count is the traced number of tiles of that class, so nothing is copied to the host and the
kernel jits once for every routing. A masked tile near the end of the array is clamped inside it
(its window slides back) rather than padded, so no operand is ever copied.

The backward pass is written out (a custom VJP) rather than differentiated through the loops
(which measured 5-30x slower):
  dlhs = the same tiled kernel on (dy, rhs^T)   (the transpose is done per tile, not materialised)
  drhs[g] = sum over the tiles of g of lhs_tile^T @ dy_tile, accumulated in f32 one group at a
  time and written once.
Rows of a masked tile's window that are not its group's are dropped by selection (`jnp.where`) in
every product, never multiplied by a 0/1 mask: a NaN or Inf in one row then reaches only its own
output row and its own group's weight gradient (NaN * 0 is NaN).
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax import lax

# one full-tile size, then remainder sizes 32 rows apart down to 64 (then 48, 32, 16, 8): a
# group's last tile computes fewer than 32 rows that are not its own, and a group never runs
# more than one partial tile (docs/grouped_matmul.md has the measurement behind the spacing)
DEFAULT_TILE_SIZES = tuple(range(1024, 63, -32)) + (48, 32, 16, 8)


class TileClass(NamedTuple):
    """The tiles of one size: tile t covers rows [row_P[t], row_P[t] + size) of group group_P[t]."""

    size: int
    masked: bool       # only the smallest class can run past its group's end
    count: jax.Array   # traced scalar: how many of the P budgeted tiles are real
    group_P: jax.Array
    row_P: jax.Array
    end_P: jax.Array   # end row (exclusive) of the tile's group


def effective_tile_sizes(m: int, tile_sizes: Sequence[int]) -> tuple[int, ...]:
    """Tile sizes that fit in m rows, largest first; a single m-row tile when none fits."""
    sizes = tuple(sorted({int(b) for b in tile_sizes if 0 < int(b) <= m}, reverse=True))
    return sizes if sizes else (m,)


def plan_tiles(group_sizes_G: jax.Array, m: int, tile_sizes: Sequence[int]) -> list[TileClass]:
    """Cut each group's rows into tiles; all on device, every shape static.

    Each group gets floor(size / B) full tiles of the largest size B, then at most one masked
    tile for its remainder r (0 < r < B): the smallest tile size >= r, so a group wastes at most
    one tile's worth of rows and pays for one extra tile, not a cascade of small ones (each tile
    re-reads its group's whole weight matrix, which costs about as much as 30 rows of work).

    Hand-worked example: group_sizes=[5, 0, 3], m=8, tile sizes (4, 2):
      starts=[0,5,5] ends=[5,5,8]; full 4-row tiles: floor([5,0,3]/4)=[1,0,0] -> (g0, row 0);
      remainders [1,0,3]: g0's 1 row -> a masked 2-row tile at row 4 (row 5 belongs to g2);
      g2's 3 rows -> a masked 4-row tile at row 5, clamped to the window [4, 8) so it stays
      inside the array, writing rows 5..7 only.
    """
    sizes = effective_tile_sizes(m, tile_sizes)
    g = group_sizes_G.shape[0]
    gs_G = jnp.maximum(group_sizes_G.astype(jnp.int32), 0)
    ends_G = jnp.minimum(jnp.cumsum(gs_G), m)  # rows past m do not exist (ragged_dot semantics)
    starts_G = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends_G[:-1]])
    full = sizes[0]
    nfull_G = (ends_G - starts_G) // full
    rem_G = ends_G - starts_G - nfull_G * full
    rem_start_G = starts_G + nfull_G * full
    classes = [_tile_class(full, False, nfull_G, starts_G, ends_G, max(m // full, 1))]
    for j, b in enumerate(sizes):
        smaller = sizes[j + 1] if j + 1 < len(sizes) else 0
        n_G = ((rem_G > smaller) & (rem_G <= b)).astype(jnp.int32)
        budget = max(min(g, m // (smaller + 1)), 1)
        classes.append(_tile_class(b, True, n_G, rem_start_G, ends_G, budget))
    return classes


def _tile_class(size, masked, n_G, first_row_G, ends_G, budget) -> TileClass:
    """Lay out n_G[g] consecutive tiles of `size` rows per group, starting at first_row_G[g]."""
    cum_G = jnp.cumsum(n_G)
    t_P = jnp.arange(budget, dtype=jnp.int32)
    group_P = jnp.minimum(jnp.searchsorted(cum_G, t_P, side="right"), n_G.shape[0] - 1)
    group_P = group_P.astype(jnp.int32)
    row_P = first_row_G[group_P] + (t_P - (cum_G - n_G)[group_P]) * size
    return TileClass(size, masked, cum_G[-1], group_P, row_P, ends_G[group_P])


def _window(tc: TileClass, t, m: int):
    """Start row of tile t's window (clamped inside the array) and its row mask if masked."""
    row = tc.row_P[t]
    if not tc.masked:
        return row, None
    start = jnp.minimum(row, m - tc.size)
    rows_B = start + jnp.arange(tc.size, dtype=jnp.int32)
    return start, (rows_B >= row) & (rows_B < tc.end_P[t])


def as_bits(x):
    """16-bit floats as uint16 bits (see slice_bits): XLA:CPU keeps them 16-bit inside loops."""
    if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize == 2:
        return lax.bitcast_convert_type(x, jnp.uint16)
    return x


def from_bits(x, dtype):
    """The inverse of `as_bits`: `x` back as `dtype`."""
    return lax.bitcast_convert_type(x, dtype) if x.dtype != dtype else x


def slice_bits(x_bits, start, size, dtype):
    """Rows [start, start+size) of an `as_bits` array, as `dtype`.

    Why bits: given a bf16 operand sliced inside a while loop, XLA:CPU's float normalisation
    converts the whole loop-invariant operand to f32 before the loop and each slice back to bf16
    inside it, costing about 1.5x. Integer slices are left alone (measured on this CPU: a loop of
    1024-row bf16 tiles went from 44 ms to 30 ms, the dense dot taking 30 ms).
    """
    return from_bits(lax.dynamic_slice_in_dim(x_bits, start, size, axis=0), dtype)


def _forward(lhs_MK, rhs_GKN, classes, out_dtype, transpose_rhs: bool):
    m, _ = lhs_MK.shape
    n = rhs_GKN.shape[1] if transpose_rhs else rhs_GKN.shape[2]
    contract = 1 if transpose_rhs else 0
    lhs_bits, rhs_bits = as_bits(lhs_MK), as_bits(rhs_GKN)
    out_bits = as_bits(jnp.zeros((m, n), out_dtype))
    for tc in classes:
        def body(t, out_bits, tc=tc):
            start, mask_B = _window(tc, t, m)
            x_BK = slice_bits(lhs_bits, start, tc.size, lhs_MK.dtype)
            w = from_bits(lax.dynamic_index_in_dim(rhs_bits, tc.group_P[t], 0, keepdims=False),
                        rhs_GKN.dtype)
            y_BN = as_bits(lax.dot_general(x_BK, w, (((1,), (contract,)), ((), ())),
                                         preferred_element_type=jnp.float32).astype(out_dtype))
            if mask_B is not None:
                old_BN = lax.dynamic_slice_in_dim(out_bits, start, tc.size, axis=0)
                y_BN = jnp.where(mask_B[:, None], y_BN, old_BN)
            return lax.dynamic_update_slice_in_dim(out_bits, y_BN, start, axis=0)
        out_bits = lax.fori_loop(0, tc.count, body, out_bits)
    return from_bits(out_bits, jnp.dtype(out_dtype))


def _drhs(lhs_MK, dy_MN, group_sizes_G, sizes, out_dtype):
    """drhs[g] = lhs[rows of g]^T @ dy[rows of g], accumulated in f32, one group at a time.

    Per group: its full tiles in an inner loop, then its one masked remainder tile (a `switch`
    over the tile sizes), summed in a [K, N] carry and written once, so the [G, K, N] result is
    written and never re-read.

    16-bit operands: XLA:CPU runs a bf16 dot that contracts both operands' leading dim at about
    half the speed of a plain [K, B] @ [B, N] dot, so lhs is transposed once (as bits) and each
    tile is a column slice of lhs^T. Measured, 8192x1024 bf16, G=8: 99 -> 57 ms (G=64: 214 ->
    176 ms). In float32 the transposed slices cost more than they save (1.29x -> 1.50x dense).
    """
    m, k = lhs_MK.shape
    g, n = group_sizes_G.shape[0], dy_MN.shape[1]
    gs_G = jnp.maximum(group_sizes_G.astype(jnp.int32), 0)
    ends_G = jnp.minimum(jnp.cumsum(gs_G), m)
    starts_G = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends_G[:-1]])
    full = sizes[0]
    nfull_G = (ends_G - starts_G) // full
    rem_start_G = starts_G + nfull_G * full
    rem_G = ends_G - rem_start_G
    # branch j handles a remainder in (sizes[j+1], sizes[j]]; branch len(sizes) means none
    branch_G = jnp.sum(rem_G[:, None] <= jnp.asarray(sizes)[None, :], axis=1) - 1
    branch_G = jnp.where(rem_G == 0, len(sizes), branch_G)
    lhs_bits, dy_bits = as_bits(lhs_MK), as_bits(dy_MN)
    transposed = lhs_MK.dtype.itemsize == 2
    # materialised behind a barrier: where a group's tile is the whole array XLA would otherwise
    # fold the transpose and the slice into the dot, and XLA:CPU's DotThunk has no bf16 x bf16 =
    # f32 dot contracting both leading dims inside a loop or branch (UNIMPLEMENTED at run time)
    lhsT_bits = lax.optimization_barrier(lhs_bits.T) if transposed else None

    def tile_dw(start, size, mask_B):
        # A masked tile's window holds rows of other groups (or past the sum). Both operands are
        # zeroed there by selection: zeroing one is not enough, as a NaN or Inf in the other
        # would still reach this group's sum (NaN * 0 = NaN).
        dy_BN = slice_bits(dy_bits, start, size, dy_MN.dtype)
        if mask_B is not None:
            dy_BN = jnp.where(mask_B[:, None], dy_BN, jnp.zeros_like(dy_BN))
        if transposed:
            xT_KB = from_bits(lax.dynamic_slice_in_dim(lhsT_bits, start, size, axis=1),
                            lhs_MK.dtype)
            if mask_B is not None:
                xT_KB = jnp.where(mask_B[None, :], xT_KB, jnp.zeros_like(xT_KB))
            return jnp.dot(xT_KB, dy_BN, preferred_element_type=jnp.float32)
        x_BK = slice_bits(lhs_bits, start, size, lhs_MK.dtype)
        if mask_B is not None:
            x_BK = jnp.where(mask_B[:, None], x_BK, jnp.zeros_like(x_BK))
        return lax.dot_general(x_BK, dy_BN, (((0,), (0,)), ((), ())),
                               preferred_element_type=jnp.float32)

    def remainder_branch(size):
        def branch(row, end):
            start = jnp.minimum(row, m - size)
            rows_B = start + jnp.arange(size, dtype=jnp.int32)
            return tile_dw(start, size, (rows_B >= row) & (rows_B < end))
        return branch

    def no_remainder(row, end):
        return jnp.zeros((k, n), jnp.float32)

    branches = [remainder_branch(b) for b in sizes] + [no_remainder]

    def group_body(carry, grp):
        # start from the remainder tile's product, not from zeros: most groups of a large G
        # have no full tile, and then the product is the result with no extra pass over [K, N]
        acc_KN = lax.switch(branch_G[grp], branches, rem_start_G[grp], ends_G[grp])

        def full_body(t, acc_KN):
            return acc_KN + tile_dw(starts_G[grp] + t * full, full, None)
        acc_KN = lax.fori_loop(0, nfull_G[grp], full_body, acc_KN)
        return carry, as_bits(acc_KN.astype(out_dtype))

    # a scan's stacked outputs are written once each: no zero-filled [G, K, N] buffer first;
    # as bits, since a bf16 stacked output hits the float-normalisation round trip (slice_bits)
    ys = lax.scan(group_body, None, jnp.arange(g, dtype=jnp.int32))[1]
    return from_bits(ys, jnp.dtype(out_dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _tiled_gmm(lhs_MK, rhs_GKN, group_sizes_G, out_dtype, tile_sizes):
    classes = plan_tiles(group_sizes_G, lhs_MK.shape[0], tile_sizes)
    return _forward(lhs_MK, rhs_GKN, classes, out_dtype, transpose_rhs=False)


def _tiled_fwd(lhs_MK, rhs_GKN, group_sizes_G, out_dtype, tile_sizes):
    out = _tiled_gmm(lhs_MK, rhs_GKN, group_sizes_G, out_dtype, tile_sizes)
    return out, (lhs_MK, rhs_GKN, group_sizes_G)


def _tiled_bwd(out_dtype, tile_sizes, res, dy_MN):
    lhs_MK, rhs_GKN, group_sizes_G = res
    m = lhs_MK.shape[0]
    classes = plan_tiles(group_sizes_G, m, tile_sizes)
    dlhs_MK = _forward(dy_MN, rhs_GKN, classes, lhs_MK.dtype, transpose_rhs=True)
    sizes = effective_tile_sizes(m, tile_sizes)
    drhs_GKN = _drhs(lhs_MK, dy_MN, group_sizes_G, sizes, rhs_GKN.dtype)
    return dlhs_MK, drhs_GKN, None


_tiled_gmm.defvjp(_tiled_fwd, _tiled_bwd)


def tiled_gmm(lhs_MK, rhs_GKN, group_sizes_G, *, out_dtype, tile_sizes=DEFAULT_TILE_SIZES):
    """Grouped matmul by row tiles; see the module docstring. Shapes are checked by the caller."""
    tile_sizes = tuple(int(b) for b in tile_sizes)
    if not tile_sizes or any(b <= 0 for b in tile_sizes):
        raise ValueError(f"tile_sizes={tile_sizes!r} must be a non-empty tuple of positive ints")
    if lhs_MK.shape[0] == 0 or rhs_GKN.shape[0] == 0:
        return jnp.zeros((lhs_MK.shape[0], rhs_GKN.shape[2]), out_dtype)
    return _tiled_gmm_jit(lhs_MK, rhs_GKN, group_sizes_G, jnp.dtype(out_dtype), tile_sizes)


# Called eagerly, each fori_loop would compile on its own; one jit compiles the kernel once per
# shape (under an outer jit it is simply inlined).
_tiled_gmm_jit = jax.jit(_tiled_gmm, static_argnums=(3, 4))


@functools.partial(jax.jit, static_argnames=("out_dtype", "tile_sizes"))
def tiled_dlhs(dy_MN, rhs_GKN, group_sizes_G, *, out_dtype, tile_sizes=DEFAULT_TILE_SIZES):
    """The backward's lhs gradient alone, as the custom VJP runs it: dy[rows of g] @ rhs[g]^T
    -> [M, K] (the bench's per-part profile times it on its own)."""
    classes = plan_tiles(group_sizes_G, dy_MN.shape[0], tuple(tile_sizes))
    return _forward(dy_MN, rhs_GKN, classes, out_dtype, transpose_rhs=True)


@functools.partial(jax.jit, static_argnames=("out_dtype", "tile_sizes"))
def tiled_drhs(lhs_MK, dy_MN, group_sizes_G, *, out_dtype, tile_sizes=DEFAULT_TILE_SIZES):
    """The backward's rhs gradient alone, as the custom VJP runs it: lhs[rows of g]^T @
    dy[rows of g] -> [G, K, N]."""
    sizes = effective_tile_sizes(lhs_MK.shape[0], tuple(tile_sizes))
    return _drhs(lhs_MK, dy_MN, group_sizes_G, sizes, out_dtype)
