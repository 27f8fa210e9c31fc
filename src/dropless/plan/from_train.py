"""The planner's view of a training run: `dropless plan` settings are the trainer's (dotted keys,
YAML, MaxText names through `dropless.compat.maxtext`, all read by `dropless.config_file`) plus
a few planner-only settings; `build_plan` turns them into the `PlanConfig` of the resulting
`TrainConfig`, the hardware profile and the model's name.

One behaviour for both commands: a value the trainer refuses (e.g. MaxText
`remat_policy=custom`) is refused by the planner, and one the trainer accepts
(`remat_policy=save_qkv_proj` -> minimal) is planned as it would be trained. Flat names the
planner does not take (`moe_d_ff`, `per_device_batch`, `fsdp`, ...) are refused with the
dotted key to use (`moved_key`, docs/planning.md).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable, NamedTuple

from dropless.config import ModelConfig, TrainConfig, scalar_fields, scalar_type_error
from dropless.machine import HardwareProfile, get_profile
from dropless.plan.layout import PlanConfig, check_node_size, mesh_on_devices

# What `dropless plan` plans when nothing says otherwise (the trainer's own defaults are a CPU
# run of the tiny preset); a --config file, flags and key=value come after these and win. A
# preset trained with run settings of its own (`presets.RUN_SETTINGS`, which `dropless train`
# applies) is planned at those instead (`train_config`).
PLAN_DEFAULTS = (("preset", "deepseek3-671b"), ("per_device_batch_size", 1), ("seq_len", 4096),
                 ("remat", "full"))
# Settings no TrainConfig carries: the hardware profile, the device count (`mesh_on_devices`)
# and the PlanConfig fields of the planner's own.
PLANNER_KEYS = ("hardware", "gpus", "offload", "dedup", "overlap", "optimizer_dtype",
                "master_weights", "devices_per_node", "gmm_tile", "attention_impl")
# The trainer's keys of the mesh axis sizes, by the planner's flag names.
MESH_KEYS = {"data": "mesh.data", "fsdp": "mesh.fsdp", "ep": "mesh.expert"}


def _moved() -> dict[str, str]:
    """Flat names the planner refuses -> the trainer's key to use instead."""
    out = {**MESH_KEYS, "per_device_batch": "per_device_batch_size",
           "gmm_quantization": "model.moe.gmm_quantization",
           "dispatcher": "model.moe.dispatcher", "activation_dtype": "model.dtype",
           "top_k": "model.moe.top_k", "moe_d_ff": "model.moe.d_ff",
           "num_shared_experts": "model.moe.num_shared_experts",
           "n_groups": "model.moe.n_groups", "topk_groups": "model.moe.topk_groups"}
    out.update({f.name: f"model.{f.name}" for f in dataclasses.fields(ModelConfig)
                if f.name != "moe"})
    return out


def moved_key(key: str, value: Any) -> str | None:
    """The trainer's key to use for the refused flat name `key`, or None when `key` is not one
    (or is also a key of ours or MaxText's: `vocab_size`, `seq_len`, `data` as a data path)."""
    from dropless.compat import maxtext
    from dropless.config_file import known_keys
    if key == "data" and isinstance(value, int) and not isinstance(value, bool):
        return MESH_KEYS["data"]   # the data-parallel size, not TrainConfig.data (a path)
    new = _moved().get(key)
    if new is None or key in known_keys() or maxtext.is_known(key):
        return None
    return new


def _is_profile(value: Any) -> bool:
    from dropless.compat.maxtext import HARDWARE
    return isinstance(value, str) and value not in HARDWARE   # MaxText's hardware: run mode


def split_settings(pairs: Iterable[tuple[str, Any]]) -> tuple[dict[str, Any], list]:
    """(planner knobs, the trainer's (key, value) pairs) from settings in the user's order.
    Raises ValueError for a refused flat name, naming the key to use, and for a planner knob
    of the wrong type."""
    planner: dict[str, Any] = {}
    train: list[tuple[str, Any]] = []
    kinds = {**scalar_fields(PlanConfig), "gpus": (int, False)}
    for key, value in pairs:
        if key == "hardware" and not _is_profile(value):
            train.append((key, value))           # MaxText hardware: cpu / gpu_multiprocess ...
        elif key in PLANNER_KEYS:
            if key in kinds:
                why = scalar_type_error(value, *kinds[key])
                if why:
                    raise ValueError(f"planner key {key!r}: {value!r} {why}")
            planner[key] = value
        elif (new := moved_key(key, value)) is not None:
            raise ValueError(f"{key}={value!r}: the planner's name {key!r} moved; use {new} "
                             "(the trainer's key, docs/planning.md)")
        else:
            train.append((key, value))
    if "offload" in planner:
        planner["offload"] = _offload(planner["offload"])
    return planner, train


def _offload(value: Any) -> tuple[str, ...]:
    """'query,value' / [query, value] / 'none' -> the tuple PlanConfig takes. Raises ValueError
    naming the key for a value that is neither a string nor a list."""
    if value is not None and not isinstance(value, (str, list, tuple)):
        raise ValueError(f"planner key 'offload': {value!r} must be a comma-separated string or "
                         "a list of query, key, value (or 'none')")
    items = value.split(",") if isinstance(value, str) else list(value or ())
    return tuple(str(v).strip() for v in items if str(v).strip() not in ("", "none"))


def train_config(pairs: Iterable[tuple[str, Any]], *, mapping: dict | None = None,
                 notes: list[str] | None = None,
                 from_preset: list[tuple[str, Any]] | None = None) -> TrainConfig:
    """The TrainConfig `dropless train` would build from `mapping` (a loaded --config file)
    and `pairs`, over the planner's defaults (`PLAN_DEFAULTS`) less the keys the preset's run
    settings (`presets.RUN_SETTINGS`) set: the preset is planned as it is trained, and a setting
    given still wins. `from_preset`, when given, receives the preset's run settings the result
    took from the preset ((key, value) pairs): those no file key or setting gave, in whatever
    spelling (one given equal to the preset's value is the user's)."""
    from dropless.config_file import build_config, flatten, resolve
    from dropless.presets import RUN_SETTINGS
    pairs, said = list(pairs), []
    run = build_config(pairs, mapping=mapping, defaults=PLAN_DEFAULTS, notes=said)
    own = RUN_SETTINGS.get(run.preset, {})
    if own:
        said = []
        run = build_config(pairs, mapping=mapping, notes=said,
                           defaults=[(k, v) for k, v in PLAN_DEFAULTS if k not in own])
        if from_preset is not None:
            given = {k for k, _ in resolve(flatten(mapping or {}), pairs)}
            from_preset += [(k, v) for k, v in own.items() if k not in given]
    if notes is not None:
        notes += said
    return run


def preset_note(preset: str, settings: list[tuple[str, Any]]) -> str:
    """The line `dropless plan` prints for the preset's run settings it planned at."""
    return (f"from preset {preset}'s run settings (as dropless train): "
            + ", ".join(f"{k}={v}" for k, v in settings) + " (a flag or key given wins)")


class PlannedRun(NamedTuple):
    """What `dropless plan` plans: the plan, the hardware profile and the model's name."""

    plan: PlanConfig
    hardware: HardwareProfile
    name: str


def read_config_file(path: str | None) -> tuple[list[tuple[str, Any]], dict[str, Any]]:
    """A --config YAML file's (flat settings in file order, nested mappings); nothing for no
    path. Raises ValueError naming the file when it is not a mapping (and config_file's
    file:line:col errors)."""
    if not path:
        return [], {}
    from dropless.config_file import load_yaml   # one YAML reader: file:line:col, no dup keys
    data = load_yaml(path) or {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path!r} must hold a mapping of settings")
    flat = [(str(k), v) for k, v in data.items() if not isinstance(v, dict)]   # as flatten
    return flat, {k: v for k, v in data.items() if isinstance(v, dict)}


def model_name(run: TrainConfig) -> str:
    """The run's preset, marked "(modified)" when its model's parameter counts are not the
    preset's."""
    from dropless.models.arithmetic import param_counts
    from dropless.presets import get_preset
    if param_counts(run.model) != param_counts(get_preset(run.preset)):
        return f"{run.preset} (modified)"
    return run.preset


def build_plan(settings: Iterable[tuple[str, Any]] = (), *, config_path: str | None = None,
               notes: list[str] | None = None) -> PlannedRun:
    """What `dropless plan` plans from the planner's defaults, the --config file at
    `config_path` and `settings` ((key, value) pairs in the user's order, after the file's),
    read as `dropless train` reads them (into a TrainConfig, `train_config`) plus the planner's
    own settings (`PLANNER_KEYS`: `hardware` picks the profile, default h200; `gpus` resizes the
    mesh, `mesh_on_devices`). A preset with run settings (`presets.RUN_SETTINGS`) is planned at
    them where nothing given overrides them (`train_config`); `notes`, when given, receives a
    line naming those (`preset_note`). Raises ValueError naming the bad file, key or value, and
    for a `devices_per_node` that contradicts the device count (`check_node_size`)."""
    flat, nested = read_config_file(config_path)
    in_file, from_file = split_settings(flat)
    planner, pairs = split_settings(settings)
    planner = {**in_file, **planner}
    used: list[tuple[str, Any]] = []
    # the file's settings stay one source (`config_file.resolve`): the flags and key=value
    # after it win over it, and within each two spellings of one key must agree
    run = train_config(pairs, mapping={**dict(from_file), **nested}, from_preset=used)
    if used and notes is not None:
        notes.append(preset_note(run.preset, used))
    hw = get_profile(planner.pop("hardware", "h200"))
    if "gpus" in planner:
        run = run.replace(mesh=mesh_on_devices(run.mesh, planner.pop("gpus")))
    cfg = PlanConfig(run=run, **planner)
    check_node_size(cfg)
    return PlannedRun(cfg, hw, model_name(run))
