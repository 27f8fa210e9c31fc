"""Write the tiny Hugging Face checkpoints and reference logits under tests/fixtures/hf/.

Run by hand (not in CI) in a venv with torch and transformers:
    python3 -m venv /work/venvs/hf
    /work/venvs/hf/bin/pip install torch==2.13.0 transformers==4.57.6 safetensors numpy
    /work/venvs/hf/bin/python tools/make_hf_fixtures.py

Each fixture folder holds what `save_pretrained` wrote (config.json, safetensors, maybe an
index), plus `reference.npz` with `tokens` [2, 12] and the float32 `logits` transformers computed
for them. Weights are random (seeded), norms and the router bias too, so a mapping mistake shows.
`reference_param_counts.json` holds transformers' parameter counts (model.parameters(), buffers
such as DeepSeek-V3's e_score_correction_bias excluded) for the released configs, built on the
meta device (no memory).
"""
from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "hf"
TOKENS = np.random.RandomState(0).randint(0, 256, size=(2, 12))


def randomize(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:   # norm weights: around 1, not 1, so a misplaced norm shows
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.rand(b.shape, generator=g))


def logits_of(model, tokens=TOKENS) -> np.ndarray:
    model.eval()
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float().numpy()


def write(name: str, model, *, shard: str | None = None, extra: dict | None = None) -> Path:
    d = OUT / name
    shutil.rmtree(d, ignore_errors=True)
    model.save_pretrained(d, safe_serialization=True, **({"max_shard_size": shard} if shard
                                                         else {}))
    if extra:   # tensors transformers does not model (DeepSeek-V3's MTP layer): one more shard
        save_file(extra, str(d / "mtp.safetensors"), metadata={"format": "pt"})
        idx_path = d / "model.safetensors.index.json"
        idx = json.loads(idx_path.read_text())
        idx["weight_map"].update({k: "mtp.safetensors" for k in extra})
        idx_path.write_text(json.dumps(idx, indent=2))
    np.savez(d / "reference.npz", tokens=TOKENS, logits=logits_of(model))
    return d


def deepseek_config(**kw) -> transformers.DeepseekV3Config:
    base = dict(vocab_size=256, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5,
                kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12,
                qk_nope_head_dim=8, n_group=4, topk_group=2, num_experts_per_tok=2,
                first_k_dense_replace=1, norm_topk_prob=True, rms_norm_eps=1e-5,
                max_position_embeddings=64, rope_theta=10000.0, tie_word_embeddings=False,
                rope_interleave=True, attn_implementation="eager", torch_dtype=torch.float32)
    base.update(kw)
    return transformers.DeepseekV3Config(**base)


def mtp_tensors(model, cfg, seed: int) -> dict[str, torch.Tensor]:
    """A random DeepSeek-V3 MTP module as the released checkpoints store it (layer L)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer
    n = cfg.num_hidden_layers
    layer = DeepseekV3DecoderLayer(cfg, layer_idx=n)
    randomize(layer, seed)
    pre = f"model.layers.{n}."
    out = {pre + k: v.contiguous() for k, v in layer.state_dict().items()}
    g = torch.Generator().manual_seed(seed + 1)
    d = cfg.hidden_size
    out[pre + "enorm.weight"] = 1 + 0.2 * torch.randn(d, generator=g)
    out[pre + "hnorm.weight"] = 1 + 0.2 * torch.randn(d, generator=g)
    out[pre + "eh_proj.weight"] = torch.randn(d, 2 * d, generator=g) / math.sqrt(2 * d)
    out[pre + "shared_head.norm.weight"] = 1 + 0.2 * torch.randn(d, generator=g)
    sd = model.state_dict()
    out[pre + "embed_tokens.weight"] = sd["model.embed_tokens.weight"].clone()
    out[pre + "shared_head.head.weight"] = sd["lm_head.weight"].clone()
    return out


def fp8_quantize(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 block quantization: one float32 scale per 128x128 block, w ~ q * scale_inv."""
    out, inn = w.shape
    bo, bi = math.ceil(out / block), math.ceil(inn / block)
    pad = torch.zeros(bo * block, bi * block)
    pad[:out, :inn] = w
    blocks = pad.view(bo, block, bi, block)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (blocks / scale[:, None, :, None]).view(bo * block, bi * block)[:out, :inn]
    return q.to(torch.float8_e4m3fn), scale.float()


def fp8_fixture(seed: int) -> None:
    """A DeepSeek-V3 whose matmul weights are FP8 with 128x128 block scales (dims > 128 so
    tensors hold several, partial, blocks); reference logits from the dequantized weights."""
    cfg = deepseek_config(hidden_size=136, intermediate_size=144, moe_intermediate_size=40,
                          num_hidden_layers=2, n_routed_experts=4, n_group=2, topk_group=1,
                          q_lora_rank=None)
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(cfg)
    randomize(model, seed)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    tensors = {}
    for k, v in sd.items():
        quantize = (v.ndim == 2 and "embed_tokens" not in k and "lm_head" not in k
                    and not k.endswith("mlp.gate.weight"))
        if quantize:
            q, s = fp8_quantize(v)
            tensors[k], tensors[k + "_scale_inv"] = q, s
            deq = q.float() * torch.repeat_interleave(torch.repeat_interleave(s, 128, 0), 128, 1
                                                      )[:v.shape[0], :v.shape[1]]
            sd[k] = deq
        else:
            tensors[k] = v
    model.load_state_dict(sd)
    d = OUT / "deepseek_v3_fp8"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    conf = json.loads(cfg.to_json_string())
    conf["architectures"] = ["DeepseekV3ForCausalLM"]
    conf["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3",
                                   "quant_method": "fp8", "weight_block_size": [128, 128]}
    (d / "config.json").write_text(json.dumps(conf, indent=2))
    np.savez(d / "reference.npz", tokens=TOKENS, logits=logits_of(model))


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    # DeepSeek-V3, every feature: YaRN (mscale != mscale_all_dim), interleaved rope, q low-rank,
    # groups, router bias, routed scaling, dense-first layer, an MTP module; sharded + index
    cfg = deepseek_config(rope_scaling={"type": "yarn", "factor": 4.0, "beta_fast": 32,
                                        "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 1.0,
                                        "original_max_position_embeddings": 16},
                          num_nextn_predict_layers=1)
    m = transformers.DeepseekV3ForCausalLM(cfg)
    randomize(m, 1)
    write("deepseek_v3_yarn", m, shard="60KB", extra=mtp_tensors(m, cfg, 2))
    # DeepSeek-V3 the other way: full-rank q, no interleave, no groups, no topk renorm, tied
    cfg = deepseek_config(q_lora_rank=None, rope_interleave=False, n_group=1, topk_group=1,
                          norm_topk_prob=False, routed_scaling_factor=1.0, tie_word_embeddings=True,
                          first_k_dense_replace=0, num_hidden_layers=2)
    m = transformers.DeepseekV3ForCausalLM(cfg)
    randomize(m, 3)
    m.tie_weights()
    write("deepseek_v3_plain", m)
    fp8_fixture(4)
    cfg = transformers.MixtralConfig(
        vocab_size=256, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, rms_norm_eps=1e-5, rope_theta=1e6, sliding_window=None,
        attn_implementation="eager", torch_dtype=torch.float32)
    m = transformers.MixtralForCausalLM(cfg)
    randomize(m, 5)
    write("mixtral", m, shard="40KB")
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=32, intermediate_size=40, moe_intermediate_size=16,
        num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=2,
        mlp_only_layers=[3], rms_norm_eps=1e-6, rope_theta=1e6, attn_implementation="eager",
        torch_dtype=torch.float32)
    m = transformers.Qwen3MoeForCausalLM(cfg)
    randomize(m, 6)
    write("qwen3_moe", m)
    reference_counts()
    total = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    print(f"fixtures: {total / 1e6:.2f} MB in {OUT}", file=sys.stderr)


RELEASED = {
    "deepseek3-671b": ("DeepseekV3ForCausalLM", dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_nextn_predict_layers=1, num_attention_heads=128,
        num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256, ep_size=1,
        routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
        v_head_dim=128, qk_nope_head_dim=128, topk_method="noaux_tc", n_group=8, topk_group=4,
        num_experts_per_tok=8, moe_layer_freq=1, first_k_dense_replace=3, norm_topk_prob=True,
        scoring_func="sigmoid", aux_loss_alpha=0.001, seq_aux=True, hidden_act="silu",
        max_position_embeddings=163840, rms_norm_eps=1e-6, rope_theta=10000,
        rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                      "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                      "type": "yarn"},
        tie_word_embeddings=False, attention_bias=False, torch_dtype="bfloat16",
        quantization_config={"activation_scheme": "dynamic", "fmt": "e4m3",
                             "quant_method": "fp8", "weight_block_size": [128, 128]})),
    "mixtral-8x7b": ("MixtralForCausalLM", dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
        rms_norm_eps=1e-5, rope_theta=1e6, num_local_experts=8, num_experts_per_tok=2,
        sliding_window=None, tie_word_embeddings=False, router_aux_loss_coef=0.02,
        hidden_act="silu", torch_dtype="bfloat16")),
    "qwen3-30b-a3b": ("Qwen3MoeForCausalLM", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960,
        tie_word_embeddings=False, router_aux_loss_coef=0.001, use_sliding_window=False,
        sliding_window=None, max_window_layers=48, hidden_act="silu", attention_bias=False,
        torch_dtype="bfloat16")),
}


def reference_counts() -> None:
    """transformers' parameter counts of the released configs (meta device: no memory)."""
    out = {}
    for preset, (arch, conf) in RELEASED.items():
        cls = getattr(transformers, arch)
        config_cls = cls.config_class
        kw = {k: v for k, v in conf.items() if k not in ("quantization_config", "torch_dtype")}
        with torch.device("meta"):
            model = cls(config_cls(**kw))
        out[preset] = {"architecture": arch, "config": dict(conf, architectures=[arch]),
                       "parameters": sum(p.numel() for p in model.parameters()),
                       "transformers": transformers.__version__}
    (OUT / "reference_param_counts.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
