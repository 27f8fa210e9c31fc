"""MaxText flag names (the MoE and training subset), and our own flat mesh names, translated to
dropless config keys: the edge where other spellings become ours.

`translate(items)` takes (name, value) pairs in MaxText spelling and returns (key, value) pairs
in ours (dotted paths into TrainConfig, e.g. "model.moe.top_k"). A MaxText name whose value we
cannot honour raises ValueError naming the flag, the value and why. `TRANSLATORS` holds one
translator per name (`RENAMES`, `NOOP_ONLY`, the mesh axes, `FORMER_KEYS` and the keys with
rules of their own, the data flags' in compat/maxtext_data.py); `xla_*` and environment keys are
recognised by their spelling. What a translator reads and returns, and the readers that check
a flag's value, are compat/maxtext_values.py's.

Semantics worth knowing:
- `sparse_matmul: true` (MaxText's default) is the grouped-matmul path, which never drops tokens
  whatever `capacity_factor` says; with `sparse_matmul: false`, `capacity_factor > 0` selects the
  token-dropping capacity baseline and `capacity_factor <= 0` is dropless.
- `megablox: true|false` -> gmm_backend "auto". MaxText's megablox is a TPU kernel and its
  `false` fallback is jax.lax.ragged_dot, which on CUDA is a zero-padded dense product; "auto"
  is ragged_dot on TPU (MaxText's behaviour there) and a grouped kernel on CUDA (docs/gpu.md).
  `use_tokamax_gmm: true` -> "tokamax" and wins over `megablox`, as in MaxText.
- `n_routing_groups` / `topk_routing_group` of -1 mean "no groups".
- the learning-rate schedule (MaxText's cosine: linear warmup from 0, cosine decay to
  learning_rate x learning_rate_final_fraction at learning_rate_schedule_steps, 0 after):
  `warmup_steps_fraction` (in [0, 1]) x learning_rate_schedule_steps (-1, its default: the
  run's steps, TrainConfig's default when no key gives them) -> warmup_steps, truncated as
  MaxText truncates it; `learning_rate_final_fraction` (`cosine_learning_rate_final_fraction`
  before MaxText's WSD schedule) -> min_lr_ratio; `learning_rate_schedule_steps` ->
  lr_decay_steps (-1 -> 0, the run's steps), with a note where it ends before the run and
  MaxText's 0 after it differs from our learning_rate x min_lr_ratio; `lr_schedule_type` only
  cosine. MaxText's cosine reaches its end one step earlier (at step L - 1 of a schedule of L
  steps, ours at step L): the keys translate one to one, the last decay step differs.
- A value a rule reads is checked as it is read (ints are ints, numbers finite), so a bad
  one is a ValueError naming the flag, never silently truncated or compared as nan.
- `routed_bias: true` is the aux-loss-free routing bias, updated at `routed_bias_update_rate`
  (model.moe.bias_update_speed); `false` keeps it at zero (speed 0).
- `base_num_kv_heads` is GQA's key/value heads under `attention_type: global`; under `mla` it
  must equal `base_num_query_heads` (MaxText's DeepSeek configs) and sets nothing.
- `adam_b1`, `adam_b2`, `adam_eps`, `gradient_clipping_threshold` mean what ours do (optax's
  AdamW after a global-norm clip, 0: none; MaxText's `adam_eps_root` is 0 by default, as
  optax's, which ours never changes). `adam_weight_decay` -> weight_decay, with a note
  (`weight_decay_differs`) when above 0: ours decays matrices only, MaxText's every parameter
  unless its `adamw_mask` patterns exempt some.
- `compat.maxtext_out` is the other direction: a config said in these flags.
- `te_gmm_quantization: te_mxfp8` -> gmm_quantization "mxfp8" (emulated exactly off Blackwell).
- `te_moe_block: true` -> our MoE layer with the fused dispatcher chosen per platform
  (model.moe.dispatcher "auto": deduplicated all-to-all; dropless); false changes nothing (we
  have one MoE block).
- `hardware: gpu_multiprocess` -> distributed=true (jax.distributed from the cluster
  environment); cpu / gpu / tpu -> distributed=false (the platform is whatever JAX finds).
- `ici_<axis>_parallelism` x `dcn_<axis>_parallelism` -> mesh.<axis> (the mesh axis size), and
  the dcn part -> mesh.dcn_<axis> (how many nodes the axis spans); the mesh groups devices into
  nodes of the ICI product (MeshConfig.devices_per_node).
- our flat mesh keys (`data_parallelism`, `fsdp_parallelism`, `expert_parallelism`,
  `dcn_data`, `dcn_fsdp`, `dcn_expert`) -> mesh.data, mesh.fsdp, ... (`FORMER_KEYS`), so
  commands, YAML files and a run's config.json that spell the mesh flat load as the mesh form.
- `xla_*` keys -> XLA flags (`--name=value`, appended to TrainConfig.xla_flags); upper-case
  environment keys (XLA_PYTHON_CLIENT_MEM_FRACTION, CUDA_DEVICE_MAX_CONNECTIONS,
  XLA_PJRT_GPU_HOST_MEMORY_*, NCCL_*...) -> TrainConfig.environment; both applied before JAX
  starts (dropless.runtime.xla_flags).
- data: `dataset_type` hf or grain (both local files here; tfds and the rest refused),
  `hf_path` (a local folder, joined with `hf_data_dir`: a hub name is refused, nothing is
  downloaded), `hf_train_files` / `grain_train_files` -> data and `hf_eval_files` -> eval_data
  (one file or folder; globs, lists, Parquet and ArrayRecord are refused with the
  `dropless data prepare` command), `train_split` only "train", `packing` true -> "documents"
  and false -> "pad", `use_sft` -> sft, `sft_train_on_completion_only` -> sft_completion_only,
  `eval_steps` -> eval_batches, `tokenizer_path` (a folder -> its tokenizer.json), `add_eos`
  only true (every document ends with EOS); `add_bos`, `eval_split` and `grain_worker_count`
  change nothing (a note says why).
Keys that are accepted but change nothing add a line to `notes` (printed once at start-up).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

from dropless.compat.maxtext_data import DATA_TRANSLATORS
from dropless.compat.maxtext_values import (Given, Pairs, Translator, read_bool, read_float,
                                            read_int)
from dropless.config import MESH_AXES, TrainConfig
from dropless.runtime import environment as env_lib
from dropless.runtime import xla_flags as xf

# MaxText name -> our key(s); values copied unchanged
RENAMES: dict[str, tuple[str, ...]] = {
    "num_experts": ("model.moe.num_experts",),
    "num_experts_per_tok": ("model.moe.top_k",),
    "ragged_buffer_factor": ("model.moe.ragged_buffer_factor",),
    "per_device_batch_size": ("per_device_batch_size",),
    "gradient_accumulation_steps": ("gradient_accumulation_steps",),
    "max_target_length": ("seq_len",),
    "num_vocab_tiling": ("num_vocab_tiling",),
    "steps": ("steps",),
    "weight_dtype": ("model.weight_dtype", "model.moe.weight_dtype"),
    "dtype": ("model.dtype", "model.moe.dtype"),
    "base_emb_dim": ("model.d_model",),
    "base_num_decoder_layers": ("model.num_layers",),
    "base_moe_mlp_dim": ("model.moe.d_ff",),
    "base_mlp_dim": ("model.d_ff",),
    "base_num_query_heads": ("model.num_heads",),
    "head_dim": ("model.head_dim",),
    "vocab_size": ("model.vocab_size",),
    "first_num_dense_layers": ("model.first_k_dense",),
    "load_parameters_path": ("init_from",),   # hf:DIR or a dropless dir (docs/hf.md)
    "shared_experts": ("model.moe.num_shared_experts",),
    "routed_scaling_factor": ("model.moe.routed_scaling_factor",),
    "routed_score_func": ("model.moe.score_func",),
    "routed_bias_update_rate": ("model.moe.bias_update_speed",),
    "norm_topk_prob": ("model.moe.norm_topk_prob",),
    "load_balance_loss_weight": ("model.moe.load_balance_coef",),
    "te_ep_overflow_check_every_n_steps": ("model.moe.overflow_check_every_n_steps",),
    "q_lora_rank": ("model.q_lora_rank",),
    "kv_lora_rank": ("model.kv_lora_rank",),
    "qk_nope_head_dim": ("model.qk_nope_head_dim",),
    "qk_rope_head_dim": ("model.qk_rope_head_dim",),
    "v_head_dim": ("model.v_head_dim",),
    "rope_max_timescale": ("model.rope_theta",),
    "normalization_layer_epsilon": ("model.norm_eps",),
    "logits_via_embedding": ("model.tie_embeddings",),
    "mtp_num_layers": ("model.mtp_depth",),
    "mtp_loss_scaling_factor": ("model.mtp_loss_coef",),
    "scan_layers": ("model.scan_layers",),
    "learning_rate": ("learning_rate",),
    "learning_rate_final_fraction": ("min_lr_ratio",),
    "cosine_learning_rate_final_fraction": ("min_lr_ratio",),   # its name before MaxText's WSD
    "adam_b1": ("adam_b1",),
    "adam_b2": ("adam_b2",),
    "adam_eps": ("adam_eps",),
    "adam_weight_decay": ("weight_decay",),
    "gradient_clipping_threshold": ("grad_clip",),
    "checkpoint_period": ("checkpoint_every",),
    "max_num_checkpoints_to_keep": ("keep_checkpoints",),
    "async_checkpointing": ("async_checkpoints",),
    "eval_interval": ("eval_every",),
    "log_period": ("log_every",),
    "base_output_directory": ("run_dir",),
    "run_name": ("run_name",),
    "init_weights_seed": ("seed",),
    "model_name": ("preset",),
    "dataset_path": ("data",),
    "use_sft": ("sft",),
    "sft_train_on_completion_only": ("sft_completion_only",),
    "eval_steps": ("eval_batches",),
}

# MaxText remat_policy -> ours
REMAT = {"full": "full", "minimal": "minimal", "none": "none", "save_qkv_proj": "minimal",
         "qkv_proj_offloaded": "offload", "minimal_offloaded": "offload"}

# accepted only at their no-op value (we have no such axis / feature)
NOOP_ONLY = {
    "ici_tensor_parallelism": 1, "ici_sequence_parallelism": 1, "ici_pipeline_parallelism": 1,
    "ici_context_parallelism": 1, "ici_tensor_sequence_parallelism": 1,
    "ici_autoregressive_parallelism": 1, "dcn_tensor_parallelism": 1,
    "dcn_sequence_parallelism": 1, "dcn_pipeline_parallelism": 1,
    "dcn_context_parallelism": 1, "dcn_autoregressive_parallelism": 1,
    "dcn_tensor_sequence_parallelism": 1, "lr_schedule_type": "cosine",
    "opt_type": "adamw", "adam_eps_root": 0.0, "adamw_mask": [],
}
# why a NOOP_ONLY name takes no other value (the mesh axes': dropless has no such axis)
NOOP_WHY = {"lr_schedule_type": "dropless's schedule is a linear warmup, then a cosine decay",
            "opt_type": "dropless trains with AdamW",
            "adam_eps_root": "dropless's AdamW adds adam_eps outside the square root only",
            "adamw_mask": "dropless decays matrices only, never norm weights or biases"}
ICI = {f"ici_{a}_parallelism": a for a in MESH_AXES}
DCN = {f"dcn_{a}_parallelism": a for a in MESH_AXES}
HARDWARE = ("cpu", "gpu", "gpu_multiprocess", "tpu")
# te_gmm_quantization (lower-cased) -> our gmm_quantization
GMM_QUANTIZATION = {"": "none", "none": "none", "te_mxfp8": "mxfp8", "mxfp8": "mxfp8"}
# MaxText's attention (its attention kernel) -> our model.attention_kernel; cudnn_flash_te
# (Transformer Engine's binding of cuDNN's fused attention) and cudnn_flash_jax (jax's) are both
# cuDNN's flash attention, which ours runs through jax; MaxText's flash (TPU: splash; GPU:
# tokamax's Pallas Triton kernel) is our auto, with a note
ATTENTION_KERNELS = {"autoselected": "auto", "dot_product": "xla", "cudnn_flash_te": "cudnn",
                     "cudnn_flash_jax": "cudnn", "flash": "auto"}
# our own keys that start like MaxText's xla_* flags
OUR_XLA_KEYS = ("xla_recipe", "xla_flags")
# our own flat mesh keys -> the MeshConfig field they set
FORMER_KEYS: dict[str, str] = {
    **{f"{a}_parallelism": f"mesh.{a}" for a in MESH_AXES},
    **{f"dcn_{a}": f"mesh.dcn_{a}" for a in MESH_AXES},
}


def weight_decay_differs(value: Any) -> str:
    """The line saying what adam_weight_decay=`value` (> 0) decays in each trainer: a note where
    a MaxText config gives it, and beside a config written in MaxText's flags
    (compat/maxtext_out.py). MaxText's AdamW (optimizers.get_optimizer at e591f30) takes the mask
    its `adamw_mask` patterns make, none by default, so it decays every parameter; ours
    (train/step.make_optimizer) decays matrices only."""
    return (f"adam_weight_decay={value}: dropless decays matrices only, MaxText's AdamW every "
            "parameter, norm scales and any routing bias too (its adamw_mask, [] by default, "
            "exempts none)")


def _decay_note(v: Any) -> str | None:
    """`weight_decay_differs` for a decay above 0; None for 0 (nothing decays in either) and
    for a value that is no number (TrainConfig's check names it)."""
    try:
        decays = read_float("adam_weight_decay", v) > 0
    except ValueError:
        return None
    return weight_decay_differs(v) if decays else None


# RENAMES names whose value, copied unchanged, means something else in MaxText: name -> the
# note it adds (None: none for this value)
RENAME_NOTES: dict[str, Callable[[Any], str | None]] = {"adam_weight_decay": _decay_note}


def _renamed(name: str, keys: tuple[str, ...]) -> Translator:
    """The translator copying `name`'s value into `keys`, adding its RENAME_NOTES line once."""
    note = RENAME_NOTES.get(name, lambda v: None)

    def translate(name: str, v: Any, given: Given) -> Pairs:
        line = note(v)
        if line is not None and line not in given.notes:
            given.notes.append(line)
        return [(key, v) for key in keys]
    return translate


def _noop_only(name: str, v: Any, given: Given) -> Pairs:
    if v != NOOP_ONLY[name]:
        why = NOOP_WHY.get(name, "dropless has no such mesh axis")
        raise ValueError(f"MaxText {name}={v!r} is not supported ({why}); only "
                         f"{NOOP_ONLY[name]} is accepted")
    return []


def _mesh_axis(name: str, v: Any, given: Given) -> Pairs:
    """ici_<axis> x dcn_<axis> -> mesh.<axis>, and dcn_<axis> -> mesh.dcn_<axis>, whichever of
    the two `name` is (the other is read from `given`)."""
    axis = ICI.get(name) or DCN[name]
    ici_name, dcn_name = f"ici_{axis}_parallelism", f"dcn_{axis}_parallelism"
    ici = read_int(ici_name, given.seen.get(ici_name, 1))
    dcn = read_int(dcn_name, given.seen.get(dcn_name, 1))
    if ici < 1 or dcn < 1:
        bad = name if read_int(name, v) < 1 else (ici_name if ici < 1 else dcn_name)
        raise ValueError(f"MaxText {bad}={given.seen.get(bad, v)!r} must be >= 1 (MaxText's "
                         "-1, 'fill the rest', is not supported: give the size)")
    return [(f"mesh.{axis}", ici * dcn), (f"mesh.dcn_{axis}", dcn)]


def _flat_mesh_key(name: str, v: Any, given: Given) -> Pairs:
    return [(FORMER_KEYS[name], v)]


def _te_moe_block(name: str, v: Any, given: Given) -> Pairs:
    if read_bool(name, v):
        return [("model.moe.dispatcher", "auto")]
    given.notes.append("te_moe_block=false changes nothing: dropless has one MoE block")
    return []


def _attention_kernel(name: str, v: Any, given: Given) -> Pairs:
    if not isinstance(v, str) or v not in ATTENTION_KERNELS:
        raise ValueError(f"MaxText attention={v!r} is not supported (training runs one of "
                         f"{list(ATTENTION_KERNELS)})")
    if v == "flash":
        given.notes.append("attention=flash is model.attention_kernel=auto: cuDNN's flash "
                           "attention on an NVIDIA GPU, where MaxText runs tokamax's Pallas "
                           "Triton kernel")
    return [("model.attention_kernel", ATTENTION_KERNELS[v])]


def _max_segments_per_seq(name: str, v: Any, given: Given) -> Pairs:
    n = read_int(name, v)
    if n <= 0:
        given.notes.append(f"max_segments_per_seq={n} (no bound) keeps "
                           "model.max_segments_per_seq=32: cudnn_thd's segment form needs one "
                           "(a batch with a row of more documents takes the masked form)")
        return []
    return [("model.max_segments_per_seq", n)]


def _hardware(name: str, v: Any, given: Given) -> Pairs:
    if v not in HARDWARE:
        raise ValueError(f"MaxText hardware={v!r} is not supported; known: {HARDWARE}")
    return [("distributed", v == "gpu_multiprocess")]


def _prefuse_moe_weights(name: str, v: Any, given: Given) -> Pairs:
    return [("model.moe.prefuse_moe_weights", read_bool(name, v))]


def _sparse_matmul(name: str, v: Any, given: Given) -> Pairs:
    return []   # read by capacity_factor, through `given.sparse`


def _megablox(name: str, v: Any, given: Given) -> Pairs:
    read_bool(name, v)
    if read_bool("use_tokamax_gmm", given.seen.get("use_tokamax_gmm", False)):
        return []   # use_tokamax_gmm wins, as in MaxText
    return [("model.moe.gmm_backend", "auto")]


def _use_tokamax_gmm(name: str, v: Any, given: Given) -> Pairs:
    return [("model.moe.gmm_backend", "tokamax")] if read_bool(name, v) else []


def _te_gmm_quantization(name: str, v: Any, given: Given) -> Pairs:
    if str(v).lower() not in GMM_QUANTIZATION:
        raise ValueError(f"MaxText te_gmm_quantization={v!r} is not supported; known: "
                         f"{sorted(k for k in GMM_QUANTIZATION if k)}")
    return [("model.moe.gmm_quantization", GMM_QUANTIZATION[str(v).lower()])]


def _capacity_factor(name: str, v: Any, given: Given) -> Pairs:
    factor = read_float(name, v)
    drop = (not given.sparse) and factor > 0
    if given.sparse and factor > 0:
        given.notes.append(f"capacity_factor={v} changes nothing with sparse_matmul=true: the "
                           "grouped-matmul path is dropless")
    return [("model.moe.capacity_factor", factor if drop else None)]


def _remat_policy(name: str, v: Any, given: Given) -> Pairs:
    if not isinstance(v, str) or v not in REMAT:
        raise ValueError(f"MaxText remat_policy={v!r} is not supported; known: {sorted(REMAT)}")
    return [("remat", REMAT[v])]


def _n_routing_groups(name: str, v: Any, given: Given) -> Pairs:
    n = read_int(name, v)
    if n <= 0:   # no groups: the group limit goes too
        return [("model.moe.n_groups", 1), ("model.moe.topk_groups", 1)]
    return [("model.moe.n_groups", n)]


def _topk_routing_group(name: str, v: Any, given: Given) -> Pairs:
    n = read_int(name, v)
    return [("model.moe.topk_groups", 1 if n <= 0 else n)]


# the steps a run trains for when no key says (TrainConfig's default): what a warmup fraction
# is a fraction of then
DEFAULT_STEPS = next(f.default for f in dataclasses.fields(TrainConfig) if f.name == "steps")


def _warmup_steps_fraction(name: str, v: Any, given: Given) -> Pairs:
    """warmup_steps = int(fraction x the steps the schedule spans), truncated as MaxText
    truncates it: learning_rate_schedule_steps where it is given and not -1, else the run's
    steps (those given, else TrainConfig's default)."""
    fraction = read_float(name, v)
    if not 0 <= fraction <= 1:
        raise ValueError(f"MaxText {name}={v!r} must be a fraction of the steps in [0, 1]")
    length = given.seen.get("learning_rate_schedule_steps", -1)
    if length != -1:
        return [("warmup_steps", int(read_int("learning_rate_schedule_steps", length) * fraction))]
    steps = given.seen.get("steps", DEFAULT_STEPS)
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise ValueError(f"MaxText {name}={v!r} is a fraction of steps, and steps={steps!r} "
                         "is not an int")
    return [("warmup_steps", int(steps * fraction))]


# the names that set min_lr_ratio, MaxText's first (a schedule's end reads whichever is given)
FINAL_FRACTION_NAMES = ("learning_rate_final_fraction", "cosine_learning_rate_final_fraction",
                        "min_lr_ratio")


def _learning_rate_schedule_steps(name: str, v: Any, given: Given) -> Pairs:
    """The step MaxText's cosine ends at -> lr_decay_steps; -1, MaxText's default (the run's
    steps), -> 0, ours for the same. A schedule that ends before the run is 0 after it in
    MaxText and learning_rate x min_lr_ratio in ours, the same only for a final fraction of 0:
    otherwise a note says so."""
    horizon = read_int(name, v)
    if horizon == -1:
        return [("lr_decay_steps", 0)]
    if horizon < 1:
        raise ValueError(f"MaxText {name}={v!r} must be a positive number of steps, or -1 "
                         "(the run's steps)")
    steps = given.seen.get("steps", DEFAULT_STEPS)
    final = next((read_float(k, given.seen[k]) for k in FINAL_FRACTION_NAMES if k in given.seen),
                 0.1)   # MaxText's default and ours
    if isinstance(steps, int) and horizon < steps and final != 0:
        given.notes.append(f"{name}={horizon} ends the schedule before steps={steps}: from "
                           "there dropless trains at learning_rate x min_lr_ratio, where "
                           "MaxText's rate is 0 (learning_rate_final_fraction=0 makes both 0)")
    return [("lr_decay_steps", horizon)]


def _attention_type(name: str, v: Any, given: Given) -> Pairs:
    if v not in ("mla", "global"):
        raise ValueError(f"MaxText attention_type={v!r} is not supported; use 'mla' or 'global'")
    return [("model.attention", "mla" if v == "mla" else "mha")]


def _base_num_kv_heads(name: str, v: Any, given: Given) -> Pairs:
    """MHA's key/value heads (GQA); under MLA (MaxText's DeepSeek configs) one a query head,
    which dropless's MLA has by construction."""
    if given.seen.get("attention_type") != "mla":
        return [("model.num_kv_heads", v)]
    heads = given.seen.get("base_num_query_heads", v)
    if read_int(name, v) != read_int("base_num_query_heads", heads):
        raise ValueError(f"MaxText base_num_kv_heads={v!r} with attention_type=mla: MLA has one "
                         f"key/value head a query head (base_num_query_heads={heads!r})")
    return []


def _routed_bias(name: str, v: Any, given: Given) -> Pairs:
    """The aux-loss-free routing bias: on, it is updated at routed_bias_update_rate (our
    model.moe.bias_update_speed); off, it stays zero (speed 0), and a rate given with it is
    refused."""
    if read_bool(name, v):
        return []
    rate = given.seen.get("routed_bias_update_rate", 0.0)
    if read_float("routed_bias_update_rate", rate) != 0.0:
        raise ValueError(f"MaxText routed_bias=false with routed_bias_update_rate={rate!r}: "
                         "a bias that is updated is on; set routed_bias=true or the rate to 0")
    return [("model.moe.bias_update_speed", 0.0)]


def _decoder_block(name: str, v: Any, given: Given) -> Pairs:
    given.notes.append(f"decoder_block={v} changes nothing: the architecture follows from the "
                       "preset and the model keys")
    return []


def _enable_checkpointing(name: str, v: Any, given: Given) -> Pairs:
    if read_bool(name, v):
        return []
    given.notes.append(f"enable_checkpointing={v} is checkpoint_every=0 save_last_step=false: a "
                       "run stopped by a signal, a non-finite step or an overflow still saves "
                       "its last good step, so it can resume")
    return [("checkpoint_every", 0), ("save_last_step", False)]


# the MaxText names with rules of their own, beyond a rename or a no-op value
SPECIAL_TRANSLATORS: dict[str, Translator] = {
    "sparse_matmul": _sparse_matmul, "megablox": _megablox, "use_tokamax_gmm": _use_tokamax_gmm,
    "te_gmm_quantization": _te_gmm_quantization, "capacity_factor": _capacity_factor,
    "remat_policy": _remat_policy, "n_routing_groups": _n_routing_groups,
    "topk_routing_group": _topk_routing_group, "warmup_steps_fraction": _warmup_steps_fraction,
    "learning_rate_schedule_steps": _learning_rate_schedule_steps,
    "attention_type": _attention_type, "attention": _attention_kernel,
    "decoder_block": _decoder_block, "base_num_kv_heads": _base_num_kv_heads,
    "routed_bias": _routed_bias,
    "enable_checkpointing": _enable_checkpointing, "te_moe_block": _te_moe_block,
    "hardware": _hardware, "prefuse_moe_weights": _prefuse_moe_weights,
    "max_segments_per_seq": _max_segments_per_seq,
    **DATA_TRANSLATORS,
    **{name: _mesh_axis for name in (*ICI, *DCN)},
}
SPECIAL = tuple(SPECIAL_TRANSLATORS)
KNOWN = tuple(RENAMES) + tuple(NOOP_ONLY) + SPECIAL


def _table(*parts: dict[str, Translator]) -> dict[str, Translator]:
    table: dict[str, Translator] = {}
    for part in parts:
        twice = set(table) & set(part)
        if twice:
            raise ValueError(f"MaxText names given two translators: {sorted(twice)}")
        table.update(part)
    return table


# every name translate_each accepts, beyond the xla_* and environment keys -> its translator
TRANSLATORS: dict[str, Translator] = _table(
    {name: _renamed(name, keys) for name, keys in RENAMES.items()},
    {name: _noop_only for name in NOOP_ONLY},
    {name: _flat_mesh_key for name in FORMER_KEYS},
    SPECIAL_TRANSLATORS)


def is_xla_flag(name: str) -> bool:
    """A MaxText `xla_*` key that becomes an XLA flag (not our xla_recipe / xla_flags)."""
    return name.startswith("xla_") and name not in OUR_XLA_KEYS and name.isidentifier()


def is_env_key(name: str) -> bool:
    """An upper-case environment key a config may set (XLA_..., CUDA_..., NCCL_...)."""
    return name.isupper() and name.startswith(env_lib.ENV_PREFIXES) and name != "XLA_FLAGS"


# names both spellings share, told apart by the value: MaxText's `packing` is a boolean, ours
# one of config.PACKINGS
SHARED: dict[str, Callable[[Any], bool]] = {
    "packing": lambda v: isinstance(v, bool) or str(v).lower() in ("true", "false")}


def spelled_as_maxtext(name: str, v: Any) -> bool:
    """Whether (name, v), a name of ours too, is MaxText's spelling (translated here)."""
    return name in SHARED and SHARED[name](v)


def is_known(name: str) -> bool:
    """Whether `translate_each` accepts `name`."""
    return name in TRANSLATORS or is_xla_flag(name) or is_env_key(name)


def translate(items: Iterable[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """MaxText (name, value) pairs -> our (key, value) pairs, in order."""
    return [pair for group in translate_each(items) for pair in group]


def translate_each(items: Iterable[tuple[str, Any]], *, context: dict[str, Any] | None = None,
                   notes: list[str] | None = None) -> list[list[tuple[str, Any]]]:
    """One list of our (key, value) pairs per MaxText pair, aligned with `items`. Flags that need
    context (capacity_factor with sparse_matmul, warmup fraction with steps, dcn_* with ici_*)
    read it from `context` (default: the items themselves). Keys that change nothing append a
    line to `notes`. `xla_*` keys yield ("xla_flags+", "--flag=value") and environment keys
    ("environment+", "NAME=value"): appended to what is there, not replacing it. Raises KeyError
    for a name `is_known` refuses, ValueError naming the key and value for a bad value."""
    items = list(items)
    seen = dict(items) if context is None else context
    given = Given(seen=seen, sparse=read_bool("sparse_matmul", seen.get("sparse_matmul", True)),
                  notes=[] if notes is None else notes)
    return [_translate_one(name, v, given) for name, v in items]


def _translate_one(name: str, v: Any, given: Given) -> Pairs:
    if is_xla_flag(name):
        return [("xla_flags+", xf.flag_text(name, v))]
    if is_env_key(name):
        return [("environment+", env_lib.env_text(name, v))]
    if name not in TRANSLATORS:
        raise KeyError(name)
    return TRANSLATORS[name](name, v, given)
