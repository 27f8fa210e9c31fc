"""`dropless eval MODEL --data FILE`: mean next-token loss and perplexity of a model on a text
or JSONL file (one {"text": ...} per line), or on a prepared dataset's eval split (`dropless data
prepare`). MODEL is hf:DIR or a dropless directory.

Documents are tokenized (with BOS when the tokenizer's folder says so), joined with its
end-of-sequence id and cut into non-overlapping windows of seq_len + 1 tokens (a shorter tail is
dropped); the loss is the mean over every predicted token of the windows evaluated. Arguments,
tokenizer and data are checked before the model is read; JSON output never holds NaN.
"""
from __future__ import annotations

import sys
from pathlib import Path

from dropless.cli.model_args import add_model_options


def add_arguments(parser) -> None:
    parser.add_argument("model", help="hf:DIR (a Hugging Face folder) or a dropless directory")
    parser.add_argument("--data", required=True,
                        help="a text file, JSONL with a 'text' field, or a prepared folder "
                             "(`dropless data prepare`: its eval split)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per window (>= 1)")
    parser.add_argument("--batch-size", type=int, default=8, help="windows per batch (>= 1)")
    parser.add_argument("--max-batches", type=int, default=0, help="0 = the whole file")
    add_model_options(parser)


def _check_args(args) -> None:
    from dropless.cli.model_args import at_least, check_dtype, check_model
    at_least("eval", "--seq-len", args.seq_len, 1)
    at_least("eval", "--batch-size", args.batch_size, 1)
    at_least("eval", "--max-batches", args.max_batches, 0)
    check_dtype("eval", args.dtype)
    if not Path(args.data).exists():
        raise ValueError(f"dropless eval: --data={args.data!r} does not exist")
    check_model("eval", args.model)


def _announce(line: str) -> None:
    """A checkpoint fall-back (the run's newest step was damaged): one line on stderr."""
    print(f"dropless: {line}", file=sys.stderr, flush=True)


def run(args) -> int:
    """Arguments, tokenizer and data are checked before the model is read or compiled; errors
    are raised (ValueError: one line, exit 2, from `cli.main`)."""
    from dropless.cli.model_args import model_tokenizer, usage_errors
    from dropless.data.corpus import document_tokens
    from dropless.data.tokenizer import check_fits
    with usage_errors():
        _check_args(args)
        tok = model_tokenizer("eval", args.model, args.tokenizer)
        tokens = document_tokens(args.data, tok, what=f"dropless eval: --data={args.data!r}",
                                 use="--data ")
        from dropless.model_dir.weights import load_model
        from dropless.models.evaluate import evaluate, windows
        try:
            windows(tokens, args.seq_len)
        except ValueError as e:   # which file was too short, and what to do
            raise ValueError(f"dropless eval: --data={args.data!r}: {e}") from None
        cfg, params = load_model(args.model, dtype=args.dtype, what=f"dropless eval {args.model}",
                                 announce=_announce)
        check_fits(tok, cfg.vocab_size, what=f"dropless eval {args.model}")
        out = evaluate(cfg, params, tokens, seq_len=args.seq_len, batch_size=args.batch_size,
                       max_batches=args.max_batches)
    from dropless import json_out   # a NaN loss: null and `loss_nonfinite`, never a NaN token
    print(json_out.dumps({"model": args.model, "data": args.data, "dtype": cfg.dtype,
                          "tokenizer": tok.name, **out}))
    return 0
