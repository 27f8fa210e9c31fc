"""`mosaic_gpu`: jax's own Mosaic GPU grouped kernels for Hopper, under one custom VJP.

Legend: M rows (sorted by group), K contraction dim, N output dim, G groups, R rows per group,
bm/bn/bk block sizes.

The jax wheel ships them (nothing to install): `jax.experimental.pallas.ops.gpu.
ragged_dot_mgpu.ragged_dot` (persistent over the SMs, TMA loads into a `max_concurrent_steps`
deep pipeline, wgmma; a row tile starts at every group boundary, so it computes cdiv(M, bm) +
G - 1 row tiles) runs the forward and, with its rhs read transposed, dlhs; its
`transposed_ragged_dot_mgpu.transposed_ragged_dot` (the K-grouped product) can run drhs:

  forward  out[rows of g]  = lhs[rows of g] @ rhs[g]       ragged_dot(lhs, rhs)
  dlhs     dlhs[rows of g] = dy[rows of g] @ rhs[g]^T      ragged_dot(dy, rhs, transpose_rhs)
  drhs     drhs[g] = lhs[rows of g]^T @ dy[rows of g]      `drhs="pallas"` (default): our
           pallas_gpu kernel; `drhs="mosaic"`: transposed_ragged_dot

The default drhs is ours because jax's kernel masks the rows of a neighbouring group inside a
bk-row window by multiplying them with zero: a NaN or Inf there reaches another group's weight
gradient, which breaks the registry's containment contract (tests/ops/gmm/test_registry_nan.py).

What the kernels require, and what happens otherwise (always exact, never silently different):
  - bf16 or f16 operands of one dtype and an output of that dtype (the kernels write lhs's
    dtype): other dtypes run `pallas_gpu` entirely;
  - K % bk == 0 and N % 64 == 0 (forward), N % bk == 0 and K % 64 == 0 (dlhs: the output's
    columns are stored in 64-wide TMA tiles), K % bm == 0 and N % bn == 0 (drhs "mosaic"):
    a direction whose dims do not divide runs that direction on `pallas_gpu`'s kernel;
  - a GPU of compute capability 9.x (wgmma, sm_90a) when this process has one: another
    generation runs `pallas_gpu`; compiling on a CPU host for a compile-only GPU assumes Hopper.
Each such choice is recorded (`choices.note`, "implementation" and "reason"). The kernels leave
rows past sum(group_sizes) unwritten, so the forward and dlhs outputs are selected to zero there
(one elementwise pass XLA fuses into the consumer where it can). Group sizes are clipped as the
other backends clip them: negatives count as zero, rows past M do not exist.

Per-shape configs (`CONFIGS`, keyed by the rows-per-group class of `winners.bucket`) are
starting points in the search space of the kernels' own tuning scripts (bm, bn in 64/128/192,
bk 64, 2-6 concurrent steps); options override them. The kernels cannot run on CPU (no
interpret mode for Mosaic GPU): lowered for CPU, the call is a custom call to
`NO_CPU_TARGET`, which XLA refuses to compile with that name in its error.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import types
from typing import Iterator

import jax
import jax.numpy as jnp
from jax import lax

from dropless.ops.gmm import choices
from dropless.ops.gmm.winners import size_class
from dropless.ops.gpu import pallas_gpu

NO_CPU_TARGET = "dropless_mosaic_gpu_runs_only_on_nvidia_hopper_gpus"
DTYPES = (jnp.bfloat16, jnp.float16)
H100_SMS = 132        # SMs of an H100 SXM and of an H200 (the persistent grid's size)
OUT_TILE = 64         # the output's columns: a multiple of the TMA store's 64-element tile


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicGpuConfig:
    """Launch settings; None takes the shape's entry of `CONFIGS`. `drhs`: "pallas" (default,
    NaN-contained) or "mosaic" (jax's transposed kernel)."""

    block_m: int | None = None
    block_n: int | None = None
    block_k: int | None = None
    max_concurrent_steps: int | None = None
    grid_block_n: int | None = None
    drhs: str = "pallas"

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 8 or v % 8):
                raise ValueError(f"mosaic_gpu {name}={v!r} must be a multiple of 8")
        for name in ("max_concurrent_steps", "grid_block_n"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"mosaic_gpu {name}={v!r} must be an int >= 1")
        if self.drhs not in ("pallas", "mosaic"):
            raise ValueError(f"mosaic_gpu drhs={self.drhs!r} must be 'pallas' or 'mosaic'")


OPTIONS = tuple(f.name for f in dataclasses.fields(MosaicGpuConfig))
# rows-per-group class -> (block_m, block_n, block_k, max_concurrent_steps, grid_block_n):
# few rows a group (<= 256) take 64-row tiles (a straddling tile wastes less); more take 128.
CONFIGS = {"64": (64, 128, 64, 4, 1), "256": (64, 128, 64, 4, 1),
           "1k": (128, 128, 64, 4, 1), "default": (128, 128, 64, 4, 4)}


def config_for(m: int, k: int, n: int, g: int, cfg: MosaicGpuConfig) -> dict:
    """The concrete settings for forward operands lhs [M, K], rhs [G, K, N]: cfg's values over
    the `CONFIGS` entry of the shape's rows-per-group class; grid_block_n falls to 1 where it
    does not divide N's blocks."""
    rows = size_class(-(-m // max(g, 1)))
    bm, bn, bk, steps, gbn = CONFIGS.get(rows, CONFIGS["default"])
    out = dict(block_m=cfg.block_m or bm, block_n=cfg.block_n or bn, block_k=cfg.block_k or bk,
               max_concurrent_steps=cfg.max_concurrent_steps or steps,
               grid_block_n=cfg.grid_block_n or gbn)
    if -(-n // out["block_n"]) % out["grid_block_n"]:
        out["grid_block_n"] = 1
    return out


@functools.cache
def mosaic_problem() -> str | None:
    """Why jax's Mosaic GPU grouped kernels cannot be used with this jax (None: they can)."""
    try:
        plgpu = importlib.import_module("jax.experimental.pallas.mosaic_gpu")
        for name in ("ragged_dot_mgpu", "transposed_ragged_dot_mgpu"):
            importlib.import_module(f"jax.experimental.pallas.ops.gpu.{name}")
    except Exception as e:  # noqa: BLE001 (any import failure: not usable here)
        return (f"mosaic_gpu needs jax's Mosaic GPU ragged-dot kernels (jax "
                f"{jax.__version__}: {type(e).__name__}: {str(e).splitlines()[0][:160]})")
    for name in ("kernel", "emit_pipeline", "wgmma", "nd_loop", "planar_snake"):
        if not hasattr(plgpu, name):
            return (f"mosaic_gpu: jax {jax.__version__}'s Pallas Mosaic GPU lacks plgpu.{name}, "
                    "which its ragged-dot kernels call; use jax >= 0.10.2")
    return None


def _gpu_problem() -> str | None:
    """Why the GPU of this process cannot run wgmma kernels (None: Hopper, or no GPU here)."""
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        return None
    cap = getattr(gpus[0], "compute_capability", None) if gpus else None
    if cap is not None and not str(cap).startswith("9"):
        return f"{gpus[0].device_kind} has compute capability {cap}, not 9.x (Hopper wgmma)"
    return None


@contextlib.contextmanager
def _sm_count_for(module) -> Iterator[None]:
    """Within the block, `module`'s `jax.devices()[0].core_count` (the persistent grid's size)
    answers H100_SMS when this process's first device has no core count (lowering on a CPU
    host for a compile-only GPU); on a GPU the device's own count stands."""
    if hasattr(jax.devices()[0], "core_count"):
        yield
        return

    class _Jax(types.ModuleType):
        def __getattr__(self, name):
            return getattr(jax, name)

        def devices(self, *args, **kwargs):
            return [types.SimpleNamespace(core_count=H100_SMS)]

    saved = module.jax
    module.jax = _Jax("jax")
    try:
        yield
    finally:
        module.jax = saved


def clipped_sizes(group_sizes_G: jax.Array, m: int) -> jax.Array:
    """Group sizes as every backend reads them: negatives are zero, rows past M do not exist.
    Example: [5, -1, 9], m=10 -> [5, 0, 5]."""
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes_G, 0)), m)
    return jnp.diff(ends, prepend=0).astype(jnp.int32)


def _zero_tail(out_MX, sizes_G):
    rows_M = lax.broadcasted_iota(jnp.int32, (out_MX.shape[0], 1), 0)
    return jnp.where(rows_M < jnp.sum(sizes_G), out_MX, jnp.zeros((), out_MX.dtype))


def _no_cpu(*operands, shape, dtype):
    return jax.ffi.ffi_call(NO_CPU_TARGET, jax.ShapeDtypeStruct(shape, dtype))(*operands)


def _on_gpu(kernel, *args, shape, dtype):
    """`kernel(*args)` lowered for GPUs; for CPU the refusing custom call."""
    return lax.platform_dependent(
        *args, cpu=functools.partial(_no_cpu, shape=shape, dtype=dtype), default=kernel)


def _ragged(x_MC, rhs, sizes_G, transpose, **settings):
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu  # noqa: PLC0415
    o = rhs.shape[1] if transpose else rhs.shape[2]
    kernel = functools.partial(ragged_dot_mgpu.ragged_dot, transpose_rhs=transpose, **settings)
    out = _on_gpu(lambda a, b, s: kernel(a, b, group_sizes=s), x_MC, rhs, sizes_G,
                  shape=(x_MC.shape[0], o), dtype=x_MC.dtype)
    return _zero_tail(out, sizes_G)


def _drhs_mosaic(lhs_MK, dy_MN, sizes_G, **settings):
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu as t  # noqa: PLC0415
    g, k, n = sizes_G.shape[0], lhs_MK.shape[1], dy_MN.shape[1]

    def kernel(a, b, s):
        with _sm_count_for(t):
            return t.transposed_ragged_dot(a, b, group_sizes=s, **settings)
    return _on_gpu(kernel, lhs_MK, dy_MN, sizes_G, shape=(g, k, n), dtype=lhs_MK.dtype)


def _fwd_ok(k, n, s):
    return k % s["block_k"] == 0 and n % OUT_TILE == 0


def _dlhs_ok(k, n, s):
    return n % s["block_k"] == 0 and k % OUT_TILE == 0


def _drhs_ok(k, n, s, cfg):
    return cfg.drhs == "mosaic" and k % s["block_m"] == 0 and n % s["block_n"] == 0


def _pallas_direction(direction, lhs_MK, rhs_GKN, sizes_G, dy_MN, out_dtype):
    """One direction of pallas_gpu's custom VJP (XLA drops the unused outputs)."""
    f = functools.partial(pallas_gpu.pallas_gpu_gmm, out_dtype=out_dtype)
    if direction == "fwd":
        return f(lhs_MK, rhs_GKN, sizes_G)
    _, vjp = jax.vjp(lambda a, b: f(a, b, sizes_G), lhs_MK, rhs_GKN)
    d_lhs, d_rhs = vjp(dy_MN)
    return d_lhs if direction == "dlhs" else d_rhs


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _mosaic_gmm(lhs_MK, rhs_GKN, sizes_G, cfg):
    m, k = lhs_MK.shape
    g, _, n = rhs_GKN.shape
    s = config_for(m, k, n, g, cfg)
    if not _fwd_ok(k, n, s):
        return _pallas_direction("fwd", lhs_MK, rhs_GKN, sizes_G, None, lhs_MK.dtype)
    return _ragged(lhs_MK, rhs_GKN, sizes_G, False, **s)


def _mosaic_fwd(lhs_MK, rhs_GKN, sizes_G, cfg):
    return _mosaic_gmm(lhs_MK, rhs_GKN, sizes_G, cfg), (lhs_MK, rhs_GKN, sizes_G)


def _mosaic_bwd(cfg, res, dy_MN):
    lhs_MK, rhs_GKN, sizes_G = res
    m, k = lhs_MK.shape
    g, _, n = rhs_GKN.shape
    s = config_for(m, k, n, g, cfg)
    dy_MN = dy_MN.astype(lhs_MK.dtype)
    if _dlhs_ok(k, n, s):
        d_lhs = _ragged(dy_MN, rhs_GKN, sizes_G, True, **s)
    else:
        d_lhs = _pallas_direction("dlhs", lhs_MK, rhs_GKN, sizes_G, dy_MN, lhs_MK.dtype)
    if _drhs_ok(k, n, s, cfg):
        d_rhs = _drhs_mosaic(lhs_MK, dy_MN, sizes_G, **s)
    else:
        d_rhs = _pallas_direction("drhs", lhs_MK, rhs_GKN, sizes_G, dy_MN, lhs_MK.dtype)
    return d_lhs, d_rhs.astype(rhs_GKN.dtype), None


_mosaic_gmm.defvjp(_mosaic_fwd, _mosaic_bwd)


def kernels_used(m: int, k: int, n: int, g: int, cfg: MosaicGpuConfig | None = None) -> dict:
    """Which kernel runs each direction at these forward dims ("mosaic" or "pallas_gpu"), for
    16-bit operands on a Hopper GPU, and the settings chosen."""
    cfg = cfg or MosaicGpuConfig()
    s = config_for(m, k, n, g, cfg)
    return {"fwd": "mosaic" if _fwd_ok(k, n, s) else "pallas_gpu",
            "dlhs": "mosaic" if _dlhs_ok(k, n, s) else "pallas_gpu",
            "drhs": "mosaic" if _drhs_ok(k, n, s, cfg) else "pallas_gpu", "settings": s}


def mosaic_gpu_gmm(lhs_MK, rhs_GKN, group_sizes_G, *, out_dtype, **options):
    """Grouped matmul by jax's Mosaic GPU kernels; options are `MosaicGpuConfig` fields.

    Shapes are checked by the caller (`grouped_matmul`). Operands the kernels cannot take run
    `pallas_gpu` (recorded as the choice's reason). Raises ValueError naming a bad option.
    """
    cfg = MosaicGpuConfig(**options)
    m, k = lhs_MK.shape
    g, _, n = rhs_GKN.shape
    key = choices.shape_key(lhs_MK, rhs_GKN, group_sizes_G, out_dtype)
    why = mosaic_problem() or _gpu_problem()
    if why is None and not (lhs_MK.dtype == rhs_GKN.dtype == jnp.dtype(out_dtype)
                            and lhs_MK.dtype in DTYPES):
        why = (f"the kernels take bf16/f16 operands of one dtype with an output of that dtype; "
               f"got {lhs_MK.dtype} x {rhs_GKN.dtype} -> {jnp.dtype(out_dtype)}")
    if why is None and (m == 0 or g == 0 or k == 0 or n == 0):
        return jnp.zeros((m, n), out_dtype)
    if why is not None:
        choices.note({"asked": "mosaic_gpu", "backend": "pallas_gpu", "shape": key,
                      "reason": why[:400]})
        return pallas_gpu.pallas_gpu_gmm(lhs_MK, rhs_GKN, group_sizes_G, out_dtype=out_dtype)
    used = kernels_used(m, k, n, g, cfg)
    choices.note({"asked": "mosaic_gpu", "backend": "mosaic_gpu", "shape": key,
                  "implementation": ",".join(f"{d}={used[d]}" for d in ("fwd", "dlhs", "drhs"))})
    return _mosaic_gmm(lhs_MK, rhs_GKN, clipped_sizes(group_sizes_G, m), cfg)


__all__ = ["mosaic_gpu_gmm", "mosaic_problem", "MosaicGpuConfig", "OPTIONS", "CONFIGS",
           "config_for", "kernels_used", "clipped_sizes", "NO_CPU_TARGET"]
