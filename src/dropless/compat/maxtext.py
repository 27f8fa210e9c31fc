"""MaxText flag names (the MoE and training subset) translated to dropless config keys.

`translate(items)` takes (name, value) pairs in MaxText spelling and returns (key, value) pairs
in ours (dotted paths into TrainConfig, e.g. "model.moe.top_k"). A MaxText name whose value we
cannot honour raises ValueError naming the flag, the value and why.

Semantics worth knowing:
- `sparse_matmul: true` (MaxText's default) is the grouped-matmul path, which never drops tokens
  whatever `capacity_factor` says; with `sparse_matmul: false`, `capacity_factor > 0` selects the
  token-dropping capacity baseline and `capacity_factor <= 0` is dropless.
- `megablox: true` -> gmm_backend "auto" (the fastest grouped matmul on the platform);
  `megablox: false` -> "ragged_dot" (jax.lax.ragged_dot, MaxText's fallback).
- `n_routing_groups` / `topk_routing_group` of -1 mean "no groups".
- `te_gmm_quantization: te_mxfp8` -> gmm_quantization "mxfp8" (emulated exactly off Blackwell).
"""
from __future__ import annotations

from typing import Any, Iterable

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
    "ici_data_parallelism": ("data_parallelism",),
    "ici_fsdp_parallelism": ("fsdp_parallelism",),
    "ici_expert_parallelism": ("expert_parallelism",),
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
DCN = {"dcn_data_parallelism": "data_parallelism", "dcn_fsdp_parallelism": "fsdp_parallelism",
       "dcn_expert_parallelism": "expert_parallelism"}
SPECIAL = ("sparse_matmul", "megablox", "te_gmm_quantization", "capacity_factor", "remat_policy", "n_routing_groups",
           "topk_routing_group", "warmup_steps_fraction", "attention_type", "decoder_block",
           "enable_checkpointing") + tuple(DCN)

KNOWN = tuple(RENAMES) + tuple(NOOP_ONLY) + SPECIAL


def _bool(name: str, v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.lower() in ("true", "false"):
        return v.lower() == "true"
    raise ValueError(f"MaxText {name}={v!r} must be true or false")


def translate(items: Iterable[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """MaxText (name, value) pairs -> our (key, value) pairs, in order."""
    return [pair for group in translate_each(items) for pair in group]


def translate_each(items: Iterable[tuple[str, Any]], *, context: dict[str, Any] | None = None
                   ) -> list[list[tuple[str, Any]]]:
    """One list of our (key, value) pairs per MaxText pair, aligned with `items`. Flags that need
    context (capacity_factor with sparse_matmul, warmup fraction with steps, dcn_* with ici_*)
    read it from `context` (default: the items themselves). Raises KeyError for a name not in
    KNOWN."""
    items = list(items)
    seen = dict(items) if context is None else context
    groups: list[list[tuple[str, Any]]] = []
    sparse = _bool("sparse_matmul", seen.get("sparse_matmul", True))
    for name, v in items:
        out: list[tuple[str, Any]] = []
        groups.append(out)
        if name in RENAMES:
            out += [(key, v) for key in RENAMES[name]]
        elif name in NOOP_ONLY:
            if v != NOOP_ONLY[name]:
                raise ValueError(f"MaxText {name}={v!r} is not supported (dropless has no such "
                                 f"mesh axis); only {NOOP_ONLY[name]} is accepted")
        elif name == "sparse_matmul":
            pass  # resolved with capacity_factor
        elif name == "megablox":
            out.append(("model.moe.gmm_backend", "auto" if _bool(name, v) else "ragged_dot"))
        elif name == "te_gmm_quantization":
            known = {"": "none", "none": "none", "te_mxfp8": "mxfp8", "mxfp8": "mxfp8"}
            if str(v).lower() not in known:
                raise ValueError(f"MaxText te_gmm_quantization={v!r} is not supported; known: "
                                 f"{sorted(k for k in known if k)}")
            out.append(("model.moe.gmm_quantization", known[str(v).lower()]))
        elif name == "capacity_factor":
            drop = (not sparse) and float(v) > 0
            out.append(("model.moe.capacity_factor", float(v) if drop else None))
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
            pass  # the architecture follows from the other keys / the preset
        elif name == "enable_checkpointing":
            if not _bool(name, v):
                out.append(("checkpoint_every", 0))
        elif name in DCN:
            if int(v) != 1:
                ici = f"ici_{name[4:]}"
                out.append((DCN[name], int(v) * int(seen.get(ici, 1))))
        else:
            raise KeyError(name)
    return groups
