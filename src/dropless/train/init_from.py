"""Starting from existing weights: `init_from=hf:DIR` (a Hugging Face folder) or a dropless
directory (`dropless convert` output: config.json + params/, or a run directory: config.json +
checkpoints/). Also the model loader `dropless eval` / `generate` / `convert` share.

With `init_from`, the model config comes from that folder (unless a preset is named) and the
tokenizer from its `tokenizer.json` (unless `tokenizer` is set): a Hugging Face folder without
one is refused, never trained on bytes unless `tokenizer=byte` is given (`train.tokenizer`).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

HF_PREFIX = "hf:"


def is_hf(spec: str) -> bool:
    return spec.startswith(HF_PREFIX)


def folder_tokenizer(spec: str, *, override: str = "tokenizer=byte") -> str:
    """The tokenizer a model folder implies: an HF folder's tokenizer.json (refused when it has
    none, see `tokenizer.folder_tokenizer`; `override` says how to choose another), a dropless
    directory's tokenizer.json, else the tokenizer its config.json names."""
    from dropless.train import tokenizer as tok_lib
    folder = Path(spec[len(HF_PREFIX):] if is_hf(spec) else spec)
    if is_hf(spec):
        return tok_lib.folder_tokenizer(folder, override=override)
    if (folder / "tokenizer.json").is_file():
        return str(folder / "tokenizer.json")
    if (folder / "config.json").is_file():
        return json.loads((folder / "config.json").read_text()).get("tokenizer", "byte")
    return "byte"


def config_defaults(pairs: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """The (key, value) items `init_from` implies, placed before the user's: the folder's model
    (as the preset) and tokenizer. Called by `config_file.build_config`."""
    spec = next((v for k, v in reversed(pairs) if k == "init_from"), "")
    if not spec:
        return []
    keys = {k for k, _ in pairs}
    out: list[tuple[str, Any]] = []
    if "preset" not in keys:
        if is_hf(spec):
            out.append(("preset", spec))
        else:
            out += _dropless_model_items(Path(spec))
    if "tokenizer" not in keys:
        try:
            tok = folder_tokenizer(spec, override="tokenizer=byte")
        except ValueError as e:
            raise ValueError(f"init_from={spec!r}: {e}") from None
        if not tok:
            raise ValueError(f"init_from={spec!r}: the folder names no tokenizer (converted from "
                             "a Hugging Face folder without tokenizer.json); set tokenizer=byte "
                             "or tokenizer=PATH/tokenizer.json")
        out.append(("tokenizer", tok))
    return out


def _dropless_model_items(folder: Path) -> list[tuple[str, Any]]:
    from dropless.config_file import _flatten, upgrade
    saved = upgrade(_read_train_config(folder))
    return [("preset", saved.get("preset") or "tiny")] + _flatten({"model": saved["model"]})


def _read_train_config(folder: Path, what: str = "") -> dict:
    """A dropless directory's config.json; errors start with `what` (the command and argument
    the user gave: "init_from='DIR'", "dropless eval DIR")."""
    what = what or f"init_from={str(folder)!r}"
    hf_form = what.replace(str(folder), f"hf:{folder}") if str(folder) in what \
        else f"init_from=hf:{folder}"
    path = folder / "config.json"
    if not path.is_file():
        raise ValueError(f"{what}: no config.json in {folder} (want a Hugging Face folder "
                         f"as hf:DIR, or a `dropless convert` / run directory)")
    try:
        saved = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{what}: {path} is not valid JSON ({e})") from None
    if not isinstance(saved, dict) or "model" not in saved:
        raise ValueError(f"{what}: {folder} looks like a Hugging Face folder; write {hf_form}")
    return saved


def load_dropless(folder: str | Path, *, what: str = ""):
    """(TrainConfig, params) of a `dropless convert` output (params/) or a run (its newest
    checkpoint's parameters). Errors start with `what` (see `_read_train_config`)."""
    import jax
    import orbax.checkpoint as ocp
    from dropless.config_file import from_dict
    from dropless.train import step as step_lib
    folder = Path(folder).absolute()
    cfg = from_dict(_read_train_config(folder, what))
    if (folder / "params").is_dir():
        from dropless.models.deepseek import init_params
        like = jax.eval_shape(lambda k: init_params(k, cfg.model), jax.random.key(0))
        return cfg, ocp.StandardCheckpointer().restore(folder / "params", like)
    from dropless.train import checkpoint as ckpt
    step = ckpt.latest_step(folder / "checkpoints")
    if step is None:
        raise ValueError(f"{what or folder}: neither params/ nor a checkpoint under "
                         f"{folder / 'checkpoints'}")
    mngr = ckpt.manager(folder / "checkpoints", keep=1, async_save=False)
    like = jax.eval_shape(lambda: step_lib.init_state(cfg)[0])
    state, _ = ckpt.restore(mngr, step, like)
    mngr.close()
    return cfg, state["params"]


def load_model(spec: str, *, dtype: str | None = None, what: str = ""):
    """(ModelConfig, params) from "hf:DIR" or a dropless directory. `dtype` (both kinds) sets
    the model's dtype and weight_dtype and casts the parameters as training would hold them."""
    if is_hf(spec):
        from dropless import hf
        return hf.load(spec[len(HF_PREFIX):], dtype=dtype)
    tcfg, params = load_dropless(spec, what=what)
    cfg = tcfg.model
    if dtype is not None:
        import jax
        import jax.numpy as jnp
        from dropless.models.deepseek import init_params
        moe = cfg.moe and cfg.moe.replace(dtype=dtype, weight_dtype=dtype)
        cfg = cfg.replace(dtype=dtype, weight_dtype=dtype, moe=moe)
        like = jax.eval_shape(lambda k: init_params(k, cfg), jax.random.key(0))
        params = jax.tree.map(lambda x, l: jnp.asarray(x, l.dtype), params, like)
    return cfg, params


def _same_model(a, b) -> list[str]:
    """Fields that differ between two ModelConfigs in ways that change the parameter tree."""
    out = []
    for f in dataclasses.fields(a):
        if f.name in ("dtype", "weight_dtype", "mtp_loss_coef", "moe", "scan_layers"):
            continue
        if getattr(a, f.name) != getattr(b, f.name):
            out.append(f"model.{f.name}: {getattr(a, f.name)!r} != {getattr(b, f.name)!r}")
    if (a.moe is None) != (b.moe is None):
        out.append(f"model.moe: {a.moe!r} != {b.moe!r}")
    elif a.moe is not None:
        for name in ("num_experts", "d_ff", "num_shared_experts", "top_k", "score_func",
                     "n_groups", "topk_groups", "routed_scaling_factor", "norm_topk_prob"):
            if getattr(a.moe, name) != getattr(b.moe, name):
                out.append(f"model.moe.{name}: {getattr(a.moe, name)!r} != "
                           f"{getattr(b.moe, name)!r}")
    return out


def initial_params(cfg) -> Any:
    """The parameters `cfg.init_from` names, cast to cfg.model's weight dtype. Raises
    ValueError naming the fields where cfg.model differs from the folder's model."""
    import jax
    import jax.numpy as jnp
    spec = cfg.init_from
    if is_hf(spec):
        from dropless import hf
        src_cfg, params = hf.load(spec[len(HF_PREFIX):], mtp_depth=cfg.model.mtp_depth,
                                  dtype=cfg.model.weight_dtype)
    else:
        tcfg, params = load_dropless(spec)
        src_cfg = tcfg.model
    diff = _same_model(cfg.model, src_cfg)
    if diff:
        raise ValueError(f"init_from={spec!r}: the configured model differs from the folder's: "
                         + "; ".join(diff))
    from dropless.models.deepseek import init_params
    from dropless.models.scan import to_canonical_layout, to_config_layout
    params = to_config_layout(to_canonical_layout(params), cfg.model)
    like = jax.eval_shape(lambda k: init_params(k, cfg.model), jax.random.key(0))
    return jax.tree.map(lambda x, l: jnp.asarray(x, l.dtype), params, like)
