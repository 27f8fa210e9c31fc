"""Hugging Face `config.json` <-> our ModelConfig for DeepseekV3ForCausalLM, MixtralForCausalLM
and Qwen3MoeForCausalLM.

Every config key that changes the math is either mapped or refused with an error naming the key
and its value (sliding windows, attention biases, other activations, other rope scalings, other
quantizations, `moe_layer_freq` != 1, ...). Keys that do not change the forward pass (token ids,
`initializer_range`, `use_cache`, `max_position_embeddings`, `ep_size`, ...) are not read.
Training-only coefficients map to our MoE loss weights: DeepSeek's `aux_loss_alpha` (when
`seq_aux`) -> seq_aux_coef, Mixtral/Qwen3's `router_aux_loss_coef` -> load_balance_coef.
"""
from __future__ import annotations

from typing import Any

from dropless.config import ModelConfig, MoEConfig
from dropless.hf.layout import Layout

DEEPSEEK, MIXTRAL, QWEN3 = "DeepseekV3ForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM"
ARCHITECTURES = (DEEPSEEK, MIXTRAL, QWEN3)
MODEL_TYPES = {DEEPSEEK: "deepseek_v3", MIXTRAL: "mixtral", QWEN3: "qwen3_moe"}
YARN_KEYS = {"type", "rope_type", "factor", "original_max_position_embeddings", "beta_fast",
             "beta_slow", "mscale", "mscale_all_dim", "truncate", "attention_factor"}
FP8_BLOCK = (128, 128)


class UnsupportedCheckpoint(ValueError):
    """A checkpoint (or a config to save) uses a feature we do not implement."""


def _bad(key: str, value: Any, why: str) -> UnsupportedCheckpoint:
    return UnsupportedCheckpoint(f"config.json: {key}={value!r} {why}")


def architecture(hf: dict) -> str:
    """The one supported architecture named in `architectures`; raises naming the value."""
    archs = hf.get("architectures") or []
    known = [a for a in archs if a in ARCHITECTURES]
    if len(archs) != 1 or not known:
        raise _bad("architectures", archs, f"must name one of {ARCHITECTURES}")
    return known[0]


def _rope(hf: dict) -> dict[str, Any]:
    rs = hf.get("rope_scaling")
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        raise _bad("partial_rotary_factor", hf["partial_rotary_factor"], "is not supported")
    out: dict[str, Any] = {"rope_theta": float(hf.get("rope_theta", 10000.0))}
    if rs is None:
        return out
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return out
    if kind != "yarn":
        raise _bad("rope_scaling.type", kind, "is not supported (only yarn and none)")
    for key in sorted(set(rs) - YARN_KEYS):
        raise _bad(f"rope_scaling.{key}", rs[key], "is not a yarn key we implement")
    if rs.get("attention_factor") is not None:
        raise _bad("rope_scaling.attention_factor", rs["attention_factor"],
                   "is not supported (the factor is derived from mscale/mscale_all_dim)")
    if rs.get("truncate", True) is not True:
        raise _bad("rope_scaling.truncate", rs["truncate"], "is not supported (only true)")
    out.update(rope_type="yarn", rope_factor=float(rs["factor"]),
               rope_original_max_position=int(rs.get("original_max_position_embeddings")
                                               or hf["max_position_embeddings"]),
               rope_beta_fast=float(rs.get("beta_fast") or 32),
               rope_beta_slow=float(rs.get("beta_slow") or 1),
               rope_mscale=float(rs.get("mscale") or 0), 
               rope_mscale_all_dim=float(rs.get("mscale_all_dim") or 0))
    return out


def _common_checks(hf: dict) -> None:
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise _bad("hidden_act", act, "is not supported (only silu / SwiGLU)")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise _bad(key, hf[key], "is not supported (no biases in our projections)")
    q = hf.get("quantization_config")
    if q is not None:
        ok = (q.get("quant_method") == "fp8" and q.get("fmt", "e4m3") == "e4m3"
              and tuple(q.get("weight_block_size") or ()) == FP8_BLOCK)
        if not ok:
            raise _bad("quantization_config", q, "is not supported (only fp8 e4m3 with "
                       "128x128 weight_block_size, dequantized on load)")


def _dtypes(hf: dict, dtype: str | None) -> dict[str, str]:
    if dtype is None:
        dtype = hf.get("torch_dtype") or hf.get("dtype") or "float32"
        if hf.get("quantization_config") is not None:
            dtype = "bfloat16"
    return {"dtype": dtype, "weight_dtype": dtype}


def _moe_common(hf: dict, d: int, dt: dict, **kw) -> MoEConfig:
    return MoEConfig(num_experts=kw.pop("num_experts"), top_k=int(hf["num_experts_per_tok"]),
                     d_model=d, dtype=dt["dtype"], weight_dtype=dt["weight_dtype"], **kw)


def model_config(hf: dict, *, dtype: str | None = None, mtp_depth: int = 0
                 ) -> tuple[ModelConfig, Layout]:
    """(ModelConfig, Layout) for a Hugging Face config dict. `dtype` overrides the checkpoint's
    (`torch_dtype`; bfloat16 for FP8 checkpoints). Raises UnsupportedCheckpoint naming the key."""
    arch = architecture(hf)
    _common_checks(hf)
    dt = _dtypes(hf, dtype)
    d = int(hf["hidden_size"])
    base = dict(vocab_size=int(hf["vocab_size"]), d_model=d, num_layers=int(hf["num_hidden_layers"]),
                num_heads=int(hf["num_attention_heads"]), norm_eps=float(hf["rms_norm_eps"]),
                tie_embeddings=bool(hf.get("tie_word_embeddings", False)), **_rope(hf), **dt)
    if arch == DEEPSEEK:
        return _deepseek(hf, base, dt, mtp_depth), Layout(
            arch, rope_interleave=bool(hf.get("rope_interleave", True)))
    if mtp_depth:
        raise _bad("num_nextn_predict_layers", mtp_depth, f"MTP exists only in {DEEPSEEK}")
    if hf.get("sliding_window") is not None and (arch == MIXTRAL or hf.get("use_sliding_window")):
        raise _bad("sliding_window", hf["sliding_window"], "is not supported (full attention)")
    base.update(attention="mha", num_kv_heads=int(hf.get("num_key_value_heads") or 0),
                head_dim=int(hf.get("head_dim") or 0))
    if arch == MIXTRAL:
        f = int(hf["intermediate_size"])
        moe = _moe_common(hf, d, dt, num_experts=int(hf["num_local_experts"]), d_ff=f,
                          score_func="softmax", norm_topk_prob=True,
                          load_balance_coef=float(hf.get("router_aux_loss_coef", 0.0)))
        return ModelConfig(d_ff=f, moe=moe, **base), Layout(arch)
    n = base["num_layers"]
    step = int(hf.get("decoder_sparse_step", 1))
    dense_only = set(hf.get("mlp_only_layers") or [])
    if step <= 0:
        raise _bad("decoder_sparse_step", step, "must be >= 1")
    if dense_only - set(range(n)):
        raise _bad("mlp_only_layers", sorted(dense_only), f"must be layer indices < {n}")
    num_experts = int(hf.get("num_experts", 0))
    pattern = "".join("M" if num_experts and i not in dense_only and (i + 1) % step == 0
                      else "D" for i in range(n))
    moe = None if "M" not in pattern else _moe_common(
        hf, d, dt, num_experts=num_experts, d_ff=int(hf["moe_intermediate_size"]),
        score_func="softmax", norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        load_balance_coef=float(hf.get("router_aux_loss_coef", 0.0)))
    k = len(pattern) - len(pattern.lstrip("D"))
    prefix = moe is None or pattern == "D" * k + "M" * (n - k)   # say it the simple way
    return ModelConfig(d_ff=int(hf["intermediate_size"]), qk_norm=True, moe=moe,
                       first_k_dense=k if prefix and moe else 0,
                       layer_pattern="" if prefix else pattern, **base), Layout(arch)


def _deepseek(hf: dict, base: dict, dt: dict, mtp_depth: int) -> ModelConfig:
    for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"),
                      ("moe_layer_freq", 1)):
        if key in hf and hf[key] != want:
            raise _bad(key, hf[key], f"is not supported (only {want!r})")
    moe = _moe_common(
        hf, base["d_model"], dt, num_experts=int(hf["n_routed_experts"]),
        d_ff=int(hf["moe_intermediate_size"]), num_shared_experts=int(hf.get("n_shared_experts")
                                                                      or 0),
        score_func="sigmoid", norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        n_groups=int(hf.get("n_group") or 1), topk_groups=int(hf.get("topk_group") or 1),
        seq_aux_coef=float(hf.get("aux_loss_alpha", 0.0)) if hf.get("seq_aux") else 0.0)
    return ModelConfig(
        d_ff=int(hf["intermediate_size"]), attention="mla",
        first_k_dense=int(hf.get("first_k_dense_replace", 0)), moe=moe,
        q_lora_rank=int(hf.get("q_lora_rank") or 0), kv_lora_rank=int(hf["kv_lora_rank"]),
        qk_nope_head_dim=int(hf["qk_nope_head_dim"]), qk_rope_head_dim=int(hf["qk_rope_head_dim"]),
        v_head_dim=int(hf["v_head_dim"]), mla_norm_eps=1e-6, mtp_depth=mtp_depth, **base)


def _save_bad(field: str, value: Any, arch: str, why: str) -> UnsupportedCheckpoint:
    return UnsupportedCheckpoint(f"ModelConfig.{field}={value!r} cannot be saved as {arch}: {why}")


def architecture_for(cfg: ModelConfig) -> str:
    """The HF architecture that holds `cfg`: MLA -> DeepSeek-V3, GQA with qk-norm -> Qwen3-MoE,
    GQA without -> Mixtral."""
    if cfg.attention == "mla":
        return DEEPSEEK
    return QWEN3 if cfg.qk_norm else MIXTRAL


def _rope_dict(cfg: ModelConfig) -> dict | None:
    if cfg.rope_type != "yarn":
        return None
    out = {"type": "yarn", "factor": cfg.rope_factor,
           "original_max_position_embeddings": cfg.rope_original_max_position,
           "beta_fast": cfg.rope_beta_fast, "beta_slow": cfg.rope_beta_slow}
    if cfg.rope_mscale:
        out["mscale"] = cfg.rope_mscale
    if cfg.rope_mscale_all_dim:
        out["mscale_all_dim"] = cfg.rope_mscale_all_dim
    return out


def _check_softmax_moe(cfg: ModelConfig, arch: str) -> None:
    moe = cfg.moe
    for field, value, want in (("moe.score_func", moe.score_func, "softmax"),
                               ("moe.routed_scaling_factor", moe.routed_scaling_factor, 1.0),
                               ("moe.num_shared_experts", moe.num_shared_experts, 0),
                               ("moe.n_groups", moe.n_groups, 1)):
        if value != want:
            raise _save_bad(field, value, arch, f"it only has {want!r}")


def hf_config(cfg: ModelConfig, lay: Layout) -> dict[str, Any]:
    """The config.json that `transformers` needs for `cfg`; raises UnsupportedCheckpoint naming
    the field the architecture cannot express."""
    arch = lay.arch
    if cfg.moe is None:
        raise _save_bad("moe", None, arch, "dense models are not one of the MoE architectures")
    if cfg.mla_norm_eps != 1e-6 and arch == DEEPSEEK:
        raise _save_bad("mla_norm_eps", cfg.mla_norm_eps, arch, "transformers fixes 1e-6")
    moe = cfg.moe
    out: dict[str, Any] = {
        "architectures": [arch], "model_type": MODEL_TYPES[arch], "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": _rope_dict(cfg), "hidden_act": "silu",
        "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": cfg.weight_dtype,
        "attention_bias": False, "num_experts_per_tok": moe.top_k,
        "max_position_embeddings": int(cfg.rope_original_max_position * cfg.rope_factor)
        if cfg.rope_type == "yarn" else 4096}
    if arch == DEEPSEEK:
        pattern = "".join("M" if cfg.is_moe_layer(i) else "D" for i in range(cfg.num_layers))
        k = pattern.count("D")
        if pattern != "D" * k + "M" * (cfg.num_layers - k):
            raise _save_bad("layer_pattern", pattern, arch, "only a dense prefix "
                            "(first_k_dense_replace) is expressible")
        if moe.score_func != "sigmoid":
            raise _save_bad("moe.score_func", moe.score_func, arch, "it routes with sigmoid")
        out.update(intermediate_size=cfg.d_ff, moe_intermediate_size=moe.d_ff,
                   first_k_dense_replace=k, n_routed_experts=moe.num_experts,
                   n_shared_experts=moe.num_shared_experts, norm_topk_prob=moe.norm_topk_prob,
                   routed_scaling_factor=moe.routed_scaling_factor, n_group=moe.n_groups,
                   topk_group=moe.topk_groups, q_lora_rank=cfg.q_lora_rank or None,
                   kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
                   qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
                   num_key_value_heads=cfg.num_heads, rope_interleave=lay.rope_interleave,
                   num_nextn_predict_layers=cfg.mtp_depth, scoring_func="sigmoid",
                   topk_method="noaux_tc", moe_layer_freq=1)
        return out
    _check_softmax_moe(cfg, arch)
    out.update(num_key_value_heads=cfg.kv_heads, head_dim=cfg.mha_head_dim)
    if cfg.mtp_depth:
        raise _save_bad("mtp_depth", cfg.mtp_depth, arch, "only DeepSeek-V3 has MTP modules")
    if arch == MIXTRAL:
        if cfg.num_moe_layers != cfg.num_layers:
            raise _save_bad("layer_pattern", cfg.layer_pattern or cfg.first_k_dense, arch,
                            "every Mixtral layer is MoE")
        if not moe.norm_topk_prob:
            raise _save_bad("moe.norm_topk_prob", False, arch, "Mixtral always renormalises")
        if cfg.d_ff != moe.d_ff:
            raise _save_bad("d_ff", cfg.d_ff, arch, f"must equal moe.d_ff={moe.d_ff} "
                            "(one intermediate_size)")
        out.update(intermediate_size=moe.d_ff, num_local_experts=moe.num_experts,
                   sliding_window=None, router_aux_loss_coef=moe.load_balance_coef)
        return out
    dense = [i for i in range(cfg.num_layers) if not cfg.is_moe_layer(i)]
    out.update(intermediate_size=cfg.d_ff, moe_intermediate_size=moe.d_ff,
               num_experts=moe.num_experts, norm_topk_prob=moe.norm_topk_prob,
               decoder_sparse_step=1, mlp_only_layers=dense, use_sliding_window=False,
               sliding_window=None, router_aux_loss_coef=moe.load_balance_coef)
    return out
