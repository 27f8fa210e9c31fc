"""A model's shape for planning, and its parameter counts. Pure Python: no JAX, no arrays.

Legend: V vocab, D model dim, L layers, H query heads, G key/value heads, Kh head dim,
Qr q low-rank dim, Lkv kv low-rank dim, N no-rope (content) qk dims, R rope dims, Vh value head
dim, E routed experts, K top-k, F expert hidden dim, Fd dense hidden dim, S shared experts.

`ModelShape` uses the trainer's `ModelConfig` field names (the MoE fields flattened), so
`shape_of(model_config)` converts one into the other without copying any logic.
"""
from __future__ import annotations

import dataclasses
from typing import Any

ATTENTION_KINDS = ("mla", "mha")


def _fail(field: str, value: Any, why: str) -> None:
    raise ValueError(f"ModelShape.{field}={value!r} {why}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The sizes that decide memory, FLOPs and bytes moved; nothing about numerics.

    Layers `[0, first_k_dense)` are dense SwiGLU of width `d_ff`; the rest are MoE layers
    (`num_experts` routed experts of width `moe_d_ff`, `top_k` per token, plus
    `num_shared_experts` always-on experts of the same width). `num_experts=0` = all dense.
    """

    name: str = "custom"
    vocab_size: int
    d_model: int
    num_layers: int
    num_heads: int
    d_ff: int
    attention: str = "mla"
    first_k_dense: int = 0
    num_kv_heads: int = 0            # mha: 0 means num_heads
    head_dim: int = 0                # mha: 0 means d_model // num_heads
    qk_norm: bool = False
    q_lora_rank: int = 0             # mla: 0 means a full-rank query projection
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    tie_embeddings: bool = False
    mtp_depth: int = 0
    num_experts: int = 0
    top_k: int = 0
    moe_d_ff: int = 0
    num_shared_experts: int = 0
    n_groups: int = 1
    topk_groups: int = 1

    def __post_init__(self) -> None:
        for f in ("vocab_size", "d_model", "num_layers", "num_heads", "d_ff"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                _fail(f, v, "must be a positive int")
        for f in ("first_k_dense", "num_kv_heads", "head_dim", "q_lora_rank", "mtp_depth",
                  "num_experts", "top_k", "moe_d_ff", "num_shared_experts"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                _fail(f, v, "must be an int >= 0")
        if self.attention not in ATTENTION_KINDS:
            _fail("attention", self.attention, f"must be one of {ATTENTION_KINDS}")
        if self.first_k_dense > self.num_layers:
            _fail("first_k_dense", self.first_k_dense, f"must be <= num_layers={self.num_layers}")
        if self.attention == "mha" and self.num_heads % self.kv_heads:
            _fail("num_kv_heads", self.num_kv_heads, f"must divide num_heads={self.num_heads}")
        if self.num_experts:
            if not 0 < self.top_k <= self.num_experts:
                _fail("top_k", self.top_k, f"must be in [1, num_experts={self.num_experts}]")
            if self.moe_d_ff <= 0:
                _fail("moe_d_ff", self.moe_d_ff, "must be > 0 when num_experts > 0")
            if self.n_groups <= 0 or self.num_experts % self.n_groups:
                _fail("n_groups", self.n_groups, f"must divide num_experts={self.num_experts}")
            if not 0 < self.topk_groups <= self.n_groups:
                _fail("topk_groups", self.topk_groups, f"must be in [1, n_groups={self.n_groups}]")

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def mha_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.num_heads

    @property
    def qk_head_dim(self) -> int:
        if self.attention == "mha":
            return self.mha_head_dim
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def v_dim(self) -> int:
        return self.mha_head_dim if self.attention == "mha" else self.v_head_dim

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_k_dense if self.num_experts else 0

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


# ---- parameter counts (per layer, per component) ------------------------------------------

def attention_params(s: ModelShape) -> dict[str, int]:
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


def layer_params(s: ModelShape, moe: bool) -> dict[str, int]:
    """Weights of one decoder layer: attention, two norms, and a dense or MoE feed-forward."""
    p = {"attention": sum(attention_params(s).values()), "norms": 2 * s.d_model}
    if moe:
        p["experts"] = s.num_experts * 3 * s.d_model * s.moe_d_ff
        p["shared"] = s.num_shared_experts * 3 * s.d_model * s.moe_d_ff
        p["router"] = s.d_model * s.num_experts + s.num_experts   # weights + selection bias
    else:
        p["dense_mlp"] = 3 * s.d_model * s.d_ff
    return p


def _mtp_module_params(s: ModelShape) -> int:
    """One DeepSeek-V3 MTP module: three norms (embedding, hidden, output), a 2D->D
    projection, and one (MoE) layer; the output head is shared with the main model."""
    return 3 * s.d_model + 2 * s.d_model * s.d_model + sum(layer_params(s, s.is_moe).values())


def param_counts(s: ModelShape) -> dict[str, int]:
    """Total and per-token active parameters, the main model and the MTP modules separately.

    `total`/`active` exclude MTP modules (the published 671B / 37B of DeepSeek-V3 do too);
    `total_with_mtp` adds them. Active counts the top_k routed experts, shared experts, router,
    attention, dense layers, the embedding and the output head.
    """
    emb = s.vocab_size * s.d_model
    head = 0 if s.tie_embeddings else emb
    dense_layer = sum(layer_params(s, False).values())
    total = emb + head + s.d_model + s.num_dense_layers * dense_layer
    active = total
    expert_params = 0
    if s.num_moe_layers:
        moe_layer = layer_params(s, True)
        total += s.num_moe_layers * sum(moe_layer.values())
        act_layer = sum(moe_layer.values()) - moe_layer["experts"]
        act_layer += s.top_k * 3 * s.d_model * s.moe_d_ff
        active += s.num_moe_layers * act_layer
        expert_params = s.num_moe_layers * moe_layer["experts"]
    mtp = s.mtp_depth * _mtp_module_params(s)
    return {"total": total, "active": active, "embedding": emb, "head": head,
            "routed_experts": expert_params, "non_expert": total - expert_params,
            "mtp": mtp, "total_with_mtp": total + mtp}
