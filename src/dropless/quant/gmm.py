"""The MXFP8 grouped matmul: any registered grouped-matmul backend, fed MX-quantized operands.

Legend: M rows (routed tokens, sorted by group), K contraction dim of the forward, N output dim,
G groups (experts).

Which operand is blocked along which axis (always the contraction dim of the matmul at hand):
  forward  out[r]   = x[r] @ w[g]          x blocked along K (rowwise), w along K
  backward dx[r]    = dy[r] @ w[g]^T       dy blocked along N (rowwise), w along N
           dw[g]    = x_g^T @ dy_g         x and dy blocked along the rows of each group: 32-row
                                           blocks restart at every group boundary
Each matmul multiplies the dequantized operands and accumulates in float32. Dequantized MX
values have at most 4 significant bits and a float32 exponent, so they are exact in bfloat16 and
every product is exact in float32: this is what an MX tensor core computes, up to the order of
the float32 additions. A custom VJP makes the backward quantize what it should (the saved
operands re-blocked along the backward's contraction dims) instead of differentiating through
the forward's quantization.

The lhs may arrive already quantized (`quant.mx_rows.MXRows`: rows quantized once before the
dispatch, MoEConfig.dispatch_quantization="mxfp8"): the forward decodes those codes instead of
quantizing, the backward is the recipe above with x the decoded rows.

Native MX matmuls (Blackwell tensor cores via `jax.nn.scaled_matmul`) are dense only; JAX has no
grouped scaled matmul, so the grouped matmul is emulated on every platform. `native_support()`
reports what the platform offers.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp

from dropless.ops.gmm.registry import backend_spec, check_backend_name, check_operands
from dropless.quant import mxfp8 as mx
from dropless.quant.mx_rows import MXRows

COMPUTE_DTYPES = ("bfloat16", "float32")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MXFP8Config:
    """How the MXFP8 grouped matmul quantizes and which backend it wraps.

    backend: a grouped-matmul backend name (MoEConfig.gmm_backend).
    fwd_elem: element format of x and w ('e4m3'); grad_elem: of dy ('e4m3' like Transformer
      Engine's MXFP8 recipe, or 'e5m2' for more range).
    scale_rounding: 'floor' (OCP spec) or 'up' (ceil(log2(amax/max)), never saturates).
    compute_dtype: dtype the dequantized operands of the forward and input-gradient matmuls are
      handed to the backend in; 'bfloat16' is exact (see the module docstring) and faster.
    """

    backend: str = "auto"
    fwd_elem: str = "e4m3"
    grad_elem: str = "e4m3"
    scale_rounding: str = "floor"
    compute_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        check_backend_name(self.backend, where="MXFP8Config.backend")
        for name in ("fwd_elem", "grad_elem"):
            if getattr(self, name) not in mx.ELEM_FORMATS:
                raise ValueError(f"MXFP8Config.{name}={getattr(self, name)!r} must be one of "
                                 f"{tuple(mx.ELEM_FORMATS)}")
        if self.scale_rounding not in mx.SCALE_ROUNDINGS:
            raise ValueError(f"MXFP8Config.scale_rounding={self.scale_rounding!r} must be one "
                             f"of {mx.SCALE_ROUNDINGS}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"MXFP8Config.compute_dtype={self.compute_dtype!r} must be one of "
                             f"{COMPUTE_DTYPES}")
        if self.backend == "loop":
            raise ValueError("MXFP8Config.backend='loop' is not jittable; the MXFP8 custom VJP "
                             "needs a jittable backend")


def native_support() -> tuple[bool, str]:
    """(available, why): whether this platform could run MX matmuls natively."""
    dev = jax.devices()[0]
    if dev.platform != "gpu":
        return False, f"platform {dev.platform!r} has no MX tensor cores; emulating exactly"
    cc = getattr(dev, "compute_capability", "0")
    if float(cc) < 10.0:
        return False, f"GPU compute capability {cc} < 10.0 (Blackwell); emulating exactly"
    return False, ("jax.nn.scaled_matmul is dense only and JAX has no grouped scaled matmul; "
                   "emulating exactly")


def _fq(x, axis, elem, cfg: MXFP8Config, dtype):
    return mx.fake_quantize(x, axis, elem=elem, rounding=cfg.scale_rounding, out_dtype=dtype)


def _fq_grouped(x, gs, elem, cfg: MXFP8Config):
    return mx.fake_quantize_grouped(x, gs, 0, elem=elem, rounding=cfg.scale_rounding,
                                    out_dtype=jnp.float32)


def _backend(cfg: MXFP8Config) -> Callable[..., jax.Array]:
    return backend_spec(cfg.backend).fn


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _mx_gmm(cfg: MXFP8Config, lhs_MK, rhs_GKN, group_sizes_G):
    cdt = jnp.dtype(cfg.compute_dtype)
    xq_MK = _fq(lhs_MK, 1, cfg.fwd_elem, cfg, cdt)
    wq_GKN = _fq(rhs_GKN, 1, cfg.fwd_elem, cfg, cdt)
    out = _backend(cfg)(xq_MK, wq_GKN, group_sizes_G, out_dtype=jnp.float32)
    return out.astype(lhs_MK.dtype)


def _mx_gmm_fwd(cfg, lhs_MK, rhs_GKN, group_sizes_G):
    return _mx_gmm(cfg, lhs_MK, rhs_GKN, group_sizes_G), (lhs_MK, rhs_GKN, group_sizes_G)


def _mx_gmm_bwd(cfg, res, dy_MN):
    lhs_MK, rhs_GKN, group_sizes_G = res
    dlhs_MK, drhs_GKN = _backward(cfg, lhs_MK, rhs_GKN, group_sizes_G, dy_MN)
    return dlhs_MK.astype(lhs_MK.dtype), drhs_GKN.astype(rhs_GKN.dtype), None


def _backward(cfg: MXFP8Config, x_MK, rhs_GKN, group_sizes_G, dy_MN):
    """(dlhs_MK, drhs_GKN) in float32 from the forward's lhs values x_MK (the recipe below)."""
    cdt = jnp.dtype(cfg.compute_dtype)
    fn = _backend(cfg)
    # dx = dy @ w^T: contraction over N, so dy is blocked rowwise and w along N
    dyq_MN = _fq(dy_MN, 1, cfg.grad_elem, cfg, cdt)
    wq_GNK = jnp.swapaxes(_fq(rhs_GKN, 2, cfg.fwd_elem, cfg, cdt), 1, 2)
    dlhs_MK = fn(dyq_MN, wq_GNK, group_sizes_G, out_dtype=jnp.float32)
    # dw[g] = x_g^T @ dy_g: contraction over each group's rows, blocks restart at boundaries.
    # The backend's own transpose computes it: gmm is linear in rhs, so its VJP in rhs at any
    # point (zeros) applied to dy is sum over the group's rows of x[r]^T dy[r].
    xg_MK = _fq_grouped(x_MK, group_sizes_G, cfg.fwd_elem, cfg)
    dyg_MN = _fq_grouped(dy_MN, group_sizes_G, cfg.grad_elem, cfg)
    zeros_GKN = jnp.zeros(rhs_GKN.shape, jnp.float32)
    _, pullback = jax.vjp(lambda w: fn(xg_MK, w, group_sizes_G, out_dtype=jnp.float32),
                          zeros_GKN)
    (drhs_GKN,) = pullback(dyg_MN)
    return dlhs_MK, drhs_GKN


_mx_gmm.defvjp(_mx_gmm_fwd, _mx_gmm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _mx_rows_gmm(cfg: MXFP8Config, dtype, q_MK, scale_MB, grad_MK, rhs_GKN, group_sizes_G):
    """The forward on already-quantized rows (MXRows' arrays): their codes are decoded, never
    re-quantized. grad_MK only receives the input gradient."""
    cdt = jnp.dtype(cfg.compute_dtype)
    xq_MK = MXRows(q_MK, scale_MB, None, dtype, cfg.fwd_elem).values(cdt)
    wq_GKN = _fq(rhs_GKN, 1, cfg.fwd_elem, cfg, cdt)
    return _backend(cfg)(xq_MK, wq_GKN, group_sizes_G, out_dtype=jnp.float32).astype(dtype)


def _mx_rows_fwd(cfg, dtype, q_MK, scale_MB, grad_MK, rhs_GKN, group_sizes_G):
    out = _mx_rows_gmm(cfg, dtype, q_MK, scale_MB, grad_MK, rhs_GKN, group_sizes_G)
    return out, (q_MK, scale_MB, rhs_GKN, group_sizes_G)   # the 1-byte codes are the residual


def _mx_rows_bwd(cfg, dtype, res, dy_MN):
    q_MK, scale_MB, rhs_GKN, group_sizes_G = res
    # the weight gradient's x is the values the forward used: the travelled rows, re-blocked
    # along each group's rows exactly as the bf16-lhs path blocks its lhs
    x_MK = MXRows(q_MK, scale_MB, None, dtype, cfg.fwd_elem).values(jnp.float32)
    dlhs_MK, drhs_GKN = _backward(cfg, x_MK, rhs_GKN, group_sizes_G, dy_MN)
    return None, None, dlhs_MK.astype(dtype), drhs_GKN.astype(rhs_GKN.dtype), None


_mx_rows_gmm.defvjp(_mx_rows_fwd, _mx_rows_bwd)


def _rows_gmm(lhs: MXRows, rhs_GKN, group_sizes_G, config: MXFP8Config) -> jax.Array:
    if lhs.elem != config.fwd_elem or lhs.grad_RD is None:
        raise ValueError(f"MXRows lhs must hold {config.fwd_elem!r} codes (MXFP8Config.fwd_elem)"
                         f" and a gradient slot (quant.mx_rows.travel); got {lhs.elem!r}, "
                         f"grad_RD {'missing' if lhs.grad_RD is None else 'set'}")
    check_operands(lhs.grad_RD, rhs_GKN, group_sizes_G)
    if lhs.shape[0] == 0 or rhs_GKN.shape[0] == 0:
        return jnp.zeros((lhs.shape[0], rhs_GKN.shape[2]), lhs.dtype)
    return _mx_rows_gmm(config, jnp.dtype(lhs.dtype), lhs.q_RD, lhs.scale_RB, lhs.grad_RD,
                        rhs_GKN, group_sizes_G.astype(jnp.int32))


def mxfp8_grouped_matmul(lhs_MK: jax.Array | MXRows, rhs_GKN: jax.Array,
                         group_sizes_G: jax.Array, *,
                         config: MXFP8Config = MXFP8Config()) -> jax.Array:
    """grouped_matmul with MXFP8 operands in forward and backward (see the module docstring).

    Args: as `dropless.ops.grouped_matmul` (lhs [M, K] sorted by group, rhs [G, K, N], group
      sizes [G] on device). lhs may be MXRows (quant.mx_rows: rows quantized before they were
      dispatched, with their gradient slot): its codes are the forward's lhs as they are, and
      its values (re-blocked per group) the weight gradient's; the input gradient lands in its
      slot. Returns [M, N] in lhs's dtype; rows past sum(group_sizes) are zero.
    Raises: ValueError for bad shapes or dtypes (as grouped_matmul does), for MXRows whose
      codes are not config.fwd_elem's or that have no gradient slot.
    """
    rhs_GKN, group_sizes_G = jnp.asarray(rhs_GKN), jnp.asarray(group_sizes_G)
    if isinstance(lhs_MK, MXRows):
        return _rows_gmm(lhs_MK, rhs_GKN, group_sizes_G, config)
    lhs_MK = jnp.asarray(lhs_MK)
    check_float_operands(lhs_MK, rhs_GKN, group_sizes_G, "MXFP8")
    if lhs_MK.shape[0] == 0 or rhs_GKN.shape[0] == 0:
        return jnp.zeros((lhs_MK.shape[0], rhs_GKN.shape[2]), lhs_MK.dtype)
    return _mx_gmm(config, lhs_MK, rhs_GKN, group_sizes_G.astype(jnp.int32))


def check_float_operands(lhs_MK, rhs_GKN, group_sizes_G, fmt: str) -> None:
    """grouped_matmul's operand checks, plus: a quantized matmul's lhs and rhs are floating.
    Raises ValueError naming the operand and the format `fmt`."""
    check_operands(lhs_MK, rhs_GKN, group_sizes_G)
    for name, a in (("lhs", lhs_MK), ("rhs", rhs_GKN)):
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise ValueError(f"{name} must be floating for {fmt}; got dtype {a.dtype}")


def quantized_gmm(cfg, mx_config: MXFP8Config | None = None
                  ) -> Callable[[jax.Array, jax.Array, jax.Array], jax.Array]:
    """The grouped matmul for `cfg.gmm_quantization` ('mxfp8'), wrapping `cfg.gmm_backend`.

    cfg: a MoEConfig (anything with `gmm_quantization` and `gmm_backend`). mx_config overrides
    the MXFP8 settings (its backend is replaced by cfg.gmm_backend).
    Returns gmm(x_ND, w_EKN, group_sizes_E) -> out [N, w.shape[2]] in x's dtype.
    Raises: ValueError for an unknown gmm_quantization.
    """
    if cfg.gmm_quantization != "mxfp8":
        raise ValueError(f"MoEConfig.gmm_quantization={cfg.gmm_quantization!r} has no quantized "
                         f"grouped matmul; known: 'mxfp8'")
    if mx_config is None:
        mx_config = MXFP8Config(scale_rounding=getattr(cfg, "mx_scale_rounding", "floor"),
                                grad_elem=getattr(cfg, "mx_grad_elem", "e4m3"))
    config = dataclasses.replace(mx_config, backend=cfg.gmm_backend)
    return functools.partial(mxfp8_grouped_matmul, config=config)
