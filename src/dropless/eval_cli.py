"""`dropless eval MODEL --data FILE`: mean next-token loss and perplexity of a model on a text
or JSONL file (one {"text": ...} per line). MODEL is hf:DIR or a dropless directory.

Documents are tokenized, joined with the tokenizer's end-of-sequence id and cut into
non-overlapping windows of seq_len + 1 tokens (a shorter tail is dropped); the loss is the mean
over every predicted token of the windows evaluated.
"""
from __future__ import annotations

import functools
import json
import math
import sys

import numpy as np


def add_arguments(parser) -> None:
    parser.add_argument("model", help="hf:DIR (a Hugging Face folder) or a dropless directory")
    parser.add_argument("--data", required=True, help="a text file, or JSONL with a 'text' field")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-batches", type=int, default=0, help="0 = the whole file")
    parser.add_argument("--tokenizer", help="override: 'byte' or a tokenizer.json")
    parser.add_argument("--dtype", help="parameter/activation dtype (default: the model's)")


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
    on first use: importing this module must not import JAX, see cli.py)."""
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
    """{"loss", "perplexity", "tokens", "windows"} of `params` on `tokens`."""
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
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": count, "windows": len(win)}


def run(args) -> int:
    try:
        from dropless.train.data import _text_documents, make_tokenizer
        from dropless.train.init_from import load_model
        cfg, params, tok_name = load_model(args.model, dtype=args.dtype)
        tok = make_tokenizer(args.tokenizer or tok_name)
        docs = [tok.encode(text) for _, text in _text_documents(args.data)]
        eos = np.array([tok.eos_id])
        tokens = np.concatenate([x for d in docs for x in (d, eos)])
        if tokens.max() >= cfg.vocab_size:
            raise ValueError(f"token id {int(tokens.max())} >= model vocab_size={cfg.vocab_size}"
                             f" (tokenizer {args.tokenizer or tok_name!r} does not fit the model)")
        out = evaluate(cfg, params, tokens, seq_len=args.seq_len, batch_size=args.batch_size,
                       max_batches=args.max_batches)
    except (ValueError, FileNotFoundError) as e:
        print(f"dropless: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"model": args.model, "data": args.data, **out}))
    return 0
