"""Which keys of a Hugging Face config.json survive HF -> dropless -> HF, and the config.json an
export writes: the model's keys over the kept ones over the fallbacks.

* `MODEL_KEYS`: what the model determines. They are read into ModelConfig (in either
  transformers format's spelling, `config_formats.ALIASES` and `rope_parameters`), derived by
  transformers from other keys (`qk_head_dim`, DeepSeek's `head_dim`, Qwen3's `layer_types`),
  or refused unless they hold the one value we implement (`hidden_act`, `quantization_config`,
  ...). `config_map.hf_config` writes them from the model; a source's values are not kept.
* `WRITER_KEYS`: what names the file's writer, not the model: `transformers_version` (dropless
  writes the exported file) and `auto_map` (remote code the converted folder does not carry;
  the architectures written are transformers' own). Dropped.
* Every other key is kept verbatim (`kept_keys`): token ids (`bos_token_id`, `eos_token_id`,
  `pad_token_id`), `max_position_embeddings`, `use_cache`, `output_router_logits`,
  `router_jitter_noise`, `attention_dropout`, `max_window_layers`, `ep_size`, keys of other
  transformers releases. A source without `max_position_embeddings` meant transformers' default
  for its architecture (`config_formats.DEFAULTS`); the kept keys record that value.

`max_position_embeddings` is not a model key: transformers (4.57.6, 5.24.0, 5.25.0) sizes caches and
limits generation with it, and computes YaRN from `factor` and
`original_max_position_embeddings`, which the export always writes. A YaRN model without a kept
value gets original x factor, the context YaRN stretches to.

`exported_config` assembles the file: the model's keys win over kept ones (`overridden` lists
where they disagree), and a `max_position_embeddings` that neither gives is YaRN's, else
`fallback`'s, else `DEFAULT_MAX_POSITIONS`. Pure data: no files (the side file is
`model_dir.kept_config`'s).

What an export does with each ModelConfig / MoEConfig field:
* written (`config_map.hf_config`): the shape, attention, rope, norms, routing, MTP depth,
  `weight_dtype` (torch_dtype), `init_std` (initializer_range), and the loss weights the
  architecture has a key for: Mixtral's and Qwen3-MoE's `router_aux_loss_coef` is
  `moe.load_balance_coef`, DeepSeek-V3's `aux_loss_alpha` (with `seq_aux`, the keys of its
  released config.json) is `moe.seq_aux_coef`;
* refused (UnsupportedCheckpoint): what changes the forward pass and the architecture cannot
  express (shared experts in Mixtral, MTP outside DeepSeek-V3, ...);
* left out with a note (`NOTED`, `not_carried`): how the model was trained, which the file has
  no key for: `moe.load_balance_coef` in DeepSeek-V3 (transformers' DeepseekV3Config has
  neither `router_aux_loss_coef` nor `aux_loss_alpha`, and the released file's `aux_loss_alpha`
  is the sequence-wise weight), `moe.seq_aux_coef` in Mixtral and Qwen3-MoE, `moe.z_loss_coef`
  and `moe.bias_update_speed` in all three, `mtp_loss_coef` with MTP modules; and the capacity
  baseline's `moe.capacity_factor` (the three architectures are dropless in transformers);
* left out silently: how dropless runs, stores or first draws the model, which whoever loads
  the folder chooses again (attention kernel, scan layout, activation dtype, grouped-matmul
  backend and quantization recipes, dispatcher and its buffers, fused expert weights, the init
  scheme), and the fields the architecture does not use (MLA's under GQA, GQA's under MLA,
  YaRN's without YaRN, `mtp_loss_coef` without MTP modules).
"""
from __future__ import annotations

import functools
from typing import Any, Mapping

from dropless.config import ModelConfig
from dropless.hf import config_map as cm
from dropless.hf.config_formats import ALIASES, DEFAULTS, architecture
from dropless.hf.layout import Layout

DEFAULT_MAX_POSITIONS = 4096   # a model with no source and no training run to say its context

_READ = {   # read into ModelConfig, or checked against the one value implemented
    "architectures", "model_type", "vocab_size", "hidden_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
    "initializer_range", "tie_word_embeddings", "rope_theta", "rope_scaling", "rope_parameters",
    "partial_rotary_factor", "hidden_act", "attention_bias", "mlp_bias", "quantization_config",
    "torch_dtype", "num_experts_per_tok", "intermediate_size", "moe_intermediate_size",
    "router_aux_loss_coef", "norm_topk_prob", "sliding_window", "use_sliding_window",
    "num_local_experts", "num_experts", "decoder_sparse_step", "mlp_only_layers",
    "n_routed_experts", "n_shared_experts", "routed_scaling_factor", "n_group", "topk_group",
    "first_k_dense_replace", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
    "qk_rope_head_dim", "v_head_dim", "rope_interleave", "num_nextn_predict_layers",
    "scoring_func", "topk_method", "moe_layer_freq", "seq_aux"}
_DERIVED = {"qk_head_dim", "layer_types"}   # transformers computes them from the keys above
MODEL_KEYS = frozenset(_READ | _DERIVED | {k for pairs in ALIASES.values() for pair in pairs
                                           for k in pair})
WRITER_KEYS = frozenset({"transformers_version", "auto_map"})
# written from the model only where the model has it (DeepSeek's sequence-wise aux loss weight,
# when seq_aux); a kept value stands otherwise
MODEL_WHEN_SET = frozenset({"aux_loss_alpha"})


def kept_keys(hf: Mapping[str, Any], where: str = "config.json") -> dict[str, Any]:
    """The keys of the source config.json `hf` that the model does not determine, verbatim
    (module doc), plus `max_position_embeddings` = transformers' default for the architecture
    when `hf` has none. Raises what `config_formats.architecture` raises for an unsupported
    architecture."""
    out = {k: v for k, v in hf.items() if k not in MODEL_KEYS and k not in WRITER_KEYS}
    if "max_position_embeddings" not in out:
        out["max_position_embeddings"] = DEFAULTS[architecture(dict(hf), where)][
            "max_position_embeddings"]
    return out


def _model_keys(cfg: ModelConfig, rope_interleave: bool) -> dict[str, Any]:
    arch = cm.architecture_for(cfg)
    return cm.hf_config(cfg, Layout(arch, rope_interleave=rope_interleave and arch == cm.DEEPSEEK))


def exported_config(cfg: ModelConfig, kept: Mapping[str, Any] | None = None, *,
                    fallback: Mapping[str, Any] | None = None,
                    rope_interleave: bool = True) -> dict[str, Any]:
    """The config.json `hf.save` writes for `cfg`: `config_map.hf_config`'s keys, then the
    `kept` keys the model does not set, then YaRN's max_position_embeddings (original x
    factor), then `fallback`'s keys (what the folder knows better than a constant: a training
    run's `seq_len` as max_position_embeddings, the tokenizer's token ids), then
    max_position_embeddings=DEFAULT_MAX_POSITIONS if still unset. Raises
    UnsupportedCheckpoint naming the field the architecture cannot express."""
    out = _model_keys(cfg, rope_interleave)
    yarn = ({"max_position_embeddings": int(cfg.rope_original_max_position * cfg.rope_factor)}
            if cfg.rope_type == "yarn" else {})
    for extra in (kept or {}, yarn, fallback or {},
                  {"max_position_embeddings": DEFAULT_MAX_POSITIONS}):
        for key, value in extra.items():
            out.setdefault(key, value)
    return out


def overridden(cfg: ModelConfig, kept: Mapping[str, Any], *, rope_interleave: bool = True
               ) -> dict[str, tuple[Any, Any]]:
    """{key: (kept value, the model's value)} for each kept key the model writes otherwise
    (a side file edited by hand, or written by another version of dropless)."""
    model = _model_keys(cfg, rope_interleave)
    return {k: (v, model[k]) for k, v in kept.items() if k in model and model[k] != v}


_TRAINING = "a training setting; the exported model computes the same"
# dotted field -> why leaving it out keeps the exported model the one trained (module doc)
NOTED = {"moe.load_balance_coef": _TRAINING, "moe.seq_aux_coef": _TRAINING,
         "moe.z_loss_coef": _TRAINING, "moe.bias_update_speed": _TRAINING,
         "mtp_loss_coef": _TRAINING,
         "moe.capacity_factor": "the exported model is dropless: it routes every token"}


class NotCarriedWarning(UserWarning):
    """A setting of the model that the exported config.json cannot carry (`not_carried`): the
    folder holds the model's weights and architecture, without it. `hf.save` gives one per
    setting (unless it is given `announce`)."""


def _field(cfg: ModelConfig, dotted: str) -> Any:
    return functools.reduce(getattr, dotted.split("."), cfg)


def not_carried(cfg: ModelConfig) -> dict[str, Any]:
    """{dotted field: value} for the settings of `cfg` in `NOTED` that a load of the exported
    config.json reads otherwise (`config_map.model_config` of `config_map.hf_config`): the
    architecture has no key for them (module doc). `mtp_loss_coef` counts only with MTP
    modules. Empty for a dense model (which `hf.save` refuses). Raises UnsupportedCheckpoint as
    `exported_config` does."""
    if cfg.moe is None:
        return {}
    back, _ = cm.model_config(_model_keys(cfg, True), mtp_depth=cfg.mtp_depth)
    return {field: _field(cfg, field) for field in NOTED
            if _field(cfg, field) != _field(back, field)
            and (field != "mtp_loss_coef" or cfg.mtp_depth)}


def not_carried_words(cfg: ModelConfig) -> list[str]:
    """One line per setting `not_carried(cfg)` names: the field, its value, the architecture,
    and why the exported model is still the one trained."""
    arch = cm.architecture_for(cfg)
    return [f"{field}={value!r} is not written: {arch}'s config.json cannot carry it "
            f"({NOTED[field]})" for field, value in not_carried(cfg).items()]


__all__ = ["MODEL_KEYS", "WRITER_KEYS", "MODEL_WHEN_SET", "DEFAULT_MAX_POSITIONS", "kept_keys",
           "exported_config", "overridden", "NOTED", "NotCarriedWarning", "not_carried",
           "not_carried_words"]
