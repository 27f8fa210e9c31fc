"""The NVFP4 grouped matmul: any registered grouped-matmul backend, fed NVFP4-quantized operands
the way NVIDIA's NVFP4 pre-training recipe (arXiv:2509.25149) quantizes them.

Legend: M rows (routed tokens, sorted by group), K contraction dim of the forward, N output dim,
G groups (experts), P rows of the group-aligned layout (see nvfp4.group_aligned_rows).

Which operand is quantized how (each piece an NVFP4Config option):
  forward  out[r] = x[r] @ w[g]      x: 1x16 blocks along K, round to nearest even (RNE);
                                     w: 16x16 tiles over (K, N) ("2d") or 1x16 along K ("1d")
  dgrad    dx[r]  = dy[r] @ w[g]^T   dy: 1x16 along N, stochastic rounding (SR) or RNE;
                                     w: the forward's quantized w with "2d" (one representation
                                     in both passes), re-blocked 1x16 along N with "1d"
  wgrad    dw[g]  = x_g^T @ dy_g     x, dy: rows padded per group to multiples of 16, then the
                                     16x16 random Hadamard transform over each 16-row block
                                     (`rht`), then 16-row blocks (they restart at every group
                                     boundary); x RNE, dy SR
Every operand has its own FP32 tensor scale (`tensor_scale`). A matmul multiplies the
block-scaled values q * scale_b (at most 6 significant bits: exact in bfloat16, products exact
in float32), accumulates in float32, and multiplies the result by the two operands' tensor
decode scales: what an NVFP4 tensor core and its epilogue compute, up to the order of the
float32 additions. The Hadamard transform is orthogonal, H^T H = I, so in exact arithmetic it
changes no weight gradient; it spreads a block's outliers before the 4-bit rounding.

Stochastic rounding is reproducible: the random words of a quantized gradient come from
jax.random.bits with the counter-based (threefry) key
    fold_in(fold_in(key(seed), counter), hash(dy) ^ tag)
where `counter` is the caller's uint32 (thread the training step through
`nvfp4_grouped_matmul(..., counter=step)`), hash(dy) is a wrapping uint32 sum of dy's float32
bit patterns weighted by odd position constants (so each layer and matmul of a step draws its
own stream), and tag tells the dgrad and wgrad operands apart. Same inputs and counter, same
bits, on every platform.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from dropless.ops.gmm.registry import backend_spec, check_backend_name
from dropless.quant import nvfp4 as nv
from dropless.quant.gmm import COMPUTE_DTYPES, check_float_operands

TAG_DGRAD, TAG_WGRAD = 0x0D6AD, 0x36AD


@dataclasses.dataclass(frozen=True, kw_only=True)
class NVFP4Config:
    """How the NVFP4 grouped matmul quantizes, and which backend it wraps.

    backend: a grouped-matmul backend name (MoEConfig.gmm_backend).
    weight_blocks: '2d' (16x16 tiles, the recipe) or '1d' (1x16 along each matmul's
      contraction dim). Activations and gradients always use 1x16 blocks.
    tensor_scale: the FP32 second-level scale per tensor (the recipe); False leaves the E4M3
      block scales alone to cover the range (s_enc = 1).
    rht: the random Hadamard transform of the weight-gradient operands (the recipe).
    stochastic_rounding: SR for the gradient dy (the recipe); False rounds it to nearest even.
    seed: picks the Hadamard sign vector and the SR key (fixed for a run).
    compute_dtype: dtype the block-scaled values reach the backend in ('bfloat16' is exact).
    """

    backend: str = "auto"
    weight_blocks: str = "2d"
    tensor_scale: bool = True
    rht: bool = True
    stochastic_rounding: bool = True
    seed: int = 0
    compute_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        c = "NVFP4Config"
        check_backend_name(self.backend, where=f"{c}.backend")
        if self.backend == "loop":
            raise ValueError(f"{c}.backend='loop' is not jittable; the NVFP4 custom VJP needs a "
                             "jittable backend")
        if self.weight_blocks not in nv.BLOCK_KINDS:
            raise ValueError(f"{c}.weight_blocks={self.weight_blocks!r} must be one of "
                             f"{nv.BLOCK_KINDS}")
        for name in ("tensor_scale", "rht", "stochastic_rounding"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{c}.{name}={getattr(self, name)!r} must be a bool")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not \
                0 <= self.seed < 2 ** 32:
            raise ValueError(f"{c}.seed={self.seed!r} must be an int in [0, 2**32)")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"{c}.compute_dtype={self.compute_dtype!r} must be one of "
                             f"{COMPUTE_DTYPES}")


def content_hash(x: jax.Array) -> jax.Array:
    """uint32 hash of x's float32 bit patterns: sum of bits[i] * (2 i + 1), wrapping."""
    bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32).reshape(-1)
    odd = jnp.arange(bits.shape[0], dtype=jnp.uint32) * jnp.uint32(2) + jnp.uint32(1)
    return jnp.sum(bits * odd, dtype=jnp.uint32)


def sr_bits(seed: int, counter: jax.Array, x: jax.Array, tag: int) -> jax.Array:
    """The uint32 random words for stochastically rounding x (see the module docstring)."""
    key = jax.random.fold_in(jax.random.key(seed), counter)
    key = jax.random.fold_in(key, content_hash(x) ^ jnp.uint32(tag))
    return jax.random.bits(key, x.shape, jnp.uint32)


def _values(x, axis, cfg: NVFP4Config, *, blocks="1d", bits=None):
    return nv.quantize_values(x, axis, blocks=blocks, tensor_scale=cfg.tensor_scale,
                              sr_bits=bits)


def _weight_fwd(w_GKN, cfg):
    return _values(w_GKN, 1, cfg, blocks=cfg.weight_blocks)


def _weight_dgrad(w_GKN, cfg):
    """w as the input-gradient matmul needs it: [G, N, K] values and the tensor decode scale."""
    v, s = _values(w_GKN, 2, cfg, blocks=cfg.weight_blocks)   # 2d: the forward's values
    return jnp.swapaxes(v, 1, 2), s


def _grad_bits(cfg, counter, dy, tag):
    return sr_bits(cfg.seed, counter, dy, tag) if cfg.stochastic_rounding else None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _nv_gmm(cfg: NVFP4Config, lhs_MK, rhs_GKN, group_sizes_G, counter):
    cdt = jnp.dtype(cfg.compute_dtype)
    vx_MK, sx = _values(lhs_MK, 1, cfg)
    vw_GKN, sw = _weight_fwd(rhs_GKN, cfg)
    out = backend_spec(cfg.backend).fn(vx_MK.astype(cdt), vw_GKN.astype(cdt), group_sizes_G,
                                       out_dtype=jnp.float32)
    return (out * (sx * sw)).astype(lhs_MK.dtype)


def _nv_gmm_fwd(cfg, lhs_MK, rhs_GKN, group_sizes_G, counter):
    out = _nv_gmm(cfg, lhs_MK, rhs_GKN, group_sizes_G, counter)
    return out, (lhs_MK, rhs_GKN, group_sizes_G, counter)


def wgrad_operands(x_MK, dy_MN, group_sizes_G, cfg: NVFP4Config, counter):
    """The weight-gradient matmul's operands: (x values [P, K], dy values [P, N], padded group
    sizes [G], the product of their tensor decode scales)."""
    dest_M, padded_G, p = nv.group_aligned_rows(group_sizes_G, x_MK.shape[0])
    xa_PK = nv.to_aligned(x_MK.astype(jnp.float32), dest_M, p)
    dya_PN = nv.to_aligned(dy_MN.astype(jnp.float32), dest_M, p)
    if cfg.rht:
        h_LL = nv.hadamard_matrix(cfg.seed)
        xa_PK, dya_PN = nv.hadamard_rows(xa_PK, h_LL), nv.hadamard_rows(dya_PN, h_LL)
    vx_PK, sx = _values(xa_PK, 0, cfg)
    vdy_PN, sdy = _values(dya_PN, 0, cfg, bits=_grad_bits(cfg, counter, dya_PN, TAG_WGRAD))
    return vx_PK, vdy_PN, padded_G, sx * sdy


def _nv_gmm_bwd(cfg, res, dy_MN):
    lhs_MK, rhs_GKN, group_sizes_G, counter = res
    cdt = jnp.dtype(cfg.compute_dtype)
    fn = backend_spec(cfg.backend).fn
    dy32_MN = dy_MN.astype(jnp.float32)
    vdy_MN, sdy = _values(dy32_MN, 1, cfg, bits=_grad_bits(cfg, counter, dy32_MN, TAG_DGRAD))
    vw_GNK, sw = _weight_dgrad(rhs_GKN, cfg)
    dlhs_MK = fn(vdy_MN.astype(cdt), vw_GNK.astype(cdt), group_sizes_G,
                 out_dtype=jnp.float32) * (sdy * sw)
    vx_PK, vdy_PN, padded_G, s = wgrad_operands(lhs_MK, dy32_MN, group_sizes_G, cfg, counter)
    # dw[g] = x_g^T dy_g through the backend's own transpose: gmm is linear in rhs, so its VJP
    # in rhs applied to dy is the per-group sum of x[r]^T dy[r] (pad rows are zero on both)
    zeros_GKN = jnp.zeros(rhs_GKN.shape, jnp.float32)
    _, pullback = jax.vjp(lambda w: fn(vx_PK, w, padded_G, out_dtype=jnp.float32), zeros_GKN)
    (drhs_GKN,) = pullback(vdy_PN)
    return dlhs_MK.astype(lhs_MK.dtype), (drhs_GKN * s).astype(rhs_GKN.dtype), None, None


_nv_gmm.defvjp(_nv_gmm_fwd, _nv_gmm_bwd)


def nvfp4_grouped_matmul(lhs_MK: jax.Array, rhs_GKN: jax.Array, group_sizes_G: jax.Array, *,
                         config: NVFP4Config = NVFP4Config(),
                         counter: jax.Array | int = 0) -> jax.Array:
    """grouped_matmul with NVFP4 operands in forward and backward (see the module docstring).

    Args: as `dropless.ops.grouped_matmul` (lhs [M, K] sorted by group, rhs [G, K, N], group
      sizes [G] on device); `counter`: a uint32 (e.g. the training step) folded into the
      stochastic-rounding key.
    Returns [M, N] in lhs's dtype; rows past sum(group_sizes) are zero.
    Raises: ValueError for bad shapes or dtypes (as grouped_matmul does).
    """
    lhs_MK, rhs_GKN = jnp.asarray(lhs_MK), jnp.asarray(rhs_GKN)
    group_sizes_G = jnp.asarray(group_sizes_G)
    check_float_operands(lhs_MK, rhs_GKN, group_sizes_G, "NVFP4")
    if lhs_MK.shape[0] == 0 or rhs_GKN.shape[0] == 0:
        return jnp.zeros((lhs_MK.shape[0], rhs_GKN.shape[2]), lhs_MK.dtype)
    return _nv_gmm(config, lhs_MK, rhs_GKN, group_sizes_G.astype(jnp.int32),
                   jnp.asarray(counter, jnp.uint32))


def nvfp4_config(cfg) -> NVFP4Config:
    """The NVFP4Config a MoEConfig's nvfp4_* fields and gmm_backend describe."""
    return NVFP4Config(backend=cfg.gmm_backend, weight_blocks=cfg.nvfp4_weight_blocks,
                       tensor_scale=cfg.nvfp4_tensor_scale, rht=cfg.nvfp4_rht,
                       stochastic_rounding=cfg.nvfp4_stochastic_rounding, seed=cfg.nvfp4_seed)


def nvfp4_quantized_gmm(cfg) -> Callable[[jax.Array, jax.Array, jax.Array], jax.Array]:
    """gmm(x, w, group_sizes) for a MoEConfig with gmm_quantization='nvfp4'."""
    return functools.partial(nvfp4_grouped_matmul, config=nvfp4_config(cfg))
