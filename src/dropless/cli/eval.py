"""`dropless eval MODEL --data FILE`: mean next-token loss and perplexity of a model on a text
or JSONL file (one {"text": ...} per line). MODEL is hf:DIR or a dropless directory.

Documents are tokenized (with BOS when the tokenizer's folder says so), joined with its
end-of-sequence id and cut into non-overlapping windows of seq_len + 1 tokens (a shorter tail is
dropped); the loss is the mean over every predicted token of the windows evaluated. Arguments,
tokenizer and data are checked before the model is read; JSON output never holds NaN.
"""
from __future__ import annotations

import functools
import json
import math
import sys
from pathlib import Path

import numpy as np


def add_arguments(parser) -> None:
    parser.add_argument("model", help="hf:DIR (a Hugging Face folder) or a dropless directory")
    parser.add_argument("--data", required=True, help="a text file, or JSONL with a 'text' field")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per window (>= 1)")
    parser.add_argument("--batch-size", type=int, default=8, help="windows per batch (>= 1)")
    parser.add_argument("--max-batches", type=int, default=0, help="0 = the whole file")
    parser.add_argument("--tokenizer", help="'byte' or a tokenizer.json (default: the model "
                                            "folder's tokenizer.json; an HF folder without one "
                                            "is refused)")
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


def _check_args(args) -> None:
    from dropless.cli.model_args import at_least, check_dtype, check_model
    at_least("eval", "--seq-len", args.seq_len, 1)
    at_least("eval", "--batch-size", args.batch_size, 1)
    at_least("eval", "--max-batches", args.max_batches, 0)
    check_dtype("eval", args.dtype)
    if not Path(args.data).exists():
        raise ValueError(f"dropless eval: --data={args.data!r} does not exist")
    check_model("eval", args.model)


def _tokens(args, tok) -> np.ndarray:
    """The documents of --data, each encoded (BOS as the tokenizer says) and followed by EOS."""
    from dropless.train.data import _text_documents
    docs = [tok.encode(text) for _, text in _text_documents(args.data)]
    docs = [d for d in docs if d.size]
    if not docs:
        raise ValueError(f"dropless eval: --data={args.data!r} holds no text")
    eos = np.array([tok.eos_id])
    return np.concatenate([x for d in docs for x in (d, eos)]).astype(np.int32)


def run(args) -> int:
    """Arguments, tokenizer and data are checked before the model is read or compiled."""
    try:
        from dropless.cli.model_args import model_tokenizer
        from dropless.train.tokenizer import check_fits
        _check_args(args)
        tok = model_tokenizer("eval", args.model, args.tokenizer)
        tokens = _tokens(args, tok)
        windows(tokens, args.seq_len)
        from dropless.train.init_from import load_model
        cfg, params = load_model(args.model, dtype=args.dtype, what=f"dropless eval {args.model}")
        check_fits(tok, cfg.vocab_size, what=f"dropless eval {args.model}")
        out = evaluate(cfg, params, tokens, seq_len=args.seq_len, batch_size=args.batch_size,
                       max_batches=args.max_batches)
    except (ValueError, FileNotFoundError) as e:
        print(f"dropless: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"model": args.model, "data": args.data, "dtype": cfg.dtype,
                      "tokenizer": tok.name, **out}, allow_nan=False))
    return 0
