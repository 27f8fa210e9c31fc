"""Settings from a YAML file and `key=value` overrides: our field names or MaxText's.

Precedence (later wins): defaults < --config file < command-line flags < key=value overrides.
An unknown key is an error naming it and the closest known one.
"""
from __future__ import annotations

import dataclasses
import difflib
from typing import Any

from dropless.config import ModelConfig, MoEConfig
from dropless.plan.layout import PlanConfig
from dropless.plan.shape import MOE_KEYS, model_config

# MaxText flag -> (target, our field). "plan" = PlanConfig, "model" = a ModelConfig field or a
# flat MoE name of shape.MOE_KEYS.
MAXTEXT_KEYS = {
    "per_device_batch_size": ("plan", "per_device_batch"),
    "max_target_length": ("plan", "seq_len"),
    "ragged_buffer_factor": ("plan", "ragged_buffer_factor"),
    "remat_policy": ("plan", "remat"),
    "weight_dtype": ("plan", "weight_dtype"),
    "dtype": ("plan", "activation_dtype"),
    "ici_fsdp_parallelism": ("plan", "fsdp"),
    "dcn_fsdp_parallelism": ("plan", "fsdp"),
    "ici_expert_parallelism": ("plan", "ep"),
    "dcn_expert_parallelism": ("plan", "ep"),
    "ici_data_parallelism": ("plan", "data"),
    "dcn_data_parallelism": ("plan", "data"),
    "num_experts": ("model", "num_experts"),
    "num_experts_per_tok": ("model", "top_k"),
    "base_emb_dim": ("model", "d_model"),
    "base_num_decoder_layers": ("model", "num_layers"),
    "base_mlp_dim": ("model", "d_ff"),
    "base_moe_mlp_dim": ("model", "moe_d_ff"),
    "base_num_query_heads": ("model", "num_heads"),
    "base_num_kv_heads": ("model", "num_kv_heads"),
    "first_num_dense_layers": ("model", "first_k_dense"),
    "shared_experts": ("model", "num_shared_experts"),
    "n_routing_groups": ("model", "n_groups"),
    "topk_routing_group": ("model", "topk_groups"),
    "vocab_size": ("model", "vocab_size"),
    "q_lora_rank": ("model", "q_lora_rank"),
    "kv_lora_rank": ("model", "kv_lora_rank"),
    "qk_nope_head_dim": ("model", "qk_nope_head_dim"),
    "qk_rope_head_dim": ("model", "qk_rope_head_dim"),
    "v_head_dim": ("model", "v_head_dim"),
}
# MaxText / trainer keys with no bearing on the plan: accepted (a training recipe loads as is)
# and listed in the result's "ignored_keys"; see _ignored.
MAXTEXT_RENAMED = {"model_name": "preset", "te_gmm_quantization": "gmm_quantization"}
# MaxText values that mean something different from ours.
MAXTEXT_VALUES = {("remat", "minimal_offloaded"): "offload", ("remat", "qkv_proj_offloaded"):
                  "offload", ("remat", "custom"): "offload", ("remat", "save_dot_except_mlp"):
                  "minimal", ("gmm_quantization", "fp8"): "mxfp8", ("gmm_quantization", "bf16"):
                  "none"}
# Keys whose MaxText ici_*/dcn_* pairs multiply.
_MULTIPLY = {"fsdp", "ep", "data"}
# Fields set through the planner's own names beyond the dataclasses.
EXTRA_KEYS = ("preset", "hardware")


def _fields(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _convert(value: Any, like: Any, key: str) -> Any:
    if not isinstance(value, str):
        return value
    if isinstance(like, bool) or like is bool:
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{key}={value!r} must be true or false")
    for t in (int, float):
        if isinstance(like, t) or like is t:
            try:
                return t(value)
            except ValueError:
                raise ValueError(f"{key}={value!r} must be a {t.__name__}") from None
    if key == "offload":
        return tuple(v for v in value.split(",") if v and v != "none")
    return value


def _model_fields() -> dict[str, dataclasses.Field]:
    """Model settings by flat name: ModelConfig's fields and MoEConfig's under MOE_KEYS."""
    out = {k: f for k, f in _fields(ModelConfig).items() if k != "moe"}
    moe = _fields(MoEConfig)
    out.update({flat: moe[name] for flat, name in MOE_KEYS.items()})
    return out


def _undot(key: str) -> str:
    """The trainer's dotted spelling (model.d_model, model.moe.top_k) -> the flat name."""
    if key.startswith("model.moe."):
        name = key[len("model.moe."):]
        return {v: k for k, v in MOE_KEYS.items()}.get(name, key)
    return key[len("model."):] if key.startswith("model.") else key


def known_keys() -> list[str]:
    return sorted({*_fields(PlanConfig), *_model_fields(), *MAXTEXT_KEYS, *EXTRA_KEYS})


def parse_overrides(items: list[str]) -> dict[str, str]:
    """['a=1', 'b=x'] -> {'a': '1', 'b': 'x'}; an item without '=' is an error."""
    out = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like key=value")
        k, v = item.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def split_settings(settings: dict[str, Any]) -> tuple[dict, dict, dict]:
    """Route each setting to PlanConfig fields, model settings (ModelConfig fields, flat MoE
    names, or the trainer's dotted `model.*` keys) or extras (preset, hardware), translating
    MaxText names; ici_*/dcn_* parallelism of one axis multiply."""
    plan_f, model_f = _fields(PlanConfig), _model_fields()
    plan: dict[str, Any] = {}
    model: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in settings.items():
        key = MAXTEXT_RENAMED.get(key, key)
        if key == "gmm_quantization" and str(value).lower() in ("te_mxfp8", "mxfp8"):
            value = "mxfp8"
        if key == "hardware" and _is_run_mode(value):   # MaxText's hardware: gpu_multiprocess
            extra.setdefault("ignored_keys", []).append(key)
            continue
        key = _undot(key)
        if key in EXTRA_KEYS:
            extra[key] = value
            continue
        if key in MAXTEXT_KEYS:
            target, name = MAXTEXT_KEYS[key]
        elif key in plan_f:
            target, name = "plan", key
        elif key in model_f:
            target, name = "model", key
        elif _ignored(key):
            extra.setdefault("ignored_keys", []).append(key)
            continue
        else:
            close = difflib.get_close_matches(key, known_keys(), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"unknown setting {key!r}{hint}")
        value = MAXTEXT_VALUES.get((name, value), value) if isinstance(value, str) else value
        fields = plan_f if target == "plan" else model_f
        f = fields[name]
        like = f.default if f.default is not dataclasses.MISSING else int   # required = ints
        value = _convert(value, "" if name == "offload" else like, name)
        dest = plan if target == "plan" else model
        if name in _MULTIPLY and key in MAXTEXT_KEYS and name in dest:
            dest[name] = dest[name] * value
        else:
            dest[name] = value
    if any(k.startswith("dcn_") and str(v) not in ("1", "-1") for k, v in settings.items()
           if k in MAXTEXT_KEYS) and "devices_per_node" not in plan:
        per_node = 1   # MaxText: a node (ICI domain) holds the ici_* part of every axis
        for k, v in settings.items():
            if k.startswith("ici_") and k in MAXTEXT_KEYS:
                per_node *= int(v)
        plan["devices_per_node"] = per_node
    return plan, model, extra


def _is_run_mode(value: Any) -> bool:
    from dropless.compat.maxtext import HARDWARE
    return value in HARDWARE


def _ignored(key: str) -> bool:
    """A key the trainer accepts (ours or MaxText's) that the planner has no use for."""
    from dropless.compat.maxtext import is_known
    from dropless.config_file import known_keys as train_keys
    return is_known(key) or key in train_keys()


def apply_model_overrides(model_cfg: ModelConfig, model: dict[str, Any]) -> ModelConfig:
    """`model_cfg` with the routed model settings applied (see shape.model_config)."""
    return model_config(model_cfg, **model) if model else model_cfg
