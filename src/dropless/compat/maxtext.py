"""MaxText flag names (the MoE and training subset), and our own former flat mesh names,
translated to dropless config keys: the one edge where other spellings become ours.

`translate(items)` takes (name, value) pairs in MaxText spelling and returns (key, value) pairs
in ours (dotted paths into TrainConfig, e.g. "model.moe.top_k"). A MaxText name whose value we
cannot honour raises ValueError naming the flag, the value and why.

Semantics worth knowing:
- `sparse_matmul: true` (MaxText's default) is the grouped-matmul path, which never drops tokens
  whatever `capacity_factor` says; with `sparse_matmul: false`, `capacity_factor > 0` selects the
  token-dropping capacity baseline and `capacity_factor <= 0` is dropless.
- `megablox: true|false` -> gmm_backend "auto". MaxText's megablox is a TPU kernel and its
  `false` fallback is jax.lax.ragged_dot, which on CUDA is a zero-padded dense product; "auto"
  is ragged_dot on TPU (MaxText's behaviour there) and a grouped kernel on CUDA (docs/gpu.md).
  `use_tokamax_gmm: true` -> "tokamax" and wins over `megablox`, as in MaxText.
- `n_routing_groups` / `topk_routing_group` of -1 mean "no groups".
- `te_gmm_quantization: te_mxfp8` -> gmm_quantization "mxfp8" (emulated exactly off Blackwell).
- `te_moe_block: true` -> our MoE layer with the fused dispatcher chosen per platform
  (model.moe.dispatcher "auto": deduplicated all-to-all; dropless); false changes nothing (we
  have one MoE block).
- `hardware: gpu_multiprocess` -> distributed=true (jax.distributed from the cluster
  environment); cpu / gpu / tpu -> distributed=false (the platform is whatever JAX finds).
- `ici_<axis>_parallelism` x `dcn_<axis>_parallelism` -> mesh.<axis> (the mesh axis size), and
  the dcn part -> mesh.dcn_<axis> (how many nodes the axis spans); the mesh groups devices into
  nodes of the ICI product (MeshConfig.devices_per_node).
- our former flat keys (`data_parallelism`, `fsdp_parallelism`, `expert_parallelism`,
  `dcn_data`, `dcn_fsdp`, `dcn_expert`: TrainConfig fields before the mesh became a MeshConfig)
  -> mesh.data, mesh.fsdp, ... (`FORMER_KEYS`), so old commands, YAML files and a run's old
  config.json keep working.
- `xla_*` keys -> XLA flags (`--name=value`, appended to TrainConfig.xla_flags); upper-case
  environment keys (XLA_PYTHON_CLIENT_MEM_FRACTION, CUDA_DEVICE_MAX_CONNECTIONS,
  XLA_PJRT_GPU_HOST_MEMORY_*, NCCL_*...) -> TrainConfig.environment; both applied before JAX
  starts (dropless.runtime.xla_flags).
Keys that are accepted but change nothing add a line to `notes` (printed once at start-up).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable

from dropless.config import MESH_AXES
from dropless.runtime import environment as env_lib
from dropless.runtime import xla_flags as xf

# MaxText name -> our key(s); values copied unchanged
RENAMES: dict[str, tuple[str, ...]] = {
    "num_experts": ("model.moe.num_experts",),
    "num_experts_per_tok": ("model.moe.top_k",),
    "ragged_buffer_factor": ("model.moe.ragged_buffer_factor",),
    "per_device_batch_size": ("per_device_batch_size",),
    "max_target_length": ("seq_len",),
    "steps": ("steps",),
    "weight_dtype": ("model.weight_dtype", "model.moe.weight_dtype"),
    "dtype": ("model.dtype", "model.moe.dtype"),
    "base_emb_dim": ("model.d_model",),
    "base_num_decoder_layers": ("model.num_layers",),
    "base_moe_mlp_dim": ("model.moe.d_ff",),
    "base_mlp_dim": ("model.d_ff",),
    "base_num_query_heads": ("model.num_heads",),
    "base_num_kv_heads": ("model.num_kv_heads",),
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
    "tokenizer_path": ("tokenizer",),
    "dataset_path": ("data",),
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
    "dcn_tensor_sequence_parallelism": 1,
}
ICI = {f"ici_{a}_parallelism": a for a in MESH_AXES}
DCN = {f"dcn_{a}_parallelism": a for a in MESH_AXES}
HARDWARE = ("cpu", "gpu", "gpu_multiprocess", "tpu")
SPECIAL = ("sparse_matmul", "megablox", "use_tokamax_gmm", "te_gmm_quantization",
           "capacity_factor", "remat_policy", "n_routing_groups", "topk_routing_group", "warmup_steps_fraction", "attention_type",
           "decoder_block", "enable_checkpointing", "te_moe_block", "hardware",
           "prefuse_moe_weights") + tuple(ICI) + tuple(DCN)
# our own keys that start like MaxText's xla_* flags
OUR_XLA_KEYS = ("xla_recipe", "xla_flags")

KNOWN = tuple(RENAMES) + tuple(NOOP_ONLY) + SPECIAL
# our own former flat mesh keys (TrainConfig fields until the mesh became `mesh: MeshConfig`)
FORMER_KEYS: dict[str, str] = {
    **{f"{a}_parallelism": f"mesh.{a}" for a in MESH_AXES},
    **{f"dcn_{a}": f"mesh.dcn_{a}" for a in MESH_AXES},
}
# fused gate/up expert weights: the MoEConfig field that holds them, when this build has one
PREFUSE_FIELD = "prefuse_moe_weights"   # helper branch "moe" adds it


def is_xla_flag(name: str) -> bool:
    """A MaxText `xla_*` key that becomes an XLA flag (not our xla_recipe / xla_flags)."""
    return name.startswith("xla_") and name not in OUR_XLA_KEYS and name.isidentifier()


def is_env_key(name: str) -> bool:
    """An upper-case environment key a config may set (XLA_..., CUDA_..., NCCL_...)."""
    return name.isupper() and name.startswith(env_lib.ENV_PREFIXES) and name != "XLA_FLAGS"


def is_known(name: str) -> bool:
    """Whether `translate_each` accepts `name`."""
    return name in KNOWN or name in FORMER_KEYS or is_xla_flag(name) or is_env_key(name)


def _bool(name: str, v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.lower() in ("true", "false"):
        return v.lower() == "true"
    raise ValueError(f"MaxText {name}={v!r} must be true or false")


def translate(items: Iterable[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """MaxText (name, value) pairs -> our (key, value) pairs, in order."""
    return [pair for group in translate_each(items) for pair in group]


def _int(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, str)) or not str(v).lstrip("-").isdigit():
        raise ValueError(f"MaxText {name}={v!r} must be an int")
    return int(v)


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
    notes = [] if notes is None else notes
    groups: list[list[tuple[str, Any]]] = []
    sparse = _bool("sparse_matmul", seen.get("sparse_matmul", True))
    for name, v in items:
        out: list[tuple[str, Any]] = []
        groups.append(out)
        if is_xla_flag(name):
            out.append(("xla_flags+", xf.flag_text(name, v)))
        elif is_env_key(name):
            out.append(("environment+", env_lib.env_text(name, v)))
        elif name in ICI or name in DCN:
            axis = ICI.get(name) or DCN[name]
            ici = _int(f"ici_{axis}_parallelism", seen.get(f"ici_{axis}_parallelism", 1))
            dcn = _int(f"dcn_{axis}_parallelism", seen.get(f"dcn_{axis}_parallelism", 1))
            if ici < 1 or dcn < 1:
                bad = name if _int(name, v) < 1 else (f"ici_{axis}_parallelism" if ici < 1
                                                      else f"dcn_{axis}_parallelism")
                raise ValueError(f"MaxText {bad}={seen.get(bad, v)!r} must be >= 1 (MaxText's "
                                 "-1, 'fill the rest', is not supported: give the size)")
            out += [(f"mesh.{axis}", ici * dcn), (f"mesh.dcn_{axis}", dcn)]
        elif name in FORMER_KEYS:
            out.append((FORMER_KEYS[name], v))
        elif name == "te_moe_block":
            if _bool(name, v):
                out.append(("model.moe.dispatcher", "auto"))
            else:
                notes.append("te_moe_block=false changes nothing: dropless has one MoE block")
        elif name == "hardware":
            if v not in HARDWARE:
                raise ValueError(f"MaxText hardware={v!r} is not supported; known: {HARDWARE}")
            out.append(("distributed", v == "gpu_multiprocess"))
        elif name == "prefuse_moe_weights":
            from dropless.config import MoEConfig
            if PREFUSE_FIELD in {f.name for f in dataclasses.fields(MoEConfig)}:
                out.append((f"model.moe.{PREFUSE_FIELD}", _bool(name, v)))
            elif _bool(name, v):
                notes.append("prefuse_moe_weights=true changes nothing in this build (no fused "
                             "gate/up expert weights)")
        elif name in RENAMES:
            out += [(key, v) for key in RENAMES[name]]
        elif name in NOOP_ONLY:
            if v != NOOP_ONLY[name]:
                raise ValueError(f"MaxText {name}={v!r} is not supported (dropless has no such "
                                 f"mesh axis); only {NOOP_ONLY[name]} is accepted")
        elif name == "sparse_matmul":
            pass  # resolved with capacity_factor
        elif name == "megablox":
            _bool(name, v)
            if not _bool("use_tokamax_gmm", seen.get("use_tokamax_gmm", False)):
                out.append(("model.moe.gmm_backend", "auto"))
        elif name == "use_tokamax_gmm":
            if _bool(name, v):
                out.append(("model.moe.gmm_backend", "tokamax"))
        elif name == "te_gmm_quantization":
            known = {"": "none", "none": "none", "te_mxfp8": "mxfp8", "mxfp8": "mxfp8"}
            if str(v).lower() not in known:
                raise ValueError(f"MaxText te_gmm_quantization={v!r} is not supported; known: "
                                 f"{sorted(k for k in known if k)}")
            out.append(("model.moe.gmm_quantization", known[str(v).lower()]))
        elif name == "capacity_factor":
            drop = (not sparse) and float(v) > 0
            out.append(("model.moe.capacity_factor", float(v) if drop else None))
            if sparse and float(v) > 0:
                notes.append(f"capacity_factor={v} changes nothing with sparse_matmul=true: the "
                             "grouped-matmul path is dropless")
        elif name == "remat_policy":
            if v not in REMAT:
                raise ValueError(f"MaxText remat_policy={v!r} is not supported; known: "
                                 f"{sorted(REMAT)}")
            out.append(("remat", REMAT[v]))
        elif name == "n_routing_groups":
            if int(v) <= 0:   # no groups: the group limit goes too
                out += [("model.moe.n_groups", 1), ("model.moe.topk_groups", 1)]
            else:
                out.append(("model.moe.n_groups", int(v)))
        elif name == "topk_routing_group":
            out.append(("model.moe.topk_groups", 1 if int(v) <= 0 else int(v)))
        elif name == "warmup_steps_fraction":
            out.append(("warmup_steps", int(float(v) * int(seen.get("steps", 300)))))
        elif name == "attention_type":
            if v not in ("mla", "global"):
                raise ValueError(f"MaxText attention_type={v!r} is not supported; use 'mla' or "
                                 "'global'")
            out.append(("model.attention", "mla" if v == "mla" else "mha"))
        elif name == "decoder_block":
            notes.append(f"decoder_block={v} changes nothing: the architecture follows from the "
                         "preset and the model keys")
        elif name == "enable_checkpointing":
            if not _bool(name, v):
                out.append(("checkpoint_every", 0))
        else:
            raise KeyError(name)
    return groups
