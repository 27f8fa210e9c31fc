"""`dropless generate MODEL --prompt TEXT`: continue a prompt, greedily (temperature 0, the
default) or by sampling at a temperature, so a converted model can be checked by eye.

Minimal on purpose: no KV cache. Each new token reruns the model over a fixed-length buffer
(prompt + max_new_tokens, one compilation); causal attention makes the padding after the
current position irrelevant. The prompt is encoded as the model's tokenizer says (BOS from its
tokenizer_config.json) and generation stops at its end-of-sequence ids (generation_config.json's
`eos_token_id`). Arguments are checked before the model is read.
"""
from __future__ import annotations

import sys

import numpy as np

from dropless.cli.model_args import add_model_options


def add_arguments(parser) -> None:
    parser.add_argument("model", help="hf:DIR (a Hugging Face folder) or a dropless directory")
    parser.add_argument("--prompt", required=True,
                        help="the text to continue (encoded as the model's tokenizer says)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="at most this many "
                        "(>= 1); generation stops at the model's end-of-sequence token")
    parser.add_argument("--temperature", type=float, default=0.0, help="finite, >= 0; 0 = greedy")
    parser.add_argument("--seed", type=int, default=0,
                        help="the sampling seed (with --temperature > 0; the same seed, the "
                             "same text)")
    add_model_options(parser)


def _check_args(args) -> None:
    from dropless.cli.model_args import at_least, check_dtype, check_model, check_temperature
    at_least("generate", "--max-new-tokens", args.max_new_tokens, 1)
    check_temperature("generate", args.temperature)
    check_dtype("generate", args.dtype)
    check_model("generate", args.model)


def _announce(line: str) -> None:
    """A checkpoint fall-back (the run's newest step was damaged): one line on stderr."""
    print(f"dropless: {line}", file=sys.stderr, flush=True)


def _model_config(spec: str, what: str):
    """The ModelConfig of MODEL from its config.json alone (no weights read, nothing computed):
    what `load_model` will return the weights of, its dtype aside."""
    from dropless.model_dir import from_dict, hf_model_config, parse_spec, read_dropless_config
    parsed = parse_spec(spec)
    if parsed.hf:
        return hf_model_config(spec)
    return from_dict(read_dropless_config(parsed.folder, what=what)).model


def run(args) -> int:
    """Arguments, tokenizer and prompt are checked before the model is read or compiled; errors
    are raised (ValueError: one line, exit 2, from `cli.main`)."""
    from dropless.cli.model_args import model_tokenizer, usage_errors
    from dropless.data.tokenizer import check_fits
    with usage_errors():
        _check_args(args)
        tok = model_tokenizer("generate", args.model, args.tokenizer)
        prompt = np.asarray(tok.encode(args.prompt))
        if prompt.size == 0:
            raise ValueError("dropless generate: --prompt is empty (it must encode to at least "
                             "one token)")
        from dropless.model_dir.weights import load_model
        from dropless.models.generate import generate, memory_needed
        from dropless.runtime import environment
        what = f"dropless generate {args.model}"
        # the buffer's memory depends on the model's shape alone: refused before the weights
        # are read (a checkpoint of any size, or a run's fall-back that would move a step aside)
        length = int(prompt.size) + args.max_new_tokens
        environment.check_fits(memory_needed(_model_config(args.model, what), length),
                               f"{what}: --max-new-tokens {args.max_new_tokens} after a "
                               f"{prompt.size}-token prompt ({length} positions)",
                               "lower --max-new-tokens")
        cfg, params = load_model(args.model, dtype=args.dtype, what=what, announce=_announce)
        check_fits(tok, cfg.vocab_size, what=what)
        ids = generate(cfg, params, prompt, max_new_tokens=args.max_new_tokens,
                       temperature=args.temperature, seed=args.seed,
                       stop_ids=tuple(tok.stop_ids))
    print(tok.decode(ids))
    return 0
