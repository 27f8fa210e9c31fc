"""`dropless convert SRC DST`: a Hugging Face folder -> a dropless directory, or back.

The direction follows SRC: a folder whose config.json names `architectures` (or `hf:DIR`) is
converted to DST/config.json (a TrainConfig holding the model) + DST/params (orbax), which
`dropless train init_from=DST`, `dropless eval DST` and `dropless generate DST` read; a dropless
directory (that layout, or a run directory with checkpoints/) is written to DST as a Hugging
Face folder that `transformers` loads. The tokenizer (tokenizer.json and its
tokenizer_config.json / generation_config.json) travels along.

Nothing is destroyed (`hf.destination`): DST is written beside itself and moved into place when
complete; a non-empty DST needs --overwrite; SRC itself (or a folder inside or around it) is
refused as DST. Arguments are checked before anything is read.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path


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


def _folder(src: str) -> Path:
    return Path(src[3:] if src.startswith("hf:") else src)


def _is_hf(src: str) -> bool:
    if src.startswith("hf:"):
        return True
    conf = Path(src) / "config.json"
    if not conf.is_file():
        return False
    try:
        data = json.loads(conf.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"dropless convert {src}: {conf} is not valid JSON ({e})") from None
    return isinstance(data, dict) and "architectures" in data


def _tokenizer_files(tok: str) -> list[Path]:
    from dropless.train.tokenizer import side_files
    return side_files(tok) if tok not in ("byte", "") and Path(tok).is_file() else []


def hf_to_dropless(src: str, dst: str, *, dtype: str | None = None,
                   overwrite: bool = False) -> Path:
    """Write DST/config.json + DST/params from the Hugging Face folder SRC; returns DST.
    A folder without tokenizer.json gives a DST that names no tokenizer (eval / train then ask
    for one); one with only a SentencePiece tokenizer.model is refused (the message says how to
    write tokenizer.json)."""
    import orbax.checkpoint as ocp
    from dropless import hf
    from dropless.config import TrainConfig
    from dropless.config_file import to_dict
    from dropless.hf.destination import check_destination, staged
    from dropless.train import tokenizer as tok_lib
    folder = _folder(src)
    out = check_destination(dst, sources=(folder,), overwrite=overwrite)
    tok = str(folder / "tokenizer.json") if (folder / "tokenizer.json").is_file() else ""
    if not tok and (folder / "tokenizer.model").is_file():
        tok_lib.folder_tokenizer(folder, override="")   # raises with the how-to
    cfg, params = hf.load(folder, dtype=dtype)
    if tok:
        tok_lib.check_fits(tok_lib.make_tokenizer(tok), cfg.vocab_size,
                           what=f"dropless convert {src}")
    with staged(out) as tmp:
        ckptr = ocp.StandardCheckpointer()
        ckptr.save(tmp / "params", params, force=True)
        ckptr.wait_until_finished()
        for f in _tokenizer_files(tok):
            shutil.copyfile(f, tmp / f.name)
        tcfg = TrainConfig(model=cfg, tokenizer=str(out / "tokenizer.json") if tok else "")
        # config.json last: a folder left by a killed write holds none, so nothing loads it
        (tmp / "config.json").write_text(json.dumps(to_dict(tcfg), indent=2))
    return out


def dropless_to_hf(src: str, dst: str, *, shard_size: int = 4 * 2**30,
                   overwrite: bool = False, dtype: str | None = None) -> Path:
    """Write the Hugging Face folder DST from a dropless directory SRC (cast to `dtype` if
    given); returns DST."""
    from dropless import hf
    from dropless.hf.destination import check_destination
    from dropless.train.init_from import folder_tokenizer, load_model
    out = check_destination(dst, sources=(src,), overwrite=overwrite)
    cfg, params = load_model(src, dtype=dtype, what=f"dropless convert {src}")
    extra = _tokenizer_files(folder_tokenizer(src))
    hf.save(cfg, params, out, max_shard_bytes=shard_size, overwrite=overwrite,
            extra_files=tuple(extra))
    return out


def _check_args(args) -> None:
    from dropless.cli.model_args import check_dtype
    if args.shard_size < 1:
        raise ValueError(f"dropless convert: --shard-size={args.shard_size} must be >= 1 byte")
    check_dtype("convert", args.dtype)
    if not _folder(args.src).is_dir():
        raise ValueError(f"dropless convert {args.src}: no such folder")


def run(args) -> int:
    from dropless.hf.destination import DestinationError, check_destination
    try:
        _check_args(args)
        try:
            check_destination(args.dst, sources=(_folder(args.src),), overwrite=args.overwrite)
        except DestinationError as e:
            raise ValueError(f"dropless convert {args.src} {args.dst}: {e}") from None
        if _is_hf(args.src):
            out = hf_to_dropless(args.src, args.dst, dtype=args.dtype, overwrite=args.overwrite)
            print(f"wrote {out}/config.json and {out}/params (use: dropless train "
                  f"init_from={out}, dropless eval {out})")
        else:
            out = dropless_to_hf(args.src, args.dst, shard_size=args.shard_size,
                                 overwrite=args.overwrite, dtype=args.dtype)
            print(f"wrote Hugging Face folder {out}")
    except (ValueError, FileNotFoundError) as e:
        print(f"dropless: error: {e}", file=sys.stderr)
        return 2
    return 0
