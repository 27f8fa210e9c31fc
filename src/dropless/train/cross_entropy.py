"""The loss's cross-entropy: each position's negative log-likelihood of its target, from the
model's last hidden state through the final norm and the output head, whole or in tiles of the
sequence (`TrainConfig.num_vocab_tiling`, MaxText's key).

Legend: B batch, S sequence, D model dim, V vocabulary, N tiles, C positions a tile (S / N).

Whole (N = 1): the head makes the float32 logits [B, S, V] at once; autodiff keeps them for the
backward pass and writes their cotangent, B x S x V x 8 bytes at the peak (4 GiB for 16,384
tokens of a 32,768-token vocabulary).
Tiled (N > 1, `nll_from_hidden`): the final norm, the head and `token_nll` run on C = S / N
positions of every row at a time under a lax.map whose body's backward pass runs its forward
again (`_tile_nll`, a custom VJP): the forward keeps each tile's input and its [B, C] losses,
the backward recomputes one tile's logits at a time, so the head's logits live a tile at a time (1/N of
them) for one more forward of the head (2 x B x S x D x V FLOPs). MaxText's vocabulary tiling
(src/maxtext/utils/vocabulary_tiling.py at e591f30) tiles the flattened batch x sequence; a tile
here holds every row, so a batch split by rows over devices stays where it is and the sequence
is what N must divide. The values are the whole head's to rounding: each tile's products block
as their own shapes do, and the head weight's gradient is summed over the tiles in float32
(tests/train/test_cross_entropy.py).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from dropless.config import ModelConfig
from dropless.models import decoder


def token_nll(logits_BSV: jax.Array, targets_BS: jax.Array) -> jax.Array:
    """-log softmax(logits)[target] per position: optax's
    `softmax_cross_entropy_with_integer_labels` (logsumexp minus the target's logit), the same
    arithmetic and the same bits, with the target's logit picked by a compare against the
    vocabulary's iota (a sum of one logit and zeros) instead of a gather.
    The gradient is then one elementwise pass over the logits (softmax minus the one-hot, which
    a consumer may read in another dtype in the same pass); a gather's gradient is a
    scatter-add into a float32 [B, S, V] array that XLA writes out first."""
    vocab = lax.broadcasted_iota(jnp.int32, logits_BSV.shape, logits_BSV.ndim - 1)
    picked = jnp.sum(jnp.where(vocab == targets_BS[..., None], logits_BSV, 0.0), axis=-1)
    return jax.nn.logsumexp(logits_BSV, axis=-1) - picked


def mean_nll(nll_BS: jax.Array, mask_BS: jax.Array | None = None,
             total: jax.Array | None = None) -> jax.Array:
    """The mean of per-position losses (over mask when given). `total`: divide the summed
    (masked) losses by this count instead of this batch's own (a micro-batch's share of a
    larger batch's mean)."""
    if total is not None:
        return jnp.sum(nll_BS if mask_BS is None else nll_BS * mask_BS) / jnp.maximum(total, 1)
    if mask_BS is None:
        return jnp.mean(nll_BS)
    return jnp.sum(nll_BS * mask_BS) / jnp.maximum(jnp.sum(mask_BS), 1)


def cross_entropy(logits_BSV: jax.Array, targets_BS: jax.Array,
                  mask_BS: jax.Array | None = None, total: jax.Array | None = None
                  ) -> jax.Array:
    """Mean token cross-entropy of whole logits in float32 (`mean_nll` of `token_nll`)."""
    return mean_nll(token_nll(logits_BSV.astype(jnp.float32), targets_BS), mask_BS, total)


def check_tiles(seq_len: int, tiles: int) -> None:
    """Raise ValueError unless `tiles` is a positive divisor of `seq_len`."""
    if not (isinstance(tiles, int) and tiles > 0 and seq_len % tiles == 0):
        raise ValueError(f"num_vocab_tiling={tiles!r} must divide the sequence's {seq_len} "
                         "positions (each tile is seq_len / num_vocab_tiling positions of every "
                         "row); use a divisor of seq_len")


def nll_from_hidden(params, h_BSD: jax.Array, norm_w_D: jax.Array, targets_BS: jax.Array,
                    cfg: ModelConfig, tiles: int = 1) -> jax.Array:
    """float32 [B, S]: `token_nll` of the logits `decoder.logits_from_hidden(params, h_BSD,
    norm_w_D, cfg)` gives, made whole (`tiles` 1) or `tiles` slices of the sequence at a time
    (module docstring). Raises ValueError where `tiles` does not divide S."""
    b, s, d = h_BSD.shape
    check_tiles(s, tiles)
    if tiles == 1:
        return _head_nll(params, norm_w_D, h_BSD, targets_BS, cfg)
    c = s // tiles
    head = {k: params[k] for k in (("embed",) if cfg.tie_embeddings else ("lm_head",))}
    h_NBCD = jnp.swapaxes(h_BSD.reshape(b, tiles, c, d), 0, 1)
    t_NBC = jnp.swapaxes(targets_BS.reshape(b, tiles, c), 0, 1)
    nll_NBC = lax.map(lambda ht: _tile_nll(head, norm_w_D, ht[0], ht[1], cfg), (h_NBCD, t_NBC))
    return jnp.swapaxes(nll_NBC, 0, 1).reshape(b, s)


def _head_nll(head, norm_w_D, h_BSD, targets_BS, cfg: ModelConfig) -> jax.Array:
    logits_BSV = decoder.logits_from_hidden(head, h_BSD, norm_w_D, cfg)
    return token_nll(logits_BSV.astype(jnp.float32), targets_BS)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _tile_nll(head, norm_w_D, h_BCD, t_BC, cfg: ModelConfig) -> jax.Array:
    """One tile's `_head_nll`, the same values: the target's logit read by a gather, not
    `token_nll`'s compare against the vocabulary's iota. Inside a loop the iota and the zeros
    `token_nll` selects from ([B, C, V] each) depend on nothing the loop changes, and XLA hoists
    them out of it, so the loop holds both whole (compiled for an H100 at deepseek3-1gpu, 1 GiB
    at 4 tiles); a gather and, in the backward pass, a scatter-add into the softmax's own
    cotangent need neither. The backward pass runs the tile's forward again: the residuals are
    its inputs."""
    logits_BCV = decoder.logits_from_hidden(head, h_BCD, norm_w_D, cfg).astype(jnp.float32)
    picked_BC = jnp.take_along_axis(logits_BCV, t_BC[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits_BCV, axis=-1) - picked_BC


def _tile_fwd(head, norm_w_D, h_BCD, t_BC, cfg):
    return _tile_nll(head, norm_w_D, h_BCD, t_BC, cfg), (head, norm_w_D, h_BCD, t_BC)


def _tile_bwd(cfg, res, g_BC):
    """The cotangent of the logits, g x (softmax - one-hot of the target), as autodiff of
    `token_nll` forms it, then the head's own backward pass."""
    head, norm_w_D, h_BCD, t_BC = res
    logits_BCV, head_vjp = jax.vjp(
        lambda p, w, h: decoder.logits_from_hidden(p, h, w, cfg), head, norm_w_D, h_BCD)
    lse_BC = jax.nn.logsumexp(logits_BCV.astype(jnp.float32), axis=-1)
    d_BCV = g_BC[..., None] * jnp.exp(logits_BCV - lse_BC[..., None])
    b, c = t_BC.shape
    d_BCV = d_BCV.at[jnp.arange(b)[:, None], jnp.arange(c)[None, :], t_BC].add(-g_BC)
    return (*head_vjp(d_BCV.astype(logits_BCV.dtype)), None)


_tile_nll.defvjp(_tile_fwd, _tile_bwd)


__all__ = ["check_tiles", "cross_entropy", "mean_nll", "nll_from_hidden", "token_nll"]
