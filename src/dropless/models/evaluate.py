"""Mean next-token loss and perplexity of a model on a token stream (`dropless eval`'s library).

The tokens are cut into non-overlapping windows of seq_len + 1 tokens (a shorter tail is
dropped); the loss is the mean over every predicted token of the windows evaluated. JSON-ready
output never holds NaN. JAX is imported when the first batch is evaluated.
"""
from __future__ import annotations

import functools
import math

import numpy as np


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
    from dropless.models.deepseek import forward

    @functools.partial(jax.jit, static_argnames=("cfg",))
    def row_nll(params, b_BS1, *, cfg):
        logits, _, _ = forward(params, b_BS1[:, :-1], cfg)
        nll = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                              b_BS1[:, 1:])
        return jnp.sum(nll, axis=1)
    return row_nll


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
    loss = total / count
    out = {"loss": loss, "perplexity": math.exp(loss) if loss < 709.0 else None,
           "tokens": count, "windows": len(win)}
    if not math.isfinite(loss):
        out.update(loss=None, perplexity=None,
                   why_null=f"the mean loss is {loss} (non-finite logits: check the weights)")
    elif out["perplexity"] is None:
        out["why_null"] = f"perplexity exp({loss:.1f}) is beyond float64"
    return out
