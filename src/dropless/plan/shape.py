"""Parameter counts of a model for planning, read from the trainer's `ModelConfig` (the one
description of a model's shape: the planner keeps no copy of it). Pure arithmetic, no arrays.

Legend: V vocab, D model dim, L layers, H query heads, G key/value heads, Kh head dim,
Qr q low-rank dim, Lkv kv low-rank dim, N no-rope (content) qk dims, R rope dims, Vh value head
dim, E routed experts, K top-k, F expert hidden dim (`moe.d_ff`), Fd dense hidden dim (`d_ff`),
S shared experts.

Which layers are MoE is asked of `ModelConfig.is_moe_layer(i)` only, so any dense/MoE pattern
the config describes (a dense prefix, Qwen3-MoE's sparse step) is planned as it is trained.
`model_config(...)` builds a ModelConfig from the flat names the planner's command line accepts
(`num_experts`, `top_k`, `moe_d_ff` ... next to the ModelConfig fields).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from dropless.config import ModelConfig, MoEConfig

# flat planner names of MoEConfig fields (command line, --config files) -> MoEConfig field
MOE_KEYS = {"num_experts": "num_experts", "top_k": "top_k", "moe_d_ff": "d_ff",
            "num_shared_experts": "num_shared_experts", "n_groups": "n_groups",
            "topk_groups": "topk_groups"}
MODEL_KEYS = tuple(f.name for f in dataclasses.fields(ModelConfig) if f.name != "moe")


def num_moe_layers(s: ModelConfig) -> int:
    """Decoder layers with an MoE feed-forward (MTP modules not included)."""
    return sum(s.is_moe_layer(i) for i in range(s.num_layers))


def num_dense_layers(s: ModelConfig) -> int:
    return s.num_layers - num_moe_layers(s)


def model_config(base: ModelConfig | None = None, **changes: Any) -> ModelConfig:
    """A ModelConfig from `base` (or from scratch) with `changes` by ModelConfig field names or
    the flat MoE names of MOE_KEYS. `num_experts=0` removes the MoE layers; MoE names on a
    model without them need `num_experts`, `top_k` and `moe_d_ff`. `d_model` reaches the MoE
    config too. Raises ValueError naming an unknown key or (from the configs) a bad value."""
    moe_changes = {MOE_KEYS[k]: changes.pop(k) for k in list(changes) if k in MOE_KEYS}
    unknown = sorted(set(changes) - set(MODEL_KEYS))
    if unknown:
        raise ValueError(f"{unknown[0]!r} is not a model setting; known: "
                         f"{sorted([*MODEL_KEYS, *MOE_KEYS])}")
    moe = base.moe if base is not None else None
    if "d_model" in changes and (moe is not None or moe_changes):
        moe_changes.setdefault("d_model", changes["d_model"])
    if moe_changes.get("num_experts", None) == 0:
        moe = None
    elif moe_changes:
        if moe is None:
            missing = [k for k, f in MOE_KEYS.items() if f in ("num_experts", "top_k", "d_ff")
                       and f not in moe_changes]
            if missing:
                raise ValueError(f"the model has no MoE layers: give {missing} with "
                                 f"{sorted(k for k, f in MOE_KEYS.items() if f in moe_changes)}")
            d_model = changes.get("d_model", base.d_model if base is not None else None)
            moe = MoEConfig(**{"d_model": d_model, **moe_changes})
        else:
            moe = moe.replace(**moe_changes)
    if base is None:
        return ModelConfig(moe=moe, **changes)
    return base.replace(moe=moe, **changes)


# ---- parameter counts (per layer, per component) ------------------------------------------

def attention_params(s: ModelConfig) -> dict[str, int]:
    """Weights of one attention block by projection (norm weights included)."""
    d, h = s.d_model, s.num_heads
    if s.attention == "mha":
        kh, g = s.mha_head_dim, s.kv_heads
        p = {"query": d * h * kh, "key": d * g * kh, "value": d * g * kh, "out": h * kh * d}
        if s.qk_norm:
            p["qk_norm"] = 2 * kh
        return p
    n, r, vh, lkv, qr = (s.qk_nope_head_dim, s.qk_rope_head_dim, s.v_head_dim, s.kv_lora_rank,
                         s.q_lora_rank)
    p = ({"q_down": d * qr + qr, "query": qr * h * (n + r)} if qr
         else {"query": d * h * (n + r)})
    p.update(kv_down=d * (lkv + r) + lkv, key=lkv * h * n, value=lkv * h * vh, out=h * vh * d)
    return p


def layer_params(s: ModelConfig, moe: bool) -> dict[str, int]:
    """Weights of one decoder layer: attention, two norms, and a dense or MoE feed-forward."""
    p = {"attention": sum(attention_params(s).values()), "norms": 2 * s.d_model}
    if moe:
        m = s.moe
        p["experts"] = m.num_experts * 3 * s.d_model * m.d_ff
        p["shared"] = m.num_shared_experts * 3 * s.d_model * m.d_ff
        p["router"] = s.d_model * m.num_experts + m.num_experts   # weights + selection bias
    else:
        p["dense_mlp"] = 3 * s.d_model * s.d_ff
    return p


def _mtp_module_params(s: ModelConfig) -> int:
    """One DeepSeek-V3 MTP module: three norms (embedding, hidden, output), a 2D->D
    projection, and one (MoE) layer; the output head is shared with the main model."""
    return (3 * s.d_model + 2 * s.d_model * s.d_model
            + sum(layer_params(s, s.moe is not None).values()))


def param_counts(s: ModelConfig) -> dict[str, int]:
    """Total and per-token active parameters, the main model and the MTP modules separately.

    `total`/`active` exclude MTP modules (the published 671B / 37B of DeepSeek-V3 do too);
    `total_with_mtp` adds them. Active counts the top_k routed experts, shared experts, router,
    attention, dense layers, the embedding and the output head.
    """
    emb = s.vocab_size * s.d_model
    head = 0 if s.tie_embeddings else emb
    dense_layer = sum(layer_params(s, False).values())
    total = emb + head + s.d_model + num_dense_layers(s) * dense_layer
    active = total
    expert_params = 0
    n_moe = num_moe_layers(s)
    if n_moe:
        moe_layer = layer_params(s, True)
        total += n_moe * sum(moe_layer.values())
        act_layer = sum(moe_layer.values()) - moe_layer["experts"]
        act_layer += s.moe.top_k * 3 * s.d_model * s.moe.d_ff
        active += n_moe * act_layer
        expert_params = n_moe * moe_layer["experts"]
    mtp = s.mtp_depth * _mtp_module_params(s)
    return {"total": total, "active": active, "embedding": emb, "head": head,
            "routed_experts": expert_params, "non_expert": total - expert_params,
            "mtp": mtp, "total_with_mtp": total + mtp}
