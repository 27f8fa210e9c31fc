"""Where each of our parameters lives in a Hugging Face checkpoint, and how to convert it: one
table used by both `load` and `save` (so the two directions cannot drift).

Legend: D model dim, H query heads, G kv heads, K head dim, N no-rope dims, R rope dims,
V value dim (or vocabulary in w_VD), L kv latent dim, Q q latent dim, E experts, F hidden dim.

Layout differences, all handled here:
  * `torch.nn.Linear` stores [out, in]; we store [in, out] (`T`).
  * Per-head projections are flat in HF ([H*K, D]); ours split heads ([D, H, K]); the output
    projection [D, H*V] becomes [H, V, D].
  * DeepSeek-V3 with `rope_interleave=True` (the released weights) keeps each head's rope dims
    as interleaved pairs (x0, x1), (x2, x3), ...; our rotary rotates (first half, second half),
    so the rope output columns of q (per head) and of kv_a_proj_with_mqa (its last R) are
    permuted to [0, 2, 4, ..., 1, 3, 5, ...] on load and back on save.
  * HF keeps one tensor per expert ([F, D] each); ours stacks them ([E, D, F]).
  * DeepSeek-V3's router bias is a buffer (`e_score_correction_bias`); Mixtral and Qwen3-MoE
    have none, so our `bias_E` loads as zeros and must still be zero when saved.
  * MTP's `eh_proj` concatenates [embedding, hidden]; ours concatenates [hidden, embedding].
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from dropless.config import ModelConfig

Path = tuple[Any, ...]


def rope_perm(r: int) -> np.ndarray:
    """Interleaved pair order -> half-split order: new[j] = old[perm[j]]."""
    return np.concatenate([np.arange(0, r, 2), np.arange(1, r, 2)])


class Conv:
    """One HF tensor <-> one of our arrays (or one slice of a stacked one)."""

    def fwd(self, x: np.ndarray) -> np.ndarray:   # HF -> ours
        raise NotImplementedError

    def inv(self, y: np.ndarray) -> np.ndarray:   # ours -> HF
        raise NotImplementedError

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:   # our shape -> HF's
        return tuple(shape)


class Same(Conv):
    def fwd(self, x):
        return x

    def inv(self, y):
        return y


class T(Conv):
    """[out, in] <-> [in, out]."""

    def hf_shape(self, shape):
        return tuple(shape)[::-1]

    def fwd(self, x):
        return np.ascontiguousarray(x.T)

    def inv(self, y):
        return np.ascontiguousarray(y.T)


@dataclasses.dataclass(frozen=True)
class SplitHeads(Conv):
    """[H*K, D] <-> [D, H, K]; with `rope` > 0 the last `rope` dims of each head are permuted
    from interleaved pairs to halves (DeepSeek-V3 rope_interleave)."""
    heads: int
    head_dim: int
    rope: int = 0

    def hf_shape(self, shape):   # [D, H, K] -> [H*K, D]
        return (shape[1] * shape[2], shape[0])

    def fwd(self, x):
        y = x.T.reshape(x.shape[1], self.heads, self.head_dim)
        if self.rope:
            n = self.head_dim - self.rope
            y = np.concatenate([y[..., :n], y[..., n:][..., rope_perm(self.rope)]], axis=-1)
        return np.ascontiguousarray(y)

    def inv(self, y):
        if self.rope:
            n = self.head_dim - self.rope
            y = np.concatenate([y[..., :n], y[..., n:][..., np.argsort(rope_perm(self.rope))]],
                               axis=-1)
        return np.ascontiguousarray(y.reshape(y.shape[0], -1).T)


@dataclasses.dataclass(frozen=True)
class MergeHeadsOut(Conv):
    """o_proj [D, H*V] <-> [H, V, D]."""
    heads: int

    def hf_shape(self, shape):   # [H, V, D] -> [D, H*V]
        return (shape[2], shape[0] * shape[1])

    def fwd(self, x):
        return np.ascontiguousarray(x.T.reshape(self.heads, -1, x.shape[0]))

    def inv(self, y):
        return np.ascontiguousarray(y.reshape(-1, y.shape[-1]).T)


@dataclasses.dataclass(frozen=True)
class RopeTail(Conv):
    """kv_a_proj_with_mqa [L+R, D] <-> [D, L+R], the last R columns permuted when interleaved."""
    rope: int
    interleave: bool

    def hf_shape(self, shape):
        return tuple(shape)[::-1]

    def _perm(self, width: int, inverse: bool) -> np.ndarray:
        p = rope_perm(self.rope)
        p = np.argsort(p) if inverse else p
        return np.concatenate([np.arange(width - self.rope), width - self.rope + p])

    def fwd(self, x):
        y = x.T
        return np.ascontiguousarray(y[:, self._perm(y.shape[1], False)] if self.interleave else y)

    def inv(self, y):
        y = y[:, self._perm(y.shape[1], True)] if self.interleave else y
        return np.ascontiguousarray(y.T)


class MtpProj(Conv):
    """eh_proj [D, 2D] (input = [embedding, hidden]) <-> ours [2D, D] (input = [hidden, emb])."""

    def hf_shape(self, shape):
        return tuple(shape)[::-1]

    def fwd(self, x):
        d = x.shape[0]
        return np.ascontiguousarray(np.concatenate([x[:, d:].T, x[:, :d].T], axis=0))

    def inv(self, y):
        d = y.shape[1]
        return np.ascontiguousarray(np.concatenate([y[d:].T, y[:d].T], axis=1))


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One of our parameters: its path in our tree, the HF tensor name(s) and the conversion.

    `hf` holds one name, or one per expert when `stacked` (our dim 0 indexes them). An empty
    `hf` means the parameter does not exist in the HF format and must be zero (router bias of
    softmax models).
    """
    path: Path
    hf: tuple[str, ...]
    conv: Conv
    stacked: bool = False


@dataclasses.dataclass(frozen=True)
class Layout:
    """Checkpoint layout choices that are not part of the model math."""
    arch: str                      # "DeepseekV3ForCausalLM", "MixtralForCausalLM", ...
    rope_interleave: bool = False  # DeepSeek-V3 only


def _ffn(prefix: str, path: Path, names=("gate_proj", "up_proj", "down_proj"),
         ours=("w_gate_DF", "w_up_DF", "w_down_FD")) -> list[Leaf]:
    return [Leaf(path + (o,), (f"{prefix}.{n}.weight",), T()) for n, o in zip(names, ours)]


def _experts(prefix: str, path: Path, e: int, names: tuple[str, str, str]) -> list[Leaf]:
    ours = ("w_gate_EDF", "w_up_EDF", "w_down_EFD")
    return [Leaf(path + ("experts", o), tuple(f"{prefix}.{i}.{n}.weight" for i in range(e)),
                 T(), stacked=True) for n, o in zip(names, ours)]


def _attention(cfg: ModelConfig, pre: str, path: Path, lay: Layout) -> list[Leaf]:
    a = path + ("attn",)
    h = cfg.num_heads
    if cfg.attention == "mla":
        r = cfg.qk_rope_head_dim
        rope = r if lay.rope_interleave else 0
        k = cfg.qk_nope_head_dim + r
        out = []
        if cfg.q_lora_rank:
            out += [Leaf(a + ("wq_a_DQ",), (f"{pre}.q_a_proj.weight",), T()),
                    Leaf(a + ("q_norm_Q",), (f"{pre}.q_a_layernorm.weight",), Same()),
                    Leaf(a + ("wq_b_QHK",), (f"{pre}.q_b_proj.weight",), SplitHeads(h, k, rope))]
        else:
            out.append(Leaf(a + ("wq_DHK",), (f"{pre}.q_proj.weight",), SplitHeads(h, k, rope)))
        return out + [
            Leaf(a + ("wkv_a_DL",), (f"{pre}.kv_a_proj_with_mqa.weight",),
                 RopeTail(r, lay.rope_interleave)),
            Leaf(a + ("kv_norm_L",), (f"{pre}.kv_a_layernorm.weight",), Same()),
            Leaf(a + ("wkv_b_LHN",), (f"{pre}.kv_b_proj.weight",),
                 SplitHeads(h, cfg.qk_nope_head_dim + cfg.v_head_dim)),
            Leaf(a + ("wo_HVD",), (f"{pre}.o_proj.weight",), MergeHeadsOut(h))]
    k, g = cfg.mha_head_dim, cfg.kv_heads
    out = [Leaf(a + ("wq_DHK",), (f"{pre}.q_proj.weight",), SplitHeads(h, k)),
           Leaf(a + ("wk_DGK",), (f"{pre}.k_proj.weight",), SplitHeads(g, k)),
           Leaf(a + ("wv_DGK",), (f"{pre}.v_proj.weight",), SplitHeads(g, k)),
           Leaf(a + ("wo_HKD",), (f"{pre}.o_proj.weight",), MergeHeadsOut(h))]
    if cfg.qk_norm:
        out += [Leaf(a + ("q_norm_K",), (f"{pre}.q_norm.weight",), Same()),
                Leaf(a + ("k_norm_K",), (f"{pre}.k_norm.weight",), Same())]
    return out


def _block(cfg: ModelConfig, pre: str, path: Path, is_moe: bool, lay: Layout) -> list[Leaf]:
    out = [Leaf(path + ("attn_norm_D",), (f"{pre}.input_layernorm.weight",), Same()),
           Leaf(path + ("ffn_norm_D",), (f"{pre}.post_attention_layernorm.weight",), Same())]
    out += _attention(cfg, f"{pre}.self_attn", path, lay)
    if not is_moe:
        return out + _ffn(f"{pre}.mlp", path + ("ffn",))
    m, e = path + ("moe",), cfg.moe.num_experts
    if lay.arch == "MixtralForCausalLM":
        moe_pre = f"{pre}.block_sparse_moe"
        expert_names = ("w1", "w3", "w2")          # gate, up, down
    else:
        moe_pre = f"{pre}.mlp"
        expert_names = ("gate_proj", "up_proj", "down_proj")
    out.append(Leaf(m + ("router", "w_DE"), (f"{moe_pre}.gate.weight",), T()))
    bias = (f"{moe_pre}.gate.e_score_correction_bias",) if lay.arch == "DeepseekV3ForCausalLM" \
        else ()
    out.append(Leaf(m + ("router", "bias_E"), bias, Same()))
    out += _experts(f"{moe_pre}.experts", m, e, expert_names)
    if cfg.moe.num_shared_experts:
        out += _ffn(f"{moe_pre}.shared_experts", m + ("shared",))
    return out


def leaves(cfg: ModelConfig, lay: Layout) -> list[Leaf]:
    """Every parameter of `cfg`'s model (the tree `models.decoder.init_params` builds) with
    its HF tensor names and conversion, in checkpoint order."""
    out = [Leaf(("embed", "w_VD"), ("model.embed_tokens.weight",), Same())]
    for i in range(cfg.num_layers):
        out += _block(cfg, f"model.layers.{i}", ("layers", i), cfg.is_moe_layer(i), lay)
    out.append(Leaf(("final_norm", "w_D"), ("model.norm.weight",), Same()))
    if not cfg.tie_embeddings:
        out.append(Leaf(("lm_head", "w_DV"), ("lm_head.weight",), T()))
    for k in range(cfg.mtp_depth):   # DeepSeek-V3: MTP module k is layer num_layers + k
        pre, path = f"model.layers.{cfg.num_layers + k}", ("mtp", k)
        out += [Leaf(path + ("embed_norm_D",), (f"{pre}.enorm.weight",), Same()),
                Leaf(path + ("hidden_norm_D",), (f"{pre}.hnorm.weight",), Same()),
                Leaf(path + ("proj_2DD",), (f"{pre}.eh_proj.weight",), MtpProj()),
                Leaf(path + ("out_norm_D",), (f"{pre}.shared_head.norm.weight",), Same())]
        out += _block(cfg, pre, path + ("block",), cfg.moe is not None, lay)
    return out


def mtp_shared_copies(cfg: ModelConfig) -> dict[str, Path]:
    """The MTP layers' copies of the embedding and output head in DeepSeek-V3 checkpoints: our
    MTP shares the main model's, so load skips them and save writes the main ones there."""
    out = {}
    for k in range(cfg.mtp_depth):
        pre = f"model.layers.{cfg.num_layers + k}"
        out[f"{pre}.embed_tokens.weight"] = ("embed", "w_VD")
        out[f"{pre}.shared_head.head.weight"] = ("lm_head", "w_DV")
    return out
