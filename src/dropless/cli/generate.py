"""`dropless generate MODEL --prompt TEXT`: continue a prompt, greedily (temperature 0, the
default) or by sampling at a temperature, so a converted model can be checked by eye.

Minimal on purpose: no KV cache. Each new token reruns the model over a fixed-length buffer
(prompt + max_new_tokens, one compilation); causal attention makes the padding after the
current position irrelevant. The prompt is encoded as the model's tokenizer says (BOS from its
tokenizer_config.json) and generation stops at its end-of-sequence ids (generation_config.json's
`eos_token_id`). Arguments are checked before the model is read.
"""
from __future__ import annotations

import functools
import math
import sys

import numpy as np


def add_arguments(parser) -> None:
    parser.add_argument("model", help="hf:DIR (a Hugging Face folder) or a dropless directory")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=32, help="at most this many "
                        "(>= 1); generation stops at the model's end-of-sequence token")
    parser.add_argument("--temperature", type=float, default=0.0, help="finite, >= 0; 0 = greedy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", help="'byte' or a tokenizer.json (default: the model "
                                            "folder's tokenizer.json; an HF folder without one "
                                            "is refused)")
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


def _check_args(args) -> None:
    from dropless.cli.model_args import at_least, check_dtype, check_model, check_temperature
    at_least("generate", "--max-new-tokens", args.max_new_tokens, 1)
    check_temperature("generate", args.temperature)
    check_dtype("generate", args.dtype)
    check_model("generate", args.model)


def run(args) -> int:
    """Arguments, tokenizer and prompt are checked before the model is read or compiled."""
    try:
        from dropless.cli.model_args import model_tokenizer
        from dropless.train.tokenizer import check_fits
        _check_args(args)
        tok = model_tokenizer("generate", args.model, args.tokenizer)
        prompt = np.asarray(tok.encode(args.prompt))
        if prompt.size == 0:
            raise ValueError("dropless generate: --prompt is empty (it must encode to at least "
                             "one token)")
        from dropless.train.init_from import load_model
        what = f"dropless generate {args.model}"
        cfg, params = load_model(args.model, dtype=args.dtype, what=what)
        check_fits(tok, cfg.vocab_size, what=what)
        ids = generate(cfg, params, prompt, max_new_tokens=args.max_new_tokens,
                       temperature=args.temperature, seed=args.seed,
                       stop_ids=tuple(tok.stop_ids))
    except (ValueError, FileNotFoundError) as e:
        print(f"dropless: error: {e}", file=sys.stderr)
        return 2
    print(tok.decode(ids))
    return 0
