"""The weights of a model folder: the reader (`load_dropless`) and the writer
(`write_dropless`) of a dropless directory, the loader of either kind of MODEL (`hf:DIR` or a
dropless directory) that `dropless eval`, `generate` and `convert` share, and the converters
Hugging Face <-> dropless.

A dropless directory (see `model_dir.folder`) holds config.json (a TrainConfig as
`model_dir.to_dict` writes it, the model and the tokenizer), params/ (the parameters, an
orbax StandardCheckpointer tree) and hashes.json (the xxh3-64 hash of every array, as a
checkpoint records them, verified on load), or, for a run directory, checkpoints/ (the
parameters of the newest intact step are read, alone, through the one checkpoint reader,
`checkpoint.read_newest` with `checkpoint.read_params`: hashes verified, damaged steps moved
aside and the fall-back announced, steps a live trainer is writing skipped, without building
optimizer state). The tokenizer (tokenizer.json and its side files) travels along, and so do
a Hugging Face source's generation_config.json and the keys of its config.json the model does
not determine (hf_kept_config.json, `model_dir.kept_config`).

Layer: `model_dir` (docs/architecture.md): above `checkpoint`, `hf` and `models`, below
`config_file` and `train`. JAX and orbax are imported when a function needs them.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

from dropless.model_dir.folder import (folder_tokenizer, parse_spec, read_dropless_config,
                                       read_json_object)
from dropless.model_dir.kept_config import (KEPT_FILE, fallback_keys, is_run, kept_of_hf_folder,
                                            origin_keys, override_words)
from dropless.model_dir.run_config import from_dict, to_dict


HASHES = "hashes.json"       # a dropless directory's array hashes: {"hash": ..., "hashes": {...}}


def load_model(spec: str, *, dtype: str | None = None, what: str = "",
               announce: Callable[[str], Any] | None = None):
    """(ModelConfig, params) from "hf:DIR" or a dropless directory. `dtype` (both kinds) sets
    the model's dtype and weight_dtype and casts the parameters as training would hold them.
    `announce` receives the one line of a checkpoint fall-back (see `load_dropless`)."""
    parsed = parse_spec(spec)
    dtype = _model_dtype(dtype, what or spec)
    if parsed.hf:
        from dropless import hf
        return hf.load(parsed.folder, dtype=dtype)
    tcfg, params = load_dropless(parsed.folder, what=what, announce=announce)
    cfg = tcfg.model
    if dtype is not None:
        moe = cfg.moe and cfg.moe.replace(dtype=dtype, weight_dtype=dtype)
        cfg = cfg.replace(dtype=dtype, weight_dtype=dtype, moe=moe)
        params = cast_like(params, cfg)
    return cfg, params


def _model_dtype(dtype: str | None, what: str) -> str | None:
    """`dtype`'s canonical name (`hf.config_map.model_dtype`), checked before anything is
    read; ValueError starting with `what` for one no model holds (float64, ...)."""
    if dtype is None:
        return None
    from dropless.hf.config_map import model_dtype
    try:
        return model_dtype(dtype)
    except ValueError as e:
        raise ValueError(f"{what}: --{e}") from None


def load_dropless(folder: str | Path, *, what: str = "",
                  announce: Callable[[str], Any] | None = None,
                  read: Callable[[str], Any] | None = None):
    """(TrainConfig, params) of a `dropless convert` output (params/, verified against
    hashes.json) or a run (its newest intact checkpoint's parameters, read alone through
    `checkpoint.read_newest`: damaged newer steps are moved to checkpoints/damaged/ and the
    fall-back is given to `announce` in one line; steps not yet committed are skipped). Raises
    ValueError starting with `what` (see `model_dir.read_dropless_config`) when the folder is
    not a model, its params/ are damaged, or no step of the run reads. `read`, when given,
    gets words saying what was read ("params/ of DIR", "step 7 of DIR/checkpoints")."""
    import jax
    from dropless.models.decoder import init_params
    folder = Path(folder).absolute()
    cfg = from_dict(read_dropless_config(folder, what=what))
    like = jax.eval_shape(lambda k: init_params(k, cfg.model), jax.random.key(0))
    if (folder / "params").is_dir():
        params = _read_params_dir(folder, like, what=what or str(folder))
        if read is not None:
            read(f"read params/ of {folder}")
        return cfg, params
    from dropless import checkpoint as ckpt
    directory = folder / "checkpoints"
    try:
        found = ckpt.read_newest(directory, lambda s: ckpt.read_params(directory, s, like),
                                 writer_may_run=True)
    except ckpt.NoIntactStep as e:
        raise ValueError(f"{what or folder}: neither params/ nor a readable checkpoint: {e}"
                         ) from None
    except ckpt.DoesNotFit as e:   # intact files of another model: refused, nothing moved
        raise ValueError(f"{what or folder}: {e}; the model asked for is the one "
                         f"{folder / 'config.json'} describes (was it edited, or the step "
                         "copied from another run?); nothing was changed. Restore the run's "
                         "own config.json, or move that step out of checkpoints/") from None
    if found.damaged or found.incomplete:
        moved = ckpt.set_aside(directory, found.damaged)
        if announce is not None:
            announce(ckpt.fallback_words(found, moved))
    if read is not None:
        read(f"read the parameters of step {found.step} (the newest intact checkpoint in "
             f"{directory})")
    return cfg, found.value


def _read_params_dir(folder: Path, like: Any, *, what: str) -> Any:
    """params/ of a dropless directory, verified against its hashes.json (when it has one: a
    folder written before the hashes were recorded has none) and converted to `like`'s layout.
    Raises ValueError for files that cannot be read, arrays whose bytes differ, or arrays of
    another shape or dtype than config.json describes."""
    from dropless import checkpoint as ckpt
    from dropless.checkpoint import integrity
    again = "write it again with `dropless convert` from its source"
    expected = None
    if (folder / HASHES).exists():
        rec = read_json_object(folder / HASHES, what=what)
        expected = rec.get("hashes") if isinstance(rec, dict) else None
        if not (isinstance(expected, dict) and all(isinstance(v, str) for v in expected.values())):
            raise ValueError(f"{what}: {folder / HASHES} is not an object of array hashes; {again}")

    def verify(params):
        bad = integrity.mismatches(params, expected)
        if bad:
            raise _Damaged(f"{what}: {folder / 'params'} is damaged: "
                           f"{integrity.mismatch_words(bad)}; {again}")
    try:
        return ckpt.read_saved_tree(folder / "params", like, check=verify)
    except ckpt.DoesNotFit as e:
        raise ValueError(f"{what}: {e}; the model asked for is the one "
                         f"{folder / 'config.json'} describes (was it edited?); restore the "
                         f"config.json written with it, or {again}") from None
    except _Damaged as e:
        raise ValueError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - tensorstore's errors: the file and why, one line
        from dropless.checkpoint import noise
        noise.drop_late_callbacks()
        why = integrity.read_failure(e, 0, folder).detail.split(" cannot be read ", 1)[-1]
        raise ValueError(f"{what}: {folder / 'params'} cannot be read {why}; {again}") from None


class _Damaged(Exception):
    """params/ whose bytes differ from hashes.json (the words are the message)."""


def cast_like(params: Any, cfg) -> Any:
    """`params` cast leaf by leaf to the dtypes `init_params(cfg)` gives (cfg a ModelConfig)."""
    import jax
    import jax.numpy as jnp
    from dropless.models.decoder import init_params
    like = jax.eval_shape(lambda k: init_params(k, cfg), jax.random.key(0))
    return jax.tree.map(lambda x, l: jnp.asarray(x, l.dtype), params, like)


def tokenizer_files(tok: str) -> list[Path]:
    """tokenizer.json and its side files when `tok` names one ('byte' and '' name none)."""
    from dropless.data.tokenizer import side_files
    return side_files(tok) if tok not in ("byte", "") and Path(tok).is_file() else []


def write_dropless(dst: str | Path, model, params: Any, *, tokenizer: str = "",
                   sources: tuple = (), overwrite: bool = False,
                   extra_files: tuple[Path, ...] = (),
                   kept_config: dict[str, Any] | None = None) -> Path:
    """Write the dropless directory DST: params/ (orbax), the tokenizer's files (when
    `tokenizer` names a tokenizer.json), `extra_files` not among them (by name), `kept_config`
    (a source config.json's keys for the way back, `model_dir.kept_config`) when given, and
    config.json (a TrainConfig holding `model`, naming DST's copy of the tokenizer, or none).
    Written beside DST and moved into place when complete (`hf.destination`: a non-empty DST
    needs `overwrite`; `sources` may not be DST); config.json is written last, so a folder left
    by a killed write holds none and nothing loads it. Returns DST (absolute)."""
    import orbax.checkpoint as ocp
    from dropless.checkpoint import CheckpointError, integrity, noise
    from dropless.config import TrainConfig
    from dropless.hf.destination import check_destination, claimed, out_of_space, staged
    from dropless.runtime import files
    with claimed(dst):
        out = check_destination(dst, sources=sources, overwrite=overwrite)
        with staged(out) as tmp:
            with noise.held() as hook:   # a failed write: raised once, orbax's logs dropped
                try:
                    ckptr = ocp.StandardCheckpointer()
                    ckptr.save(tmp / "params", params, force=True)
                    ckptr.wait_until_finished()
                except Exception as e:
                    hook.drop()
                    if out_of_space(e):   # CheckpointError: the command ends without waiting
                        raise CheckpointError(   # for orbax's threads (cli.main)
                            f"no space left on the device writing {out} (nothing was left "
                            "half-written; free space there, or write elsewhere)") from None
                    raise
            files.write_text(tmp / HASHES, json.dumps(
                {"hash": integrity.ALGORITHM, "hashes": integrity.tree_hashes(params)}))
            for f in _by_name(tokenizer_files(tokenizer), extra_files):
                shutil.copyfile(f, tmp / f.name)
            if kept_config is not None:
                files.write_text(tmp / KEPT_FILE, json.dumps(kept_config, indent=2))
            tcfg = TrainConfig(model=model,
                               tokenizer=str(out / "tokenizer.json") if tokenizer else "")
            files.write_text(tmp / "config.json", json.dumps(to_dict(tcfg), indent=2))
    return out


def hf_to_dropless(src: str, dst: str, *, dtype: str | None = None,
                   overwrite: bool = False) -> Path:
    """Write DST/config.json + DST/params from the Hugging Face folder SRC (hf:DIR or DIR);
    returns DST. A folder without tokenizer.json gives a DST that names no tokenizer (eval /
    train then ask for one); one with only a SentencePiece tokenizer.model is refused (the
    message says how to write tokenizer.json)."""
    from dropless.hf.destination import claimed
    folder = parse_spec(src).folder
    with claimed(dst):
        return _hf_to_dropless(src, folder, dst, dtype=dtype, overwrite=overwrite)


def _hf_to_dropless(src: str, folder: Path, dst: str, *, dtype: str | None,
                    overwrite: bool) -> Path:
    from dropless import hf
    from dropless.data import tokenizer as tok_lib
    from dropless.hf.destination import check_destination
    from dropless.model_dir.folder import hf_tokenizer
    check_destination(dst, sources=(folder,), overwrite=overwrite)
    dtype = _model_dtype(dtype, f"dropless convert {src}")
    tok = str(folder / "tokenizer.json") if (folder / "tokenizer.json").is_file() else ""
    if not tok and (folder / "tokenizer.model").is_file():
        hf_tokenizer(folder, override="")   # raises with the how-to
    cfg, params = hf.load(folder, dtype=dtype)
    if tok:
        tok_lib.check_fits(tok_lib.make_tokenizer(tok), cfg.vocab_size,
                           what=f"dropless convert {src}")
    return write_dropless(dst, cfg, params, tokenizer=tok, sources=(folder,),
                          overwrite=overwrite, extra_files=_generation_config(folder),
                          kept_config=kept_of_hf_folder(folder))


def dropless_to_hf(src: str, dst: str, *, shard_size: int = 4 * 2**30,
                   overwrite: bool = False, dtype: str | None = None,
                   announce: Callable[[str], Any] | None = None) -> Path:
    """Write the Hugging Face folder DST from a dropless directory SRC (cast to `dtype` if
    given; a run's newest intact checkpoint, the fall-back given to `announce`); returns DST.
    config.json holds the model's keys, the source's kept ones and the folder's fallbacks
    (`model_dir.kept_config`); `announce` also gets a line for each kept key the model
    overrides, one for each model setting the architecture's config.json cannot carry
    (`hf.save`'s notes, such as Mixtral's `moe.seq_aux_coef`; without `announce` they are
    `hf.NotCarriedWarning`s), and one when a converted folder keeps none. A KEPT_FILE
    that is not a JSON object (or a generation_config.json that is not JSON) is refused
    (ValueError) before the weights are read, and nothing is written. DST is held exclusively
    for the whole conversion (`hf.destination.claimed`)."""
    from dropless import hf
    from dropless.hf.destination import check_destination, claimed
    from dropless.hf.round_trip import overridden
    say = announce or (lambda line: None)
    what = f"dropless convert {src}"
    folder = parse_spec(src).folder
    with claimed(dst):
        out = check_destination(dst, sources=(src,), overwrite=overwrite)
        saved = read_dropless_config(folder, what=what)
        kept, kept_from = origin_keys(folder, saved, what=what, announce=say)
        if kept is None and not is_run(folder):
            say(f"{what}: {folder / KEPT_FILE} is absent (converted by an older dropless, or "
                "not from a Hugging Face folder): config.json gets the defaults (docs/hf.md), "
                "not the source's context length and other keys; convert the Hugging Face "
                "folder again to keep them")
        tok = folder_tokenizer(src)
        fallback = fallback_keys(folder, saved, kept, tokenizer=tok, what=what)
        cfg, params = load_model(src, dtype=dtype, what=what, announce=announce)
        for line in override_words(kept_from, overridden(cfg, kept or {})):
            say(line)
        extra = _by_name(tokenizer_files(tok), _generation_config(folder))
        hf.save(cfg, params, out, max_shard_bytes=shard_size, overwrite=overwrite,
                extra_files=tuple(extra), kept_config=kept, fallback_config=fallback,
                announce=None if announce is None else lambda line: say(f"{what}: {line}"))
    return out


def _generation_config(folder: Path) -> tuple[Path, ...]:
    """The model folder's generation_config.json (its stop ids and sampling defaults: the
    model's, so it travels with the weights where no tokenizer.json does), if it has one."""
    p = Path(folder) / "generation_config.json"
    return (p,) if p.is_file() else ()


def _by_name(first, then) -> list[Path]:
    """`first`, then those of `then` whose file name is not among them."""
    names = {p.name for p in first}
    return [*first, *(p for p in then if p.name not in names)]
