"""`dropless generate MODEL --prompt TEXT`: continue a prompt, greedily (temperature 0, the
default) or by sampling at a temperature, so a converted model can be checked by eye.

Minimal on purpose: no KV cache. Each new token reruns the model over a fixed-length buffer
(prompt + max_new_tokens, one compilation); causal attention makes the padding after the
current position irrelevant.
"""
from __future__ import annotations

import functools
import sys

import numpy as np


def add_arguments(parser) -> None:
    parser.add_argument("model", help="hf:DIR (a Hugging Face folder) or a dropless directory")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", help="override: 'byte' or a tokenizer.json")
    parser.add_argument("--dtype", help="parameter/activation dtype (default: the model's)")


@functools.cache
def _next_token():
    """The token after position pos - 1, jitted once per config, temperature and length
    (built on first use: importing this module must not import JAX, see cli.py)."""
    import jax
    import jax.numpy as jnp
    from dropless.models.deepseek import forward

    @functools.partial(jax.jit, static_argnames=("cfg", "temperature"))
    def next_token(params, buf_1S, pos, key, *, cfg, temperature: float):
        logits = jax.lax.dynamic_index_in_dim(forward(params, buf_1S, cfg)[0][0], pos - 1,
                                              keepdims=False).astype(jnp.float32)
        if temperature == 0:
            return jnp.argmax(logits).astype(jnp.int32)
        return jax.random.categorical(key, logits / temperature).astype(jnp.int32)
    return next_token


def generate(cfg, params, prompt_ids: np.ndarray, *, max_new_tokens: int,
             temperature: float = 0.0, seed: int = 0) -> np.ndarray:
    """prompt [P] -> the P + max_new_tokens ids (greedy when temperature == 0).
    Raises ValueError for an empty prompt or a negative temperature."""
    if prompt_ids.size == 0:
        raise ValueError("the prompt is empty (it must encode to at least one token)")
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0")
    p = int(prompt_ids.size)
    buf = np.zeros((1, p + max_new_tokens), np.int32)
    buf[0, :p] = prompt_ids
    import jax
    key = jax.random.key(seed)
    for pos in range(p, p + max_new_tokens):
        key, sub = jax.random.split(key)
        buf[0, pos] = int(_next_token()(params, buf, pos, sub, cfg=cfg,
                                      temperature=float(temperature)))
    return buf[0]


def run(args) -> int:
    try:
        from dropless.train.data import make_tokenizer
        from dropless.train.init_from import load_model
        cfg, params, tok_name = load_model(args.model, dtype=args.dtype)
        tok = make_tokenizer(args.tokenizer or tok_name)
        ids = generate(cfg, params, np.asarray(tok.encode(args.prompt)),
                       max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       seed=args.seed)
    except (ValueError, FileNotFoundError) as e:
        print(f"dropless: error: {e}", file=sys.stderr)
        return 2
    print(tok.decode(ids))
    return 0
