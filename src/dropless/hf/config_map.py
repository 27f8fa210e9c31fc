"""Hugging Face `config.json` <-> our ModelConfig for DeepseekV3ForCausalLM, MixtralForCausalLM
and Qwen3MoeForCausalLM.

Every config key that changes the math is either mapped or refused with an error naming the key
and its value (sliding windows, attention biases, other activations, other rope scalings, other
quantizations, `moe_layer_freq` != 1, ...). Keys that do not change the forward pass (token ids,
`use_cache`, `max_position_embeddings`, `ep_size`, ...) are not read (`hf.round_trip` keeps them
for the way back); `initializer_range` (0.02 when absent) is `init_std`, the std of init scheme
"normal".
Training-only coefficients map to our MoE loss weights: DeepSeek's `aux_loss_alpha` (when
`seq_aux`) -> seq_aux_coef, Mixtral/Qwen3's `router_aux_loss_coef` -> load_balance_coef.
"""
from __future__ import annotations

from typing import Any

from dropless.config import ModelConfig, MoEConfig
from dropless.config.names import MODEL_DTYPES
from dropless.hf.config_formats import (ARCHITECTURES, DEEPSEEK, MIXTRAL, MODEL_TYPES,  # noqa: F401
                                        QWEN3, BadConfig, Fields, UnsupportedCheckpoint,
                                        architecture, canonical)
from dropless.hf.layout import Layout

# The yarn rope-scaling dict, once for both directions (read: `_rope`, written: `_yarn_dict`):
# HF key, ModelConfig field, the value an absent (or zero) key means, and whether it is written
# when it has that value. original_max_position_embeddings is read by `_rope` itself (absent, it
# is max_position_embeddings, and it must be an integer).
YARN_FIELDS = (("factor", "rope_factor", 1.0, True),
               ("original_max_position_embeddings", "rope_original_max_position", None, True),
               ("beta_fast", "rope_beta_fast", 32.0, True),
               ("beta_slow", "rope_beta_slow", 1.0, True),
               ("mscale", "rope_mscale", 0.0, False),
               ("mscale_all_dim", "rope_mscale_all_dim", 0.0, False))
YARN_KEYS = {"type", "rope_type", "truncate", "attention_factor"} | {k for k, *_ in YARN_FIELDS}
FP8_BLOCK = (128, 128)
DTYPES = MODEL_DTYPES   # what a model may hold (config.names); config.json says torch_dtype


def _bad(f: Fields, key: str, value: Any, why: str) -> UnsupportedCheckpoint:
    return UnsupportedCheckpoint(f"{f.where}: {key}={value!r} {why}")


def _yarn_number(f: Fields, rs: dict, key: str, default: float, *, positive: bool = False
                 ) -> float:
    v = rs.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (positive and v <= 0):
        raise BadConfig(f"{f.where}: rope_scaling.{key}={v!r} must be a "
                        f"{'positive ' if positive else ''}number")
    return float(v)


def _rope(f: Fields) -> dict[str, Any]:
    """RoPE settings from a canonical config (rope_theta + rope_scaling, see config_formats)."""
    prf = f.get("partial_rotary_factor", 1.0)
    if prf != 1.0:
        raise _bad(f, "partial_rotary_factor", prf, "is not supported")
    out: dict[str, Any] = {"rope_theta": f.float("rope_theta", positive=True)}
    rs = f.hf.get("rope_scaling")
    if rs is None:
        return out
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return out
    if kind != "yarn":
        raise _bad(f, "rope_scaling.type", kind, "is not supported (only yarn and none)")
    for key in sorted(set(rs) - YARN_KEYS):
        raise _bad(f, f"rope_scaling.{key}", rs[key], "is not a yarn key we implement")
    if rs.get("attention_factor") is not None:
        raise _bad(f, "rope_scaling.attention_factor", rs["attention_factor"],
                   "is not supported (the factor is derived from mscale/mscale_all_dim)")
    if rs.get("truncate", True) is not True:
        raise _bad(f, "rope_scaling.truncate", rs["truncate"], "is not supported (only true)")
    if rs.get("factor") is None:
        raise BadConfig(f"{f.where}: rope_scaling.factor is missing (a yarn rope_scaling needs "
                        "the context extension factor, e.g. 40)")
    orig = rs.get("original_max_position_embeddings")
    if orig is None:
        orig = f.int("max_position_embeddings")
    elif isinstance(orig, bool) or not isinstance(orig, int) or orig < 1:
        raise BadConfig(f"{f.where}: rope_scaling.original_max_position_embeddings={orig!r} "
                        "must be an integer >= 1")
    out.update(rope_type="yarn", rope_original_max_position=orig)
    for key, field, default, _ in YARN_FIELDS:
        if default is not None:
            out[field] = _yarn_number(f, rs, key, default, positive=key == "factor") or default
    return out


def _common_checks(f: Fields) -> None:
    act = f.get("hidden_act")
    if act != "silu":
        raise _bad(f, "hidden_act", act, "is not supported (only silu / SwiGLU)")
    for key in ("attention_bias", "mlp_bias"):
        if f.get(key, False):
            raise _bad(f, key, f.hf[key], "is not supported (no biases in our projections)")
    q = f.hf.get("quantization_config")
    if q is not None:
        ok = (isinstance(q, dict) and q.get("quant_method") == "fp8"
              and q.get("fmt", "e4m3") == "e4m3"
              and tuple(q.get("weight_block_size") or ()) == FP8_BLOCK)
        if not ok:
            raise _bad(f, "quantization_config", q, "is not supported (only fp8 e4m3 with "
                       "128x128 weight_block_size, dequantized on load)")


def model_dtype(value: str) -> str:
    """The name of a parameter/activation dtype asked for (`--dtype`, `hf.load(dtype=)`):
    'float32', 'bfloat16' or 'float16' (numpy's spellings accepted: 'f4', 'half'). Raises
    ValueError for any other: float64 would silently run as float32 (JAX without
    jax_enable_x64) while the config said float64, and no architecture here stores it."""
    import ml_dtypes  # noqa: F401 - registers bfloat16 with numpy
    import numpy as np
    try:
        name = np.dtype(value).name
    except TypeError:
        name = None
    if name not in DTYPES:
        raise ValueError(f"dtype={value!r} is not a model dtype (one of {', '.join(DTYPES)}"
                         f"{'; float64 runs as float32 in JAX' if name == 'float64' else ''})")
    return name


def _dtypes(f: Fields, dtype: str | None) -> dict[str, str]:
    if dtype is not None:
        dtype = model_dtype(dtype)
    if dtype is None:
        dtype = f.get("torch_dtype", None) or "float32"   # canonical: `dtype` folded in
        if dtype not in DTYPES:
            raise BadConfig(f"{f.where}: torch_dtype/dtype={dtype!r} must be one of {DTYPES}")
        if f.hf.get("quantization_config") is not None:
            dtype = "bfloat16"
    return {"dtype": dtype, "weight_dtype": dtype}


def _moe_common(f: Fields, d: int, dt: dict, **kw) -> MoEConfig:
    return MoEConfig(num_experts=kw.pop("num_experts"), top_k=f.int("num_experts_per_tok"),
                     d_model=d, dtype=dt["dtype"], weight_dtype=dt["weight_dtype"], **kw)


def model_config(hf: dict, *, dtype: str | None = None, mtp_depth: int = 0,
                 where: str = "config.json") -> tuple[ModelConfig, Layout]:
    """(ModelConfig, Layout) for a Hugging Face config dict in either transformers format
    (4.x or 5.x, see config_formats). `dtype` overrides the checkpoint's (`torch_dtype`/`dtype`;
    bfloat16 for FP8 checkpoints). `where` names the file in errors. Raises
    UnsupportedCheckpoint naming a key we do not implement, BadConfig naming a missing key, a
    value of the wrong type, two contradicting keys, or keys that together describe no model
    (ModelConfig's own checks, said with config.json's keys and values); ValueError for a
    `dtype` no model holds (`model_dtype`)."""
    hf = canonical(hf, where)
    arch = hf["architectures"][0]
    try:
        return _model_config(Fields(hf, arch, where), dtype, mtp_depth)
    except (BadConfig, UnsupportedCheckpoint):
        raise
    except ValueError as e:   # ModelConfig's own checks: said in config.json's keys
        if not str(e).startswith(("ModelConfig.", "MoEConfig.")):
            raise
        keys = _keys_of(str(e), hf, arch)
        raise BadConfig(f"{where}: {', '.join(keys) or 'its keys'} "
                        f"{'does' if len(keys) == 1 else 'do'} not describe a valid model ({e}); "
                        "correct config.json") from None


# Which config.json key sets each field ModelConfig / MoEConfig check against others, to say
# their errors in config.json's words (canonical key names; the expert count's key, and
# Mixtral's expert hidden size, depend on the architecture: `_keys_of`).
_MODEL_KEYS = {"vocab_size": "vocab_size", "d_model": "hidden_size",
               "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
               "num_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
               "d_ff": "intermediate_size", "first_k_dense": "first_k_dense_replace",
               "norm_eps": "rms_norm_eps", "rope_theta": "rope_theta",
               "init_std": "initializer_range", "q_lora_rank": "q_lora_rank",
               "kv_lora_rank": "kv_lora_rank", "qk_nope_head_dim": "qk_nope_head_dim",
               "qk_rope_head_dim": "qk_rope_head_dim", "v_head_dim": "v_head_dim",
               **{field: f"rope_scaling.{key}" for key, field, *_ in YARN_FIELDS}}
_MOE_KEYS = {"top_k": "num_experts_per_tok", "d_ff": "moe_intermediate_size",
             "n_groups": "n_group", "topk_groups": "topk_group",
             "num_shared_experts": "n_shared_experts",
             "routed_scaling_factor": "routed_scaling_factor",
             "load_balance_coef": "router_aux_loss_coef", "seq_aux_coef": "aux_loss_alpha"}
_EXPERTS_KEY = {DEEPSEEK: "n_routed_experts", MIXTRAL: "num_local_experts", QWEN3: "num_experts"}


def _keys_of(message: str, hf: dict, arch: str) -> list[str]:
    """['num_experts_per_tok=8', 'num_local_experts=4'] for a ModelConfig / MoEConfig error
    naming fields top_k and num_experts: the config.json keys (and values) behind them."""
    import re
    table = _MODEL_KEYS if message.startswith("ModelConfig.") else {
        **_MOE_KEYS, "num_experts": _EXPERTS_KEY[arch],
        **({"d_ff": "intermediate_size"} if arch == MIXTRAL else {})}
    keys = dict.fromkeys(table[w] for w in re.findall(r"\b(\w+)=", message) if w in table)
    found = []
    for key in keys:
        head, _, tail = key.partition(".")
        value = hf.get(head) if not tail else (hf.get(head) or {}).get(tail)
        found.append(f"{key}={value!r}")
    return found


def _model_config(f: Fields, dtype: str | None, mtp_depth: int) -> tuple[ModelConfig, Layout]:
    hf, arch = f.hf, f.arch
    _common_checks(f)
    dt = _dtypes(f, dtype)
    d = f.int("hidden_size")
    base = dict(vocab_size=f.int("vocab_size"), d_model=d, num_layers=f.int("num_hidden_layers"),
                num_heads=f.int("num_attention_heads"),
                norm_eps=f.float("rms_norm_eps", positive=True),
                init_std=f.float("initializer_range", 0.02, positive=True),
                tie_embeddings=f.bool("tie_word_embeddings"), **_rope(f), **dt)
    if arch == DEEPSEEK:
        return _deepseek(f, base, dt, mtp_depth), Layout(
            arch, rope_interleave=f.bool("rope_interleave"))
    if mtp_depth:
        raise _bad(f, "num_nextn_predict_layers", mtp_depth, f"MTP exists only in {DEEPSEEK}")
    window = f.int("sliding_window", nullable=True)
    if window is not None and (arch == MIXTRAL or f.bool("use_sliding_window")):
        raise _bad(f, "sliding_window", window, "is not supported (full attention)")
    base.update(attention="mha", num_kv_heads=f.int("num_key_value_heads", nullable=True) or 0,
                head_dim=f.int("head_dim", nullable=True) or 0)
    if arch == MIXTRAL:
        ff = f.int("intermediate_size")
        moe = _moe_common(f, d, dt, num_experts=f.int("num_local_experts"), d_ff=ff,
                          score_func="softmax", norm_topk_prob=True,
                          load_balance_coef=f.float("router_aux_loss_coef"))
        return ModelConfig(d_ff=ff, moe=moe, **base), Layout(arch)
    return _qwen3(f, base, dt), Layout(arch)


def _qwen3(f: Fields, base: dict, dt: dict) -> ModelConfig:
    n = base["num_layers"]
    step = f.int("decoder_sparse_step")
    dense_only = set(f.int_list("mlp_only_layers"))
    if dense_only - set(range(n)):
        raise _bad(f, "mlp_only_layers", sorted(dense_only), f"must be layer indices < {n}")
    num_experts = f.int("num_experts", low=0)
    pattern = "".join("M" if num_experts and i not in dense_only and (i + 1) % step == 0
                      else "D" for i in range(n))
    moe = None if "M" not in pattern else _moe_common(
        f, base["d_model"], dt, num_experts=num_experts, d_ff=f.int("moe_intermediate_size"),
        score_func="softmax", norm_topk_prob=f.bool("norm_topk_prob"),
        load_balance_coef=f.float("router_aux_loss_coef"))
    k = len(pattern) - len(pattern.lstrip("D"))
    prefix = moe is None or pattern == "D" * k + "M" * (n - k)   # say it the simple way
    return ModelConfig(d_ff=f.int("intermediate_size"), qk_norm=True, moe=moe,
                       first_k_dense=k if prefix and moe else 0,
                       layer_pattern="" if prefix else pattern, **base)


def _deepseek(f: Fields, base: dict, dt: dict, mtp_depth: int) -> ModelConfig:
    for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"),
                      ("moe_layer_freq", 1)):
        if key in f.hf and f.hf[key] != want:
            raise _bad(f, key, f.hf[key], f"is not supported (only {want!r})")
    seq_aux = f.bool("seq_aux", False)
    moe = _moe_common(
        f, base["d_model"], dt, num_experts=f.int("n_routed_experts"),
        d_ff=f.int("moe_intermediate_size"),
        num_shared_experts=f.int("n_shared_experts", nullable=True, low=0) or 0,
        score_func="sigmoid", norm_topk_prob=f.bool("norm_topk_prob"),
        routed_scaling_factor=f.float("routed_scaling_factor", positive=True),
        n_groups=f.int("n_group"), topk_groups=f.int("topk_group"),
        seq_aux_coef=f.float("aux_loss_alpha", 0.0) if seq_aux else 0.0)
    return ModelConfig(
        d_ff=f.int("intermediate_size"), attention="mla",
        first_k_dense=f.int("first_k_dense_replace", low=0), moe=moe,
        q_lora_rank=f.int("q_lora_rank", nullable=True) or 0,
        kv_lora_rank=f.int("kv_lora_rank"), qk_nope_head_dim=f.int("qk_nope_head_dim"),
        qk_rope_head_dim=f.int("qk_rope_head_dim"), v_head_dim=f.int("v_head_dim"),
        mla_norm_eps=1e-6, mtp_depth=mtp_depth, **base)


def _save_bad(field: str, value: Any, arch: str, why: str) -> UnsupportedCheckpoint:
    return UnsupportedCheckpoint(f"ModelConfig.{field}={value!r} cannot be saved as {arch}: {why}")


def architecture_for(cfg: ModelConfig) -> str:
    """The HF architecture that holds `cfg`: MLA -> DeepSeek-V3, GQA with qk-norm -> Qwen3-MoE,
    GQA without -> Mixtral."""
    if cfg.attention == "mla":
        return DEEPSEEK
    return QWEN3 if cfg.qk_norm else MIXTRAL


def _yarn_dict(cfg: ModelConfig) -> dict | None:
    """The rope_scaling dict of `cfg` (None for plain RoPE), by `YARN_FIELDS`."""
    if cfg.rope_type != "yarn":
        return None
    out: dict[str, Any] = {"type": "yarn"}
    for key, field, default, always in YARN_FIELDS:
        if always or getattr(cfg, field) != default:
            out[key] = getattr(cfg, field)
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
    """The config.json keys `cfg` determines (`hf.round_trip.MODEL_KEYS`); the file `hf.save`
    writes adds the keys kept from the source and `max_position_embeddings`
    (`hf.round_trip.exported_config`). Raises UnsupportedCheckpoint naming the field the
    architecture cannot express."""
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
        "rope_theta": cfg.rope_theta, "rope_scaling": _yarn_dict(cfg), "hidden_act": "silu",
        "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": cfg.weight_dtype,
        "attention_bias": False, "num_experts_per_tok": moe.top_k,
        "initializer_range": cfg.init_std}
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
                   topk_method="noaux_tc", moe_layer_freq=1, seq_aux=moe.seq_aux_coef != 0)
        if moe.seq_aux_coef:
            out["aux_loss_alpha"] = moe.seq_aux_coef
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
