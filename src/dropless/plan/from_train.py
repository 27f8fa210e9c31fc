"""The planner's view of a training run: `dropless plan` settings are the trainer's (dotted keys,
YAML, MaxText names through `dropless.compat.maxtext`, all read by `dropless.config_file`) plus
a few planner-only knobs; `plan_config` turns the resulting `TrainConfig` into a `PlanConfig`.

One behaviour for both commands: a value the trainer refuses (e.g. MaxText
`remat_policy=custom`) is refused by the planner, and one the trainer accepts
(`remat_policy=save_qkv_proj` -> minimal) is planned as it would be trained. The planner's old
flat names (`moe_d_ff`, `per_device_batch`, `fsdp`, ...) are refused with the dotted key to use
(`MOVED`, docs/planning.md).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable

from dropless.config import ModelConfig, MoEConfig, TrainConfig, scalar_fields, scalar_type_error
from dropless.plan.layout import PlanConfig

# What `dropless plan` plans when nothing says otherwise (the trainer's own defaults are a CPU
# run of the tiny preset); a --config file, flags and key=value come after these and win.
PLAN_DEFAULTS = (("preset", "deepseek3-671b"), ("per_device_batch_size", 1), ("seq_len", 4096),
                 ("remat", "full"))
# PlanConfig fields no TrainConfig carries (hardware choice and the planner's own knobs).
PLANNER_KEYS = ("hardware", "gpus", "offload", "dedup", "overlap", "optimizer_dtype",
                "master_weights", "devices_per_node", "gmm_tile", "shard_non_expert_over_ep",
                "attention_impl")
# The trainer's keys of the mesh axis sizes (the one place that names them here).
MESH_KEYS = {"data": "mesh.data", "fsdp": "mesh.fsdp", "ep": "mesh.expert"}
# The trainer's dispatcher -> the planner's model of it: "auto" is ragged_a2a on GPUs; "local"
# (no expert axis) moves nothing, so any model will do; node_a2a's two hops are planned as a2a
# (static per-peer chunks, one hop).
PLANNED_DISPATCHER = {"auto": "ragged_a2a", "local": "ragged_a2a", "a2a": "a2a",
                      "ragged_a2a": "ragged_a2a", "allgather": "allgather", "node_a2a": "a2a"}


def _moved() -> dict[str, str]:
    """The planner's former flat names -> the trainer's key to use instead."""
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
    """The key to use for the planner's former flat name `key`, or None when `key` is not one
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
    Raises ValueError for a former planner name, naming the key to use, and for a planner knob
    of the wrong type."""
    planner: dict[str, Any] = {}
    train: list[tuple[str, Any]] = []
    kinds = scalar_fields(PlanConfig)
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
    """'query,value' / [query, value] / 'none' -> the tuple PlanConfig takes."""
    items = value.split(",") if isinstance(value, str) else list(value or ())
    return tuple(str(v).strip() for v in items if str(v).strip() not in ("", "none"))


def train_config(pairs: Iterable[tuple[str, Any]], *, mapping: dict | None = None,
                 notes: list[str] | None = None) -> TrainConfig:
    """The TrainConfig `dropless train` would build from `mapping` (a loaded --config file)
    and `pairs`, over the planner's defaults (`PLAN_DEFAULTS`)."""
    from dropless.config_file import build_config
    return build_config(list(pairs), mapping=mapping, defaults=PLAN_DEFAULTS, notes=notes)


def plan_config(cfg: TrainConfig, *, gpus: int | None = None, **planner: Any) -> PlanConfig:
    """The PlanConfig of `cfg`: mesh, per-device batch, sequence, remat, the MoE layer's
    quantization, dispatcher and buffer factor, the model's dtypes; `planner` sets the
    planner-only fields (`PLANNER_KEYS`) or overrides a derived one. With `gpus` other than the
    mesh's device count and a data axis of 1, the data axis fills the rest (gpus / fsdp x ep),
    as `--gpus 256 --fsdp 16` always did."""
    mesh = cfg.mesh   # the trainer's mesh (config.MeshConfig)
    moe: MoEConfig | None = cfg.model.moe
    dispatcher = PLANNED_DISPATCHER[moe.dispatcher] if moe is not None else "ragged_a2a"
    data = mesh.data
    if gpus is None:
        gpus = mesh.num_devices
    elif gpus != mesh.num_devices and data == 1:
        data = 0
    fields = dict(
        gpus=gpus, fsdp=mesh.fsdp, ep=mesh.expert, data=data,
        per_device_batch=cfg.per_device_batch_size, seq_len=cfg.seq_len, remat=cfg.remat,
        gmm_quantization=moe.gmm_quantization if moe is not None else "none",
        dispatcher=dispatcher,
        ragged_buffer_factor=moe.ragged_buffer_factor if moe is not None else 2.0,
        weight_dtype=cfg.model.weight_dtype, activation_dtype=cfg.model.dtype,
        devices_per_node=mesh.devices_per_node if mesh.num_nodes > 1 else 0)
    fields.update(planner)
    return PlanConfig(**fields)
