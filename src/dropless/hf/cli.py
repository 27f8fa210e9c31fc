"""`dropless convert SRC DST`: a Hugging Face folder -> a dropless directory, or back.

The direction follows SRC: a folder whose config.json names `architectures` (or `hf:DIR`) is
converted to DST/config.json (a TrainConfig holding the model) + DST/params (orbax), which
`dropless train init_from=DST`, `dropless eval DST` and `dropless generate DST` read; a dropless
directory (that layout, or a run directory with checkpoints/) is written to DST as a Hugging
Face folder that `transformers` loads.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path


def add_arguments(parser) -> None:
    parser.add_argument("src", help="Hugging Face folder (or hf:DIR), or a dropless directory")
    parser.add_argument("dst", help="output directory")
    parser.add_argument("--dtype", help="HF -> dropless: parameter dtype (default: the "
                                        "checkpoint's; bfloat16 for FP8)")
    parser.add_argument("--shard-size", type=int, default=4 * 2**30, metavar="BYTES",
                        help="dropless -> HF: largest safetensors file (default 4 GiB)")


def _is_hf(src: str) -> bool:
    if src.startswith("hf:"):
        return True
    conf = Path(src) / "config.json"
    return conf.is_file() and "architectures" in json.loads(conf.read_text())


def hf_to_dropless(src: str, dst: str, *, dtype: str | None = None) -> Path:
    """Write DST/config.json + DST/params from the Hugging Face folder SRC; returns DST."""
    import orbax.checkpoint as ocp
    from dropless import hf
    from dropless.config import TrainConfig
    from dropless.config_file import to_dict
    from dropless.train.init_from import folder_tokenizer
    folder = src[3:] if src.startswith("hf:") else src
    cfg, params = hf.load(folder, dtype=dtype)
    out = Path(dst).absolute()
    out.mkdir(parents=True, exist_ok=True)
    tok = folder_tokenizer("hf:" + folder)
    if tok != "byte":
        shutil.copy(tok, out / "tokenizer.json")
        tok = str(out / "tokenizer.json")
    tcfg = TrainConfig(model=cfg, tokenizer=tok)
    (out / "config.json").write_text(json.dumps(to_dict(tcfg), indent=2))
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(out / "params", params, force=True)
    ckptr.wait_until_finished()
    return out


def dropless_to_hf(src: str, dst: str, *, shard_size: int = 4 * 2**30) -> Path:
    """Write the Hugging Face folder DST from a dropless directory SRC; returns DST."""
    from dropless import hf
    from dropless.train.init_from import load_dropless
    tcfg, params = load_dropless(src)
    out = hf.save(tcfg.model, params, dst, max_shard_bytes=shard_size)
    if tcfg.tokenizer != "byte" and Path(tcfg.tokenizer).is_file():
        shutil.copy(tcfg.tokenizer, out / "tokenizer.json")
    return out


def run(args) -> int:
    try:
        if _is_hf(args.src):
            out = hf_to_dropless(args.src, args.dst, dtype=args.dtype)
            print(f"wrote {out}/config.json and {out}/params (use: dropless train "
                  f"init_from={out}, dropless eval {out})")
        else:
            out = dropless_to_hf(args.src, args.dst, shard_size=args.shard_size)
            print(f"wrote Hugging Face folder {out}")
    except (ValueError, FileNotFoundError) as e:
        print(f"dropless: error: {e}", file=sys.stderr)
        return 2
    return 0
