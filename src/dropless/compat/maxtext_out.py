"""A TrainConfig's model, its dtypes, sequence, batch, remat policy, steps, learning-rate
schedule, optimizer and mesh said in MaxText's flags: the other direction of the MaxText edge
(`compat.maxtext`), read from the same tables (`RENAMES`, `REMAT`, `ATTENTION_KERNELS`) and
undoing the same rules (attention_type, routing groups, capacity, the grouped-matmul backend,
the warmup fraction, the mesh's ici x dcn), so that what it writes translates back, through
`config_file.build_config`, to the config it came from (tests/compat/test_maxtext_out.py).

`items(cfg)` gives the (MaxText name, value) pairs in the order of `NAMES`; `to_yaml(cfg,
title, command)` the YAML file (examples/deepseek3_1gpu_maxtext.yml is one). Every name written
is one MaxText's `configs/base.yml` declares. A setting MaxText cannot say (the capacity
baseline, a grouped-matmul backend it lacks) raises ValueError naming our key and value. The
settings the flags leave out (those with no MaxText flag, such as the sequence-wise aux loss,
a schedule MaxText's cannot match, and the run's data and outputs) are listed at the top of the
file (`left_out`), each one whose value is not what the file gives back. A flag written that
MaxText reads otherwise (adam_weight_decay above 0: MaxText decays every parameter, we decay
matrices only) is said in one comment line above the flags (`differences`). `dropless config
show --maxtext` writes the file and names both on stderr.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from dropless.compat import maxtext
from dropless.compat.maxtext import ATTENTION_KERNELS, REMAT, RENAMES
from dropless.config import MESH_AXES, TrainConfig

# the RENAMES names written, in the order of MaxText's model configs (configs/models/*.yml)
MODEL_NAMES = (
    "base_emb_dim", "base_num_query_heads", "base_mlp_dim", "base_moe_mlp_dim",
    "base_num_decoder_layers", "first_num_dense_layers", "vocab_size", "logits_via_embedding",
    "normalization_layer_epsilon", "num_experts", "num_experts_per_tok", "shared_experts",
    "routed_scaling_factor", "routed_score_func", "routed_bias_update_rate", "norm_topk_prob",
    "load_balance_loss_weight", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
    "qk_rope_head_dim", "v_head_dim", "rope_max_timescale", "mtp_num_layers",
    "mtp_loss_scaling_factor", "scan_layers", "dtype", "weight_dtype")
RUN_NAMES = ("per_device_batch_size", "gradient_accumulation_steps", "max_target_length",
             "num_vocab_tiling")
# the optimizer's RENAMES names, in base.yml's order: the same optax AdamW after a global-norm
# clip in both trainers (MaxText's src/maxtext/optimizers/optimizers.py get_optimizer and
# trainers/pre_train/train.py at e591f30), adam_eps_root left at base.yml's 0, optax's and ours;
# what the decay applies to differs (`differences`)
OPTIMIZER_NAMES = ("gradient_clipping_threshold", "adam_b1", "adam_b2", "adam_eps",
                   "adam_weight_decay")
# names MaxText's base.yml declares as integers where our field is a float (rope_max_timescale:
# 10_000); MaxText parses a value by its base.yml default's type
INT_NAMES = ("rope_max_timescale",)
MOE_NAMES = ("base_moe_mlp_dim", "num_experts", "num_experts_per_tok", "shared_experts",
             "routed_scaling_factor", "routed_score_func", "routed_bias_update_rate",
             "norm_topk_prob", "load_balance_loss_weight")


def _get(cfg: TrainConfig, key: str) -> Any:
    """The value at dotted `key` ("model.moe.top_k")."""
    out: Any = cfg
    for part in key.split("."):
        out = getattr(out, part)
    return out


def _renamed(cfg: TrainConfig, name: str) -> Any:
    """The value MaxText's `name` copies into our keys; ValueError when those keys differ
    (e.g. dtype: model.dtype and model.moe.dtype), which one MaxText flag cannot say."""
    keys = RENAMES[name]
    values = [_get(cfg, k) for k in keys]
    if any(v != values[0] for v in values):
        said = ", ".join(f"{k}={v!r}" for k, v in zip(keys, values))
        raise ValueError(f"MaxText {name} sets {', '.join(keys)} alike; this config has {said}")
    return values[0]


def _int_valued(name: str, v: Any) -> Any:
    """`v` as MaxText's `name` takes it: an int where its base.yml declares an int
    (`INT_NAMES`), whose values it parses as int; ValueError for a fraction there."""
    if name not in INT_NAMES or isinstance(v, int):
        return v
    if not float(v).is_integer():
        raise ValueError(f"MaxText {name} is an integer; this config has {RENAMES[name][0]}={v!r}")
    return int(v)


def _remat(policy: str) -> str:
    """MaxText's remat_policy for ours: the same name where MaxText has it, else the first that
    translates to it."""
    names = [n for n, ours in REMAT.items() if ours == policy]
    if not names:
        raise ValueError(f"remat={policy!r} has no MaxText remat_policy")
    return policy if policy in names else names[0]


def _attention(cfg: TrainConfig) -> list[tuple[str, Any]]:
    """attention_type, attention (the kernel), decoder_block and the head counts MaxText needs:
    MLA is MaxText's `attention_type: mla` in its DeepSeek decoder, with as many key/value heads
    as query heads (its configs/models/deepseek3-*.yml); MHA is `global` with GQA's kv heads
    and head_dim."""
    m = cfg.model
    kernel = [("attention", _kernel(m.attention_kernel))]
    if m.attention_kernel == "cudnn_thd":   # Transformer Engine's segments: MaxText's bound
        kernel.append(("max_segments_per_seq", m.max_segments_per_seq))
    if m.attention == "mla":
        return [("attention_type", "mla"), *kernel, ("decoder_block", "deepseek"),
                ("base_num_kv_heads", m.num_heads)]
    return [("attention_type", "global"), *kernel,
            ("base_num_kv_heads", m.num_kv_heads or m.num_heads),
            ("head_dim", m.head_dim or m.d_model // m.num_heads)]


def _kernel(ours: str) -> str:
    """MaxText's attention for our attention_kernel: the first name that translates to it
    (cudnn: cudnn_flash_te, MaxText's GPU flash attention; cudnn_thd: cudnn_flash_te too, which
    takes packed rows as cuDNN's segments with max_segments_per_seq as cudnn_thd does)."""
    ours = "cudnn" if ours == "cudnn_thd" else ours
    return next(n for n, k in ATTENTION_KERNELS.items() if k == ours)


def _moe(cfg: TrainConfig) -> list[tuple[str, Any]]:
    """The routing and grouped-matmul flags whose translation has a rule: the bias (on when it
    is updated), the groups (-1: none), the dropless path (sparse_matmul, capacity -1) and the
    kernel (megablox false: MaxText's ragged_dot path, which `auto` is on its platforms;
    tokamax: use_tokamax_gmm)."""
    moe = cfg.model.moe
    if moe.capacity_factor is not None:
        raise ValueError(f"model.moe.capacity_factor={moe.capacity_factor} (the token-dropping "
                         "baseline) is not written: this writes dropless configs")
    if moe.gmm_backend not in ("auto", "tokamax"):
        raise ValueError(f"model.moe.gmm_backend={moe.gmm_backend!r} has no MaxText flag "
                         "(auto: megablox false; tokamax: use_tokamax_gmm true)")
    grouped = moe.n_groups > 1
    return [("routed_bias", moe.bias_update_speed > 0),
            ("n_routing_groups", moe.n_groups if grouped else -1),
            ("topk_routing_group", moe.topk_groups if grouped else -1),
            ("sparse_matmul", True), ("capacity_factor", -1.0),
            ("megablox", False), ("use_tokamax_gmm", moe.gmm_backend == "tokamax")]


# The run's length, schedule and mesh are spelled as AI-Hypercomputer/maxtext's
# src/maxtext/configs/base.yml declares them at e591f30 (steps: line 836; learning_rate,
# lr_schedule_type, learning_rate_final_fraction, warmup_steps_fraction,
# learning_rate_schedule_steps: lines 870-876; dcn_*_parallelism and ici_*_parallelism: lines
# 660-684), and mean what its src/maxtext/utils/maxtext_utils.py
# create_learning_rate_schedule builds from them there: a linear warmup from 0 over
# int(learning_rate_schedule_steps x warmup_steps_fraction) steps, a cosine to learning_rate x
# learning_rate_final_fraction at learning_rate_schedule_steps (-1: steps), 0 after it.
# Ours (train/step.lr_schedule) holds learning_rate x min_lr_ratio after lr_decay_steps, and
# its cosine reaches its end one step later (at step L of a schedule of L steps, MaxText's at
# L - 1: steps past the warmup / (L - warmup - 1)); the keys translate one to one, that last
# step differs.


def _horizon(cfg: TrainConfig) -> int | None:
    """MaxText's learning_rate_schedule_steps for our lr_decay_steps where the file writes one:
    None for 0 (ours for the run's steps, as MaxText's -1, its default) and for a horizon
    before the run's end that MaxText's schedule cannot match (after it MaxText's rate is 0,
    ours learning_rate x min_lr_ratio: the same only for min_lr_ratio 0, with the warmup
    ending before the horizon)."""
    horizon = cfg.lr_decay_steps
    if horizon == 0:
        return None
    if horizon >= cfg.steps or (cfg.min_lr_ratio == 0 and cfg.warmup_steps < horizon):
        return horizon
    return None


def warmup_fraction(warmup_steps: int, length: int) -> float | None:
    """The warmup_steps_fraction whose int(length x fraction), MaxText's warmup steps of a
    schedule of `length` steps, is `warmup_steps`; None for a warmup longer than the schedule
    (no fraction in [0, 1] says it). warmup_steps / length can fall short by a rounding
    (int(49 x (1 / 49)) is 0): then the next float up."""
    if warmup_steps > length:
        return None
    fraction = warmup_steps / length
    while int(length * fraction) < warmup_steps:
        fraction = math.nextafter(fraction, math.inf)
    return fraction


def _schedule(cfg: TrainConfig) -> tuple[list[tuple[str, Any]], tuple[str, ...]]:
    """(MaxText's steps and learning-rate flags for `cfg`, the keys of ours they cannot say:
    lr_decay_steps where `_horizon` has none, warmup_steps where it outlasts the schedule)."""
    horizon = _horizon(cfg)
    out = [("steps", cfg.steps), ("learning_rate", cfg.learning_rate),
           ("lr_schedule_type", "cosine"), ("learning_rate_final_fraction", cfg.min_lr_ratio)]
    unsaid = ("lr_decay_steps",) if horizon is None and cfg.lr_decay_steps else ()
    if horizon is not None:
        out.append(("learning_rate_schedule_steps", horizon))
    fraction = warmup_fraction(cfg.warmup_steps, horizon or cfg.steps)
    if fraction is None:
        unsaid += ("warmup_steps",)
    else:
        out.append(("warmup_steps_fraction", fraction))
    return out, unsaid


def _mesh(cfg: TrainConfig) -> list[tuple[str, Any]]:
    """Each mesh axis as MaxText's ici_<axis>_parallelism (the part inside a node) and
    dcn_<axis>_parallelism (the nodes it spans), all six: MaxText's own defaults are not ours
    (ici_fsdp_parallelism and dcn_data_parallelism -1, fill the devices)."""
    m = cfg.mesh
    return ([(f"ici_{a}_parallelism", n) for a, n in zip(MESH_AXES, m.ici_shape)]
            + [(f"dcn_{a}_parallelism", n) for a, n in zip(MESH_AXES, m.dcn_shape)])


def items(cfg: TrainConfig) -> list[tuple[str, Any]]:
    """`cfg`'s model, dtypes, sequence, batch, remat policy, steps, learning-rate schedule,
    optimizer and mesh as (MaxText name, value) pairs. Raises ValueError naming a setting that
    has no MaxText flag."""
    dense = cfg.model.moe is None
    out = [(n, _int_valued(n, _get(cfg, RENAMES[n][0]) if dense else _renamed(cfg, n)))
           for n in MODEL_NAMES if not (dense and n in MOE_NAMES)]   # dense: no model.moe
    out += _attention(cfg) + ([] if dense else _moe(cfg))
    out += [(n, _renamed(cfg, n)) for n in RUN_NAMES]
    out.append(("remat_policy", _remat(cfg.remat)))
    out += _schedule(cfg)[0] + [(n, _renamed(cfg, n)) for n in OPTIMIZER_NAMES]
    return out + _mesh(cfg)


def differences(cfg: TrainConfig) -> list[str]:
    """What the flags of `items(cfg)` make MaxText do otherwise than `cfg` does, one line each:
    with weight_decay above 0, MaxText's AdamW decays every parameter (norm scales, a routing
    bias) where ours decays matrices only (`maxtext.weight_decay_differs`)."""
    return [maxtext.weight_decay_differs(cfg.weight_decay)] if cfg.weight_decay > 0 else []


def _yaml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        text = repr(v)   # YAML 1.1 reads 1e-06 as a string: the mantissa needs a point
        mantissa, e, exp = text.partition("e")
        return (mantissa if "." in mantissa else mantissa + ".0") + e + exp
    if isinstance(v, str):
        return json.dumps(v)
    return str(v)


# not listed when left out: the preset is a label (the file sets every model key itself)
NOT_LISTED = ("preset",)


def _settings(obj: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted key, value, its field's default or MISSING) of every scalar setting of a config
    dataclass, nested configs walked (a dense model has no model.moe keys)."""
    out = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out += _settings(value, f"{prefix}{f.name}.")
        elif not (f.name == "moe" and value is None):
            out.append((prefix + f.name, value, f.default))
    return out


def left_out(cfg: TrainConfig) -> list[tuple[str, Any]]:
    """The settings of `cfg` that `items(cfg)` does not say, as (our dotted key, value) in
    TrainConfig's field order: each one whose value is not what the file gives back (the value
    its MaxText flags translate to, else the field's default; a default needs no flag), and
    the schedule's keys MaxText's schedule cannot match whatever their value (MaxText's default
    would stand in for them). Those with no MaxText flag (the sequence-wise aux loss, the init
    scheme...), and the run's settings the file leaves to MaxText's command (the data, the
    run directory...)."""
    said: dict[str, Any] = {}
    for key, value in maxtext.translate(items(cfg)):
        said[key] = value
    if "model.d_model" in said and cfg.model.moe is not None:
        said["model.moe.d_model"] = said["model.d_model"]   # one key sets both (config_file)
    unsaid = _schedule(cfg)[1]
    return [(key, value) for key, value, default in _settings(cfg)
            if key not in NOT_LISTED and (value != said.get(key, default) or key in unsaid)]


def left_out_lines(cfg: TrainConfig) -> list[str]:
    """The comment block `to_yaml` writes first: what the file leaves out (`left_out`), one
    `key: value` a line, or one line saying nothing is."""
    gone = left_out(cfg)
    if not gone:
        return ["# Every dropless setting away from its default is said below."]
    return (["# Not said below: dropless settings away from their defaults that these MaxText "
             "flags leave out", "# (no MaxText flag, or a setting of the run this file does "
             "not write); MaxText runs without them:"]
            + [f"#   {key}: {_yaml_value(value)}" for key, value in gone])


def to_yaml(cfg: TrainConfig, header: str) -> str:
    """The MaxText YAML of `items(cfg)`, under `header` (each line a comment), the list of what
    it leaves out (`left_out_lines`) and a comment line for each of its `differences`."""
    head = ([f"# {line}".rstrip() for line in header.splitlines()] + left_out_lines(cfg)
            + [f"# {line}" for line in differences(cfg)])
    return "\n".join(head + [f"{n}: {_yaml_value(v)}" for n, v in items(cfg)]) + "\n"


# examples/deepseek3_1gpu_maxtext.yml: the header, and the command that writes the file
ONE_GPU_FILE = "examples/deepseek3_1gpu_maxtext.yml"
ONE_GPU_COMMAND = (
    "python -c \"from dropless.config_file import build_config as b; from dropless.compat "
    "import maxtext_out as m; print(m.to_yaml(b([('preset', 'deepseek3-1gpu')]), m.ONE_GPU_HEADER)"
    f", end='')\" > {ONE_GPU_FILE}")
ONE_GPU_HEADER = f"""\
deepseek3-1gpu (`dropless train --preset deepseek3-1gpu`) in MaxText's flags: the model, bfloat16
compute on float32 weights, sequence 4096, batch 4, remat minimal (docs/training.md "One GPU").
Every key is one of MaxText's configs/base.yml; MaxText reads them over its base.yml (as
key=value overrides, or in a YAML whose base_config is base.yml), with run_name, hardware: gpu
and the data of the run. dropless reads the same file as the preset:
  dropless config show --config {ONE_GPU_FILE}
The two trainers' default init schemes differ (dropless's fan_in; model.init=maxtext draws as
MaxText does), and base.yml has no flag for the sequence-wise aux loss (listed below).
Written by (never edit by hand; tests/compat/test_maxtext_out.py checks it):
  {ONE_GPU_COMMAND}
"""
