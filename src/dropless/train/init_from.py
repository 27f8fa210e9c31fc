"""Starting a run from existing weights: `init_from=hf:DIR` (a Hugging Face folder) or a
dropless directory (`dropless convert` output, or a run directory).

The folders themselves (the spec, config.json, the tokenizer a folder implies, the readers of
their weights) are `dropless.model_dir`'s; what `init_from` implies for the config (the
folder's model as the preset, its tokenizer) is applied by `config_file.build_config` through
`model_dir.init_from_defaults`. Here: check that the configured model is the folder's, hand
the loop its parameters in the configured layout and dtypes, and give a new run directory its
own copy of the Hugging Face config.json keys the start keeps (`keep_start_config`), which
`dropless convert RUN` writes back after the start folder is gone.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable

from dropless.config import INIT_FIELDS
from dropless.model_dir import cast_like, load_dropless, parse_spec
from dropless.model_dir.kept_config import KEPT_FILE, origin_keys
from dropless.runtime import files

# fields that do not change the parameter tree (dtypes are cast, the layout is converted; the
# init fields say only how random weights would start)
_FREE_FIELDS = ("dtype", "weight_dtype", "mtp_loss_coef", "moe", "scan_layers",
                "attention_kernel", "max_segments_per_seq", *INIT_FIELDS)
_MOE_SHAPE_FIELDS = ("num_experts", "d_ff", "num_shared_experts", "top_k", "score_func",
                     "n_groups", "topk_groups", "routed_scaling_factor", "norm_topk_prob")


def model_differences(a, b) -> list[str]:
    """The fields that differ between ModelConfigs `a` and `b` in ways that change the
    parameter tree, one "model.FIELD: A != B" line each ([] when the weights fit)."""
    out = []
    for f in dataclasses.fields(a):
        if f.name in _FREE_FIELDS:
            continue
        if getattr(a, f.name) != getattr(b, f.name):
            out.append(f"model.{f.name}: {getattr(a, f.name)!r} != {getattr(b, f.name)!r}")
    if (a.moe is None) != (b.moe is None):
        out.append(f"model.moe: {a.moe!r} != {b.moe!r}")
    elif a.moe is not None:
        for name in _MOE_SHAPE_FIELDS:
            if getattr(a.moe, name) != getattr(b.moe, name):
                out.append(f"model.moe.{name}: {getattr(a.moe, name)!r} != "
                           f"{getattr(b.moe, name)!r}")
    return out


def initial_params(cfg, *, announce: Callable[[str], Any] | None = None) -> Any:
    """The parameters `cfg.init_from` names (a run: its newest intact checkpoint, a fall-back
    announced in one line to `announce`), cast to cfg.model's weight dtype. Raises
    ValueError naming the fields where cfg.model differs from the folder's model."""
    spec = parse_spec(cfg.init_from)
    if spec.hf:
        from dropless import hf
        src_cfg, params = hf.load(spec.folder, mtp_depth=cfg.model.mtp_depth,
                                  dtype=cfg.model.weight_dtype)
    else:
        said = None if announce is None else (
            lambda words: announce(f"  init_from={cfg.init_from!r}: {words}"))
        tcfg, params = load_dropless(spec.folder, what=f"init_from={cfg.init_from!r}",
                                     announce=announce, read=said)
        src_cfg = tcfg.model
    diff = model_differences(cfg.model, src_cfg)
    if diff:
        raise ValueError(f"init_from={cfg.init_from!r}: the configured model differs from the "
                         "folder's: " + "; ".join(diff))
    from dropless.models.scan import to_canonical_layout, to_config_layout
    params = to_config_layout(to_canonical_layout(params), cfg.model)
    return cast_like(params, cfg.model)


def keep_start_config(cfg, run_path: Path) -> bool:
    """Write RUN/hf_kept_config.json (atomically): the Hugging Face config.json keys that go
    with the model `cfg.init_from` names (an HF folder's config.json, a convert output's
    hf_kept_config.json, or a run's, followed through the runs it started from:
    `model_dir.kept_config.origin_keys`). Nothing for a run from scratch, or a start that keeps
    none or cannot be read now (the export says so). Returns whether it wrote. Raises
    ValueError naming init_from for a kept file that is not a JSON object."""
    if not cfg.init_from:
        return False
    kept, _ = origin_keys(run_path, {"init_from": cfg.init_from},
                          what=f"init_from={cfg.init_from!r}")
    if kept is None:
        return False
    files.write_text(Path(run_path) / KEPT_FILE, json.dumps(kept, indent=2))
    return True
