"""The weights of a model folder: the reader (`load_dropless`) and the writer
(`write_dropless`) of a dropless directory, the loader of either kind of MODEL (`hf:DIR` or a
dropless directory) that `dropless eval`, `generate` and `convert` share, and the converters
Hugging Face <-> dropless.

A dropless directory (see `model_dir.folder`) holds config.json (a TrainConfig as
`model_dir.to_dict` writes it, the model and the tokenizer) and params/ (the parameters, an
orbax StandardCheckpointer tree), or, for a run directory, checkpoints/ (the newest step's
parameters are read, alone, by `checkpoint.read_params`: with its integrity checks and layout
conversion, without building optimizer state). The tokenizer (tokenizer.json and its side
files) travels along.

Layer: `model_dir` (docs/architecture.md): above `checkpoint`, `hf` and `models`, below
`config_file` and `train`. JAX and orbax are imported when a function needs them.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from dropless.model_dir.folder import folder_tokenizer, parse_spec, read_dropless_config
from dropless.model_dir.run_config import from_dict, to_dict


def load_model(spec: str, *, dtype: str | None = None, what: str = ""):
    """(ModelConfig, params) from "hf:DIR" or a dropless directory. `dtype` (both kinds) sets
    the model's dtype and weight_dtype and casts the parameters as training would hold them."""
    parsed = parse_spec(spec)
    if parsed.hf:
        from dropless import hf
        return hf.load(parsed.folder, dtype=dtype)
    tcfg, params = load_dropless(parsed.folder, what=what)
    cfg = tcfg.model
    if dtype is not None:
        moe = cfg.moe and cfg.moe.replace(dtype=dtype, weight_dtype=dtype)
        cfg = cfg.replace(dtype=dtype, weight_dtype=dtype, moe=moe)
        params = cast_like(params, cfg)
    return cfg, params


def load_dropless(folder: str | Path, *, what: str = ""):
    """(TrainConfig, params) of a `dropless convert` output (params/) or a run (its newest
    checkpoint's parameters, read alone). Errors start with `what` (see
    `model_dir.read_dropless_config`); a damaged checkpoint raises
    checkpoint.CheckpointDamaged."""
    import jax
    from dropless.models.deepseek import init_params
    folder = Path(folder).absolute()
    cfg = from_dict(read_dropless_config(folder, what=what))
    like = jax.eval_shape(lambda k: init_params(k, cfg.model), jax.random.key(0))
    if (folder / "params").is_dir():
        import orbax.checkpoint as ocp
        return cfg, ocp.StandardCheckpointer().restore(folder / "params", like)
    from dropless import checkpoint as ckpt
    step = ckpt.latest_step(folder / "checkpoints")
    if step is None:
        raise ValueError(f"{what or folder}: neither params/ nor a checkpoint under "
                         f"{folder / 'checkpoints'}")
    return cfg, ckpt.read_params(folder / "checkpoints", step, like)


def cast_like(params: Any, cfg) -> Any:
    """`params` cast leaf by leaf to the dtypes `init_params(cfg)` gives (cfg a ModelConfig)."""
    import jax
    import jax.numpy as jnp
    from dropless.models.deepseek import init_params
    like = jax.eval_shape(lambda k: init_params(k, cfg), jax.random.key(0))
    return jax.tree.map(lambda x, l: jnp.asarray(x, l.dtype), params, like)


def tokenizer_files(tok: str) -> list[Path]:
    """tokenizer.json and its side files when `tok` names one ('byte' and '' name none)."""
    from dropless.data.tokenizer import side_files
    return side_files(tok) if tok not in ("byte", "") and Path(tok).is_file() else []


def write_dropless(dst: str | Path, model, params: Any, *, tokenizer: str = "",
                   sources: tuple = (), overwrite: bool = False) -> Path:
    """Write the dropless directory DST: params/ (orbax), the tokenizer's files (when
    `tokenizer` names a tokenizer.json) and config.json (a TrainConfig holding `model`, naming
    DST's copy of the tokenizer, or none). Written beside DST and moved into place when
    complete (`hf.destination`: a non-empty DST needs `overwrite`; `sources` may not be DST);
    config.json is written last, so a folder left by a killed write holds none and nothing
    loads it. Returns DST (absolute)."""
    import orbax.checkpoint as ocp
    from dropless.config import TrainConfig
    from dropless.hf.destination import check_destination, staged
    out = check_destination(dst, sources=sources, overwrite=overwrite)
    with staged(out) as tmp:
        ckptr = ocp.StandardCheckpointer()
        ckptr.save(tmp / "params", params, force=True)
        ckptr.wait_until_finished()
        for f in tokenizer_files(tokenizer):
            shutil.copyfile(f, tmp / f.name)
        tcfg = TrainConfig(model=model, tokenizer=str(out / "tokenizer.json") if tokenizer else "")
        (tmp / "config.json").write_text(json.dumps(to_dict(tcfg), indent=2))
    return out


def hf_to_dropless(src: str, dst: str, *, dtype: str | None = None,
                   overwrite: bool = False) -> Path:
    """Write DST/config.json + DST/params from the Hugging Face folder SRC (hf:DIR or DIR);
    returns DST. A folder without tokenizer.json gives a DST that names no tokenizer (eval /
    train then ask for one); one with only a SentencePiece tokenizer.model is refused (the
    message says how to write tokenizer.json)."""
    from dropless import hf
    from dropless.hf.destination import check_destination
    from dropless.model_dir.folder import hf_tokenizer
    from dropless.data import tokenizer as tok_lib
    folder = parse_spec(src).folder
    check_destination(dst, sources=(folder,), overwrite=overwrite)
    tok = str(folder / "tokenizer.json") if (folder / "tokenizer.json").is_file() else ""
    if not tok and (folder / "tokenizer.model").is_file():
        hf_tokenizer(folder, override="")   # raises with the how-to
    cfg, params = hf.load(folder, dtype=dtype)
    if tok:
        tok_lib.check_fits(tok_lib.make_tokenizer(tok), cfg.vocab_size,
                           what=f"dropless convert {src}")
    return write_dropless(dst, cfg, params, tokenizer=tok, sources=(folder,),
                          overwrite=overwrite)


def dropless_to_hf(src: str, dst: str, *, shard_size: int = 4 * 2**30,
                   overwrite: bool = False, dtype: str | None = None) -> Path:
    """Write the Hugging Face folder DST from a dropless directory SRC (cast to `dtype` if
    given); returns DST."""
    from dropless import hf
    from dropless.hf.destination import check_destination
    out = check_destination(dst, sources=(src,), overwrite=overwrite)
    cfg, params = load_model(src, dtype=dtype, what=f"dropless convert {src}")
    extra = tokenizer_files(folder_tokenizer(src))
    hf.save(cfg, params, out, max_shard_bytes=shard_size, overwrite=overwrite,
            extra_files=tuple(extra))
    return out
