"""`dropless convert SRC DST`: a Hugging Face folder -> a dropless directory, or back.

The direction follows SRC: a folder whose config.json names `architectures` (or `hf:DIR`) is
converted to DST/config.json (a TrainConfig holding the model) + DST/params (orbax), which
`dropless train init_from=DST`, `dropless eval DST` and `dropless generate DST` read; a dropless
directory (that layout, or a run directory with checkpoints/) is written to DST as a Hugging
Face folder that `transformers` loads. The tokenizer (tokenizer.json and its
tokenizer_config.json / generation_config.json) travels along, and so do the source config.json's
keys the model does not determine (DST/hf_kept_config.json, `model_dir.kept_config`; a line on
stderr for each the model overrides, and for each model setting the exported config.json
cannot carry). The converters are
`dropless.model_dir.weights.hf_to_dropless` / `dropless_to_hf`.

Nothing is destroyed (`hf.destination`): DST is written beside itself and moved into place when
complete; a non-empty DST needs --overwrite; SRC itself (or a folder inside or around it) is
refused as DST. Arguments are checked before anything is read.
"""
from __future__ import annotations

import sys


def add_arguments(parser) -> None:
    parser.add_argument("src", help="Hugging Face folder (or hf:DIR), or a dropless directory")
    parser.add_argument("dst", help="output directory (written beside itself, then moved into "
                                    "place; must be empty or absent unless --overwrite)")
    parser.add_argument("--dtype", help="parameter dtype of DST (default: the source's; "
                                        "bfloat16 for FP8 checkpoints)")
    parser.add_argument("--shard-size", type=int, default=4 * 2**30, metavar="BYTES",
                        help="dropless -> HF: largest safetensors file (default 4 GiB)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a non-empty DST (in one step: the old folder or the new, "
                             "never a mix)")


def _check_args(args) -> None:
    from dropless.cli.model_args import check_dtype
    from dropless.hf.destination import DestinationError, check_destination
    from dropless.model_dir import parse_spec
    if args.shard_size < 1:
        raise ValueError(f"dropless convert: --shard-size={args.shard_size} must be >= 1 byte")
    check_dtype("convert", args.dtype)
    folder = parse_spec(args.src).folder
    if not folder.is_dir():
        raise ValueError(f"dropless convert {args.src}: no such folder")
    try:
        check_destination(args.dst, sources=(folder,), overwrite=args.overwrite)
    except DestinationError as e:
        raise ValueError(f"dropless convert {args.src} {args.dst}: {e}") from None


def _announce(line: str) -> None:
    """A checkpoint fall-back (the run's newest step was damaged): one line on stderr."""
    print(f"dropless: {line}", file=sys.stderr, flush=True)


def run(args) -> int:
    """Check the arguments, then convert in the direction SRC names; errors are raised
    (ValueError: one line, exit 2, from `cli.main`)."""
    from dropless.cli.model_args import usage_errors
    from dropless.model_dir import names_architectures
    with usage_errors():
        _check_args(args)
        if names_architectures(args.src, what=f"dropless convert {args.src}"):
            from dropless.model_dir.weights import hf_to_dropless
            out = hf_to_dropless(args.src, args.dst, dtype=args.dtype, overwrite=args.overwrite)
            print(f"wrote {out}/config.json and {out}/params (use: dropless train "
                  f"init_from={out}, dropless eval {out})")
        else:
            from dropless.model_dir.weights import dropless_to_hf
            out = dropless_to_hf(args.src, args.dst, shard_size=args.shard_size,
                                 overwrite=args.overwrite, dtype=args.dtype,
                                 announce=_announce)
            print(f"wrote Hugging Face folder {out}")
    return 0
