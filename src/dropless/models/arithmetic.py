"""The one arithmetic model of the network: parameters by part (total and active) and FLOPs per
token (model and executed), read from `ModelConfig` alone. Pure arithmetic, no arrays; the
trainer's metrics, `dropless config show` and the planner all read it. Its test oracle,
`tests/_support/param_count.py`, counts the shapes `init_params` really creates.

Legend: V vocab, D model dim, H query heads, G key/value heads, Kh head dim (mha), Qr q low-rank
dim, Lkv kv low-rank dim, N no-rope (content) qk dims, R rope dims, Vh value head dim, E routed
experts, K top-k, F expert hidden dim (`moe.d_ff`), Fd dense hidden dim (`d_ff`), S sequence
length.

Parts (`PARTS`, the keys of `param_counts` and of `layer_params`): embedding, lm_head (0 when
tied), attention (projections and their q/kv or qk norms), dense_ffn, router (weights and
selection bias), routed_experts, shared_experts, norms (the two per layer and the final one),
mtp (whole MTP modules; the head they share is not counted again). `total` is the main model
(MTP excluded, as DeepSeek-V3's published 671B is), `active` what one token touches (top_k of
the E routed experts, everything else whole).

FLOPs, MaxText-style: a multiply-add is 2 FLOPs, a matmul with P weights costs 2P per token
forward and 4P backward, so training is 3 x forward. Only matmul weights count: the embedding
lookup, norm vectors and router bias do not; the output head, the router, attention
projections, dense and shared FFNs and top_k routed experts do, MTP modules included (their
2D -> D projection, block and the shared head once per depth). Attention is counted once, here:
per layer and token QK^T and PV cost 2 x H x (qk head dim + v head dim) x S/2 forward. Causal
attention is S/2 keys on average, as MaxText's `calculate_tflops_training_per_device` counts it
(causal = non-causal / 2); the exact mean over a causal mask is (S + 1)/2, and PaLM's
6N + 12 L H Q T (arXiv:2204.02311, app. B) counts the full square (S keys). S/2 is chosen so our
MFU is comparable with MaxText's (the published reference runs are MaxText) and the difference
from (S + 1)/2 is 1/S of the attention term. `executed` adds what a run computes beyond that:
with a capacity factor every expert processes capacity_factor x its balanced load (padding), so
the routed-expert FLOPs scale by it; dropless, executed == model. The planner adds its own
executed terms (recompute under remat, grouped-GEMM tile padding) to `layer_forward_flops`.
"""
from __future__ import annotations

from dropless.config import ModelConfig

PARTS = ("embedding", "lm_head", "attention", "dense_ffn", "router", "routed_experts",
         "shared_experts", "norms", "mtp")
KINDS = ("gemm", "gmm", "attention")   # dense matmuls, routed-expert grouped matmuls, S x S
_NORMS = ("q_norm", "kv_norm", "qk_norm")


# ---- parameters -------------------------------------------------------------------------------

def attention_params(s: ModelConfig) -> dict[str, int]:
    """Weights of one attention block by projection; its norm vectors are the `*_norm` entries
    (MLA: q_norm over Qr, kv_norm over Lkv; mha with qk_norm: query and key head norms)."""
    d, h = s.d_model, s.num_heads
    if s.attention == "mha":
        kh, g = s.mha_head_dim, s.kv_heads
        p = {"query": d * h * kh, "key": d * g * kh, "value": d * g * kh, "out": h * kh * d}
        if s.qk_norm:
            p["qk_norm"] = 2 * kh
        return p
    n, r, vh, lkv, qr = (s.qk_nope_head_dim, s.qk_rope_head_dim, s.v_head_dim, s.kv_lora_rank,
                         s.q_lora_rank)
    p = ({"q_down": d * qr, "q_norm": qr, "query": qr * h * (n + r)} if qr
         else {"query": d * h * (n + r)})
    p.update(kv_down=d * (lkv + r), kv_norm=lkv, key=lkv * h * n, value=lkv * h * vh,
             out=h * vh * d)
    return p


def attention_matmul_params(s: ModelConfig) -> dict[str, int]:
    """`attention_params` without the norm vectors: the weights one token multiplies by."""
    return {k: v for k, v in attention_params(s).items() if k not in _NORMS}


def layer_params(s: ModelConfig, moe: bool) -> dict[str, int]:
    """Weights of one decoder layer by part: attention, its two norms, and dense_ffn or the MoE
    parts (router weights + bias, all E routed experts, shared experts)."""
    p = {"attention": sum(attention_params(s).values()), "norms": 2 * s.d_model}
    if moe:
        m = s.moe
        p["router"] = s.d_model * m.num_experts + m.num_experts
        p["routed_experts"] = m.num_experts * 3 * s.d_model * m.d_ff
        p["shared_experts"] = m.num_shared_experts * 3 * s.d_model * m.d_ff
    else:
        p["dense_ffn"] = 3 * s.d_model * s.d_ff
    return p


def mtp_module_params(s: ModelConfig) -> int:
    """One DeepSeek-V3 MTP module: three norms (hidden, embedding, output), the 2D -> D
    projection and one block (MoE when the model has MoE layers); embedding and head shared."""
    return (3 * s.d_model + 2 * s.d_model * s.d_model
            + sum(layer_params(s, s.moe is not None).values()))


def param_counts(s: ModelConfig) -> dict[str, int]:
    """Parameter counts (not bytes): every part of `PARTS`, `total`, `active`, `router_bias`
    (inside `router`) and `mtp_matmul_active` (matmul weights one token uses in the MTP modules,
    head excluded). Equal, key for key, to the shapes `init_params` creates, which the tests
    check for every preset (tests/_support/param_count.py)."""
    c = dict.fromkeys(PARTS, 0)
    c["embedding"] = s.vocab_size * s.d_model
    c["lm_head"] = 0 if s.tie_embeddings else s.vocab_size * s.d_model
    c["norms"] = s.d_model   # final norm
    inactive = router_bias = 0
    for i in range(s.num_layers):
        moe = s.is_moe_layer(i)
        for part, n in layer_params(s, moe).items():
            c[part] += n
        if moe:
            router_bias += s.moe.num_experts
            inactive += (s.moe.num_experts - s.moe.top_k) * 3 * s.d_model * s.moe.d_ff
    c["mtp"] = s.mtp_depth * mtp_module_params(s)
    c["total"] = sum(v for k, v in c.items() if k != "mtp")
    c["active"] = c["total"] - inactive
    c["router_bias"] = router_bias
    c["mtp_matmul_active"] = s.mtp_depth * _mtp_matmul(s)
    return c


def layer_matmul_params(s: ModelConfig, moe: bool) -> dict[str, int]:
    """Matmul weights one token uses in one layer, by kind: gemm (attention projections, router
    weights, shared experts or the dense FFN) and gmm (top_k routed experts)."""
    gemm = sum(attention_matmul_params(s).values())
    if not moe:
        return {"gemm": gemm + 3 * s.d_model * s.d_ff, "gmm": 0}
    m = s.moe
    gemm += s.d_model * m.num_experts + m.num_shared_experts * 3 * s.d_model * m.d_ff
    return {"gemm": gemm, "gmm": m.top_k * 3 * s.d_model * m.d_ff}


def _mtp_matmul(s: ModelConfig) -> int:
    """Matmul weights one token uses in one MTP module, the shared head excluded."""
    return 2 * s.d_model * s.d_model + sum(layer_matmul_params(s, s.moe is not None).values())


def matmul_params(s: ModelConfig) -> dict[str, float]:
    """Active matmul weights per token: {"main": the layers and the output head (the embedding
    matrix when tied), "mtp": the MTP modules, each with the shared head once}."""
    head = s.d_model * s.vocab_size
    main = head + sum(sum(layer_matmul_params(s, s.is_moe_layer(i)).values())
                      for i in range(s.num_layers))
    return {"main": float(main), "mtp": float(s.mtp_depth * (_mtp_matmul(s) + head))}


# ---- FLOPs per token ----------------------------------------------------------------------------

def attention_core_flops(s: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs per token of one layer's causal QK^T and PV: S/2 keys on average."""
    return 2.0 * (seq_len / 2) * s.num_heads * (s.qk_head_dim + s.v_dim)


def attention_proj_flops(s: ModelConfig) -> dict[str, float]:
    """Forward FLOPs per token of each attention projection."""
    return {k: 2.0 * v for k, v in attention_matmul_params(s).items()}


def layer_forward_flops(s: ModelConfig, seq_len: int, moe: bool) -> dict[str, float]:
    """Forward FLOPs per token of one decoder layer, by kind (`KINDS`)."""
    w = layer_matmul_params(s, moe)
    return {"gemm": 2.0 * w["gemm"], "gmm": 2.0 * w["gmm"],
            "attention": attention_core_flops(s, seq_len)}


def head_forward_flops(s: ModelConfig) -> float:
    """Output projection D -> V per token (the embedding lookup does no matmul)."""
    return 2.0 * s.d_model * s.vocab_size


def mtp_forward_flops(s: ModelConfig, seq_len: int) -> dict[str, float]:
    """One MTP module per token: the 2D -> D projection, one block, the shared head."""
    f = layer_forward_flops(s, seq_len, s.moe is not None)
    f["gemm"] += 2.0 * 2 * s.d_model * s.d_model + head_forward_flops(s)
    return f


def forward_flops(s: ModelConfig, seq_len: int, *, with_mtp: bool = True) -> dict[str, float]:
    """Forward FLOPs per token of the whole model, by kind."""
    out = dict.fromkeys(KINDS, 0.0)
    for i in range(s.num_layers):
        for k, v in layer_forward_flops(s, seq_len, s.is_moe_layer(i)).items():
            out[k] += v
    out["gemm"] += head_forward_flops(s)
    if with_mtp and s.mtp_depth:
        for k, v in mtp_forward_flops(s, seq_len).items():
            out[k] += s.mtp_depth * v
    return out


def model_flops_per_token(s: ModelConfig, seq_len: int, *, with_mtp: bool = True) -> float:
    """Training model FLOPs per token: 3 x forward (backward = 2 x forward)."""
    return 3.0 * sum(forward_flops(s, seq_len, with_mtp=with_mtp).values())


def flops_per_token(s: ModelConfig, seq_len: int, *, capacity_factor: float | None = None
                    ) -> dict[str, float]:
    """{"model": useful training FLOPs per token, "executed": with capacity padding}: with a
    capacity factor every expert computes capacity_factor x its balanced rows, so the routed
    experts' FLOPs scale by it (dropless, or None: executed == model)."""
    model = model_flops_per_token(s, seq_len)
    executed = model
    if s.moe is not None and capacity_factor is not None:
        executed += 3.0 * forward_flops(s, seq_len)["gmm"] * (capacity_factor - 1.0)
    return {"model": model, "executed": executed}


def six_n_flops_per_token(s: ModelConfig) -> float:
    """The textbook 6 x active non-embedding parameters (no attention), for comparison."""
    c = param_counts(s)
    return 6.0 * (c["active"] - c["embedding"])


def format_counts(counts: dict[str, int]) -> str:
    """One line: total and active in billions (or millions when small)."""
    def fmt(n: int) -> str:
        return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"
    return f"total {fmt(counts['total'])}, active {fmt(counts['active'])} per token" + (
        f", MTP {fmt(counts['mtp'])}" if counts["mtp"] else "")
