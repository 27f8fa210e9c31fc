"""FLOPs per token and per step, by kind of kernel. Pure arithmetic.

Legend as in shape.py (the model is a dropless.config.ModelConfig); T tokens per device, S
sequence length.

Model FLOPs (what TFLOPS/device and MFU report, MaxText-style) count a multiply-add as 2 FLOPs
over the *active* weights (top_k routed experts, shared experts, router, attention projections,
dense layers, output head; not the embedding lookup) plus causal attention (half of the S x S
score and value products), x3 for forward + backward. Executed FLOPs add what the run really
does on top: rematerialisation (forward recomputed in the backward pass) and grouped-GEMM tile
padding.

Kinds: `gemm` dense bf16 matmuls, `gmm` routed-expert grouped matmuls (MXFP8 when quantized),
`attention` the score/value products.
"""
from __future__ import annotations

from dropless.config import ModelConfig
from dropless.plan.shape import attention_params, num_dense_layers, num_moe_layers

KINDS = ("gemm", "gmm", "attention")


def attention_proj_flops(s: ModelConfig) -> dict[str, float]:
    """Forward FLOPs per token of each attention projection (norm vectors excluded)."""
    p = attention_params(s)
    out = {}
    for name, n in p.items():
        if name == "qk_norm":
            continue
        if name in ("q_down", "kv_down"):   # these carry a norm vector of the low rank
            n -= s.q_lora_rank if name == "q_down" else s.kv_lora_rank
        out[name] = 2.0 * n
    return out


def attention_core_flops(s: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs per token of causal attention: on average S/2 keys, QK^T and PV."""
    return 2.0 * (seq_len / 2) * s.num_heads * (s.qk_head_dim + s.v_dim)


def layer_forward_flops(s: ModelConfig, seq_len: int, moe: bool) -> dict[str, float]:
    """Forward FLOPs per token of one decoder layer, by kind."""
    gemm = sum(attention_proj_flops(s).values())
    gmm = 0.0
    if moe:
        gemm += 2.0 * s.d_model * s.moe.num_experts                              # router
        gemm += 2.0 * 3 * s.d_model * s.moe.d_ff * s.moe.num_shared_experts      # shared experts
        gmm = 2.0 * 3 * s.d_model * s.moe.d_ff * s.moe.top_k                     # routed experts
    else:
        gemm += 2.0 * 3 * s.d_model * s.d_ff
    return {"gemm": gemm, "gmm": gmm, "attention": attention_core_flops(s, seq_len)}


def head_forward_flops(s: ModelConfig) -> float:
    """Output projection D -> V per token (the embedding lookup does no matmul)."""
    return 2.0 * s.d_model * s.vocab_size


def mtp_forward_flops(s: ModelConfig, seq_len: int) -> dict[str, float]:
    """One DeepSeek-V3 MTP module per token: 2D -> D projection, one layer, the shared head."""
    f = layer_forward_flops(s, seq_len, s.moe is not None)
    f["gemm"] += 2.0 * 2 * s.d_model * s.d_model + head_forward_flops(s)
    return f


def model_forward_flops(s: ModelConfig, seq_len: int, *, with_mtp: bool = True
                        ) -> dict[str, float]:
    """Forward FLOPs per token of the whole model, by kind."""
    dense = layer_forward_flops(s, seq_len, False)
    out = {k: num_dense_layers(s) * dense[k] for k in KINDS}
    if num_moe_layers(s):
        moe = layer_forward_flops(s, seq_len, True)
        for k in KINDS:
            out[k] += num_moe_layers(s) * moe[k]
    out["gemm"] += head_forward_flops(s)
    if with_mtp and s.mtp_depth:
        mtp = mtp_forward_flops(s, seq_len)
        for k in KINDS:
            out[k] += s.mtp_depth * mtp[k]
    return out


def model_flops_per_token(s: ModelConfig, seq_len: int, *, with_mtp: bool = True) -> float:
    """Training model FLOPs per token: 3 x forward (backward = 2 x forward)."""
    return 3.0 * sum(model_forward_flops(s, seq_len, with_mtp=with_mtp).values())


def six_n_flops_per_token(s: ModelConfig) -> float:
    """The textbook 6 x active non-embedding parameters (no attention), for comparison."""
    from dropless.plan.shape import param_counts
    c = param_counts(s)
    return 6.0 * (c["active"] - c["embedding"])


def padding_fraction(s: ModelConfig, tokens_per_device: int, ep: int, tile: int) -> float:
    """Expected grouped-GEMM rows added by padding each local expert's group to a tile, as a
    fraction of real rows: half a tile per local expert that receives rows."""
    if s.moe is None:
        return 0.0
    local_experts = s.moe.num_experts // ep
    rows = tokens_per_device * s.moe.top_k   # balanced: each device's experts get T*K rows
    return local_experts * (tile / 2) / rows
