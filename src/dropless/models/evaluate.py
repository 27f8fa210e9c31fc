"""Mean next-token loss and perplexity of a model (`dropless eval`'s library): on a token stream
cut into windows, or on batches of packed documents (`data.batch.Batch`).

Legend: B rows, S sequence length.

A token stream is cut into non-overlapping windows of seq_len + 1 tokens (a shorter tail is
dropped) and run as plain causal rows; the loss is the mean over every predicted token of the
windows evaluated. Batches of documents run with their segment ids and positions (attention
and rope per document); the loss is the mean over the targets their loss masks count.
JSON-ready output never holds NaN. JAX is imported when the first batch is evaluated.
"""
from __future__ import annotations

import functools
import math
from typing import Iterable

import numpy as np

from dropless.data.batch import Batch


def windows(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """[N, seq_len + 1] non-overlapping windows; raises ValueError when there is not one."""
    n = tokens.size // (seq_len + 1)
    if n == 0:
        raise ValueError(f"the data has {tokens.size} tokens, fewer than seq_len + 1 = "
                         f"{seq_len + 1}; lower --seq-len")
    return np.asarray(tokens[: n * (seq_len + 1)]).reshape(n, seq_len + 1).astype(np.int32)


@functools.cache
def _row_nll():
    """Summed next-token loss of each row of a [B, S + 1] batch, jitted once per config (built
    on first use)."""
    import jax
    import jax.numpy as jnp
    import optax
    from dropless.models.decoder import forward

    @functools.partial(jax.jit, static_argnames=("cfg",))
    def row_nll(params, b_BS1, *, cfg):
        logits, _, _ = forward(params, b_BS1[:, :-1], cfg)
        nll = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                              b_BS1[:, 1:])
        return jnp.sum(nll, axis=1)
    return row_nll


@functools.cache
def _document_nll():
    """(summed loss over the counted targets, counted targets) of each row of a Batch, with its
    segment ids and positions; jitted once per config (built on first use)."""
    import jax
    import jax.numpy as jnp
    import optax
    from dropless.models.decoder import forward

    @functools.partial(jax.jit, static_argnames=("cfg",))
    def document_nll(params, b: Batch, *, cfg):
        logits, _, _ = forward(params, b.tokens_BS, cfg, segment_ids_BS=b.segment_ids_BS,
                               positions_BS=b.positions_BS)
        nll = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                              b.targets_BS)
        return jnp.sum(nll * b.loss_mask_BS, axis=1), jnp.sum(b.loss_mask_BS, axis=1)
    return document_nll


def _summary(total: float, count: float, rows: int) -> dict:
    """{"loss", "perplexity", "tokens", "windows"}; a non-finite loss (or a perplexity past
    float range) is None, with "why_null" saying why: JSON has no NaN."""
    loss = total / count
    out = {"loss": loss, "perplexity": math.exp(loss) if loss < 709.0 else None,
           "tokens": int(count), "windows": rows}
    if not math.isfinite(loss):
        out.update(loss=None, perplexity=None,
                   why_null=f"the mean loss is {loss} (non-finite logits: check the weights)")
    elif out["perplexity"] is None:
        out["why_null"] = f"perplexity exp({loss:.1f}) is beyond float64"
    return out


def evaluate(cfg, params, tokens: np.ndarray, *, seq_len: int, batch_size: int,
             max_batches: int = 0) -> dict:
    """{"loss", "perplexity", "tokens", "windows"} of `params` on `tokens`. A non-finite loss
    (or a perplexity past float range) is None, with "why_null" saying why: JSON has no NaN."""
    win = windows(tokens, seq_len)
    if max_batches:
        win = win[: max_batches * batch_size]
    total, count = 0.0, 0
    for i in range(0, len(win), batch_size):
        b = win[i:i + batch_size]
        real = len(b)
        if real < batch_size:   # one compiled shape: pad the last batch, count only real rows
            b = np.concatenate([b, np.zeros((batch_size - real, b.shape[1]), np.int32)])
        total += float(np.sum(np.asarray(_row_nll()(params, b, cfg=cfg))[:real]))
        count += real * seq_len
    return _summary(total, count, len(win))


def pad_rows(b: Batch, rows: int) -> Batch:
    """`b` with rows of padding (segment 0, nothing counted) up to `rows` rows."""
    if len(b.tokens_BS) >= rows:
        return b
    return Batch(*(np.concatenate([a, np.zeros((rows - len(a),) + a.shape[1:], a.dtype)])
                   for a in b))


def evaluate_batches(cfg, params, batches: Iterable[Batch], *, rows: int) -> dict:
    """{"loss", "perplexity", "tokens", "windows"} of `params` over batches of documents:
    each run with its segment ids and positions, the loss the mean over the targets the loss
    masks count ("tokens"), "windows" the rows. A batch of fewer than `rows` rows is padded
    (one compiled shape). Raises ValueError when no target is counted."""
    total, count, seen = 0.0, 0.0, 0
    for b in batches:
        nll, n = _document_nll()(params, pad_rows(b, rows), cfg=cfg)
        total += float(np.sum(np.asarray(nll, np.float64)))
        count += float(np.sum(np.asarray(n, np.float64)))
        seen += len(b.tokens_BS)
    if count == 0:
        raise ValueError("the batches evaluated count no target (every loss mask is 0)")
    return _summary(total, count, seen)
