"""Continue a prompt, greedily (temperature 0) or by sampling at a temperature
(`dropless generate`'s library), so a converted model can be checked by eye.

Minimal on purpose: no KV cache. Each new token reruns the model over a fixed-length buffer
(prompt + max_new_tokens, one compilation); causal attention makes the padding after the
current position irrelevant. JAX is imported when the first token is generated.
"""
from __future__ import annotations

import functools
import math

import numpy as np


@functools.cache
def _next_token():
    """The token after position pos - 1, jitted once per config, temperature and length
    (built on first use)."""
    import jax
    import jax.numpy as jnp
    from dropless.models.decoder import forward

    @functools.partial(jax.jit, static_argnames=("cfg", "temperature"))
    def next_token(params, buf_1S, pos, key, *, cfg, temperature: float):
        logits = jax.lax.dynamic_index_in_dim(forward(params, buf_1S, cfg)[0][0], pos - 1,
                                              keepdims=False).astype(jnp.float32)
        if temperature == 0:
            return jnp.argmax(logits).astype(jnp.int32)
        return jax.random.categorical(key, logits / temperature).astype(jnp.int32)
    return next_token


def memory_needed(cfg, length: int) -> int:
    """A lower bound of the bytes one forward over a buffer of `length` tokens holds at once:
    the float32 logits [S, V] and one layer's attention scores [H, S, S] (plain-XLA attention
    materialises them), beside the parameters already loaded."""
    return 4 * length * cfg.vocab_size + 4 * cfg.num_heads * length * length


def generate(cfg, params, prompt_ids: np.ndarray, *, max_new_tokens: int,
             temperature: float = 0.0, seed: int = 0, stop_ids: tuple = ()) -> np.ndarray:
    """prompt [P] -> the prompt and up to max_new_tokens ids (greedy when temperature == 0),
    ending at the first of `stop_ids` (kept, as transformers does). Raises ValueError for an
    empty prompt, a negative or non-finite temperature or a negative max_new_tokens."""
    if prompt_ids.size == 0:
        raise ValueError("the prompt is empty (it must encode to at least one token)")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature={temperature} must be finite and >= 0")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
    p = int(prompt_ids.size)
    buf = np.zeros((1, p + max_new_tokens), np.int32)
    buf[0, :p] = prompt_ids
    import jax
    key = jax.random.key(seed)
    for pos in range(p, p + max_new_tokens):
        key, sub = jax.random.split(key)
        buf[0, pos] = int(_next_token()(params, buf, pos, sub, cfg=cfg,
                                      temperature=float(temperature)))
        if int(buf[0, pos]) in stop_ids:
            return buf[0, :pos + 1]
    return buf[0]
