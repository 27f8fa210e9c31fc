"""`ModelConfig`: a decoder-only MoE transformer's shape, attention, rotary embedding and
initialisation."""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from dropless.config.fields import (_check_dtype, _check_types, _fail, _one_of,
                                    _positive_ints, _sizes, described)
from dropless.config.moe import MoEConfig
from dropless.config.names import (ATTENTION_KERNELS, ATTENTION_KINDS, INIT_SCHEMES,
                                   LAYER_KINDS, MAX_LAYERS, ROPE_TYPES)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A decoder-only MoE transformer: DeepSeek-V3 (MLA) or Mixtral / Qwen3-MoE (GQA) shape.

    Layer kinds: `layer_pattern` (one letter per layer, "D" dense SwiGLU of width `d_ff`, "M"
    the MoE layer described by `moe`, e.g. "DMDM" for Qwen3-MoE's decoder_sparse_step=2) when
    set; otherwise layers `[0, first_k_dense)` are dense and the rest MoE. Every layer is dense
    when `moe` is None. Ask `is_moe_layer(i)`, never the fields. `attention="mla"` is
    Multi-head Latent Attention (q/kv low-rank projections with decoupled rope dims);
    `attention="mha"` is standard attention with `num_kv_heads` key/value heads (GQA).
    `q_lora_rank=0` means a full-rank query projection (DeepSeek-V2-Lite style); MLA's q/kv
    latent norms use `mla_norm_eps` (DeepSeek fixes 1e-6 there, whatever `norm_eps` is).

    `rope_type="yarn"` is YaRN (arXiv:2309.00071) as DeepSeek-V3 and `transformers` define it:
    frequencies blended between theta^(-2i/R) and that / rope_factor over the dims whose
    wavelength falls between the beta_fast and beta_slow rotation counts of
    `rope_original_max_position`; cos/sin scaled by mscale(rope_mscale)/mscale(rope_mscale_all_dim)
    (mscale(m) = 0.1 m ln(factor) + 1); and MLA's softmax scale multiplied by
    mscale(rope_mscale_all_dim)^2 when rope_mscale_all_dim > 0.
    """

    vocab_size: int = described(doc="tokens in the vocabulary (rows of the embedding and head)")
    d_model: int = described(doc="model width (hidden size)")
    num_layers: int = described(doc="decoder layers")
    num_heads: int = described(doc="attention heads (query heads under GQA)")
    d_ff: int = described(doc="hidden width of the dense layers' SwiGLU")
    attention: str = described(
        "mla", doc="mla (DeepSeek's multi-head latent attention) or mha (standard attention, "
                   "GQA with num_kv_heads)")
    attention_kernel: str = described(
        "auto", doc="the attention core: auto (cuDNN's flash attention on an NVIDIA GPU where "
                    "it takes the operands, bfloat16; else xla), xla (the S x S scores in "
                    "float32), cudnn, or cudnn_thd (the same kernel through jax's own cuDNN "
                    "binding: MLA's value head dim unpadded, packed rows as cuDNN's segments, "
                    "Hopper and cuDNN >= 9.10); a kernel named that cannot run is refused in "
                    "one line")
    max_segments_per_seq: int = described(
        32, doc="cudnn_thd: the runs of equal segment id (documents) a packed row may hold in "
                "cuDNN's segment form; a batch with a row of more takes the masked form "
                "(MaxText's max_segments_per_seq)")
    first_k_dense: int = described(
        0, doc="the first this many layers are dense, the rest MoE (where layer_pattern is \"\")")
    layer_pattern: str = described(
        "", doc="one letter per layer, D dense or M MoE (e.g. DMDM); \"\" = from first_k_dense")
    moe: MoEConfig | None = described(
        None, doc="the MoE layer (the `model.moe.*` keys); null = every layer dense")
    # standard attention (mha)
    num_kv_heads: int = described(0, doc="mha: key/value heads (GQA); 0 = num_heads")
    head_dim: int = described(0, doc="mha: dims per head; 0 = d_model // num_heads")
    qk_norm: bool = described(False, doc="mha: RMSNorm on each query and key head (Qwen3)")
    # multi-head latent attention (mla)
    q_lora_rank: int = described(
        0, doc="mla: rank of the query's low-rank projection; 0 = a full-rank query projection")
    kv_lora_rank: int = described(512, doc="mla: rank of the compressed key/value latent")
    qk_nope_head_dim: int = described(128, doc="mla: query/key dims per head without rope")
    qk_rope_head_dim: int = described(
        64, doc="mla: query/key dims per head with rope (decoupled, shared key; even)")
    v_head_dim: int = described(128, doc="mla: value dims per head")
    mla_norm_eps: float = described(
        1e-6, doc="mla: epsilon of the q/kv latent RMSNorms (DeepSeek fixes 1e-6 there)")
    rope_theta: float = described(10000.0, doc="rotary base (theta)")
    rope_type: str = described(
        "default", doc="default, or yarn (YaRN context extension, as DeepSeek-V3)")
    rope_factor: float = described(1.0, doc="yarn: context extension factor (DeepSeek-V3: 40)")
    rope_original_max_position: int = described(
        4096, doc="yarn: the context length before the extension")
    rope_beta_fast: float = described(
        32.0, doc="yarn: dims rotating more often than this over the original context keep "
                  "their frequency")
    rope_beta_slow: float = described(
        1.0, doc="yarn: dims rotating less often than this are divided by rope_factor")
    rope_mscale: float = described(
        1.0, doc="yarn: m of the cos/sin scale's numerator mscale(m) = 0.1 m ln(rope_factor) + 1")
    rope_mscale_all_dim: float = described(
        0.0, doc="yarn: m of the cos/sin scale's denominator; when > 0 MLA's softmax scale is "
                 "multiplied by mscale(m)^2")
    norm_eps: float = described(1e-6, doc="epsilon of the RMSNorms (MLA's latent ones apart)")
    tie_embeddings: bool = described(
        False, doc="the output head is the embedding matrix (no separate lm_head)")
    mtp_depth: int = described(
        0, doc="DeepSeek-V3 multi-token prediction modules (fewer than the run's seq_len); "
               "0 = off")
    mtp_loss_coef: float = described(
        0.3, doc="weight of the mean MTP cross-entropy in the loss")
    dtype: str = described("float32", doc="activations: float32, bfloat16 or float16")
    weight_dtype: str = described(
        "float32", doc="stored weights: float32, bfloat16 or float16")
    # parameters then hold "layer_runs" instead of "layers"
    scan_layers: bool = described(
        False, doc="consecutive same-kind layers run under one jax.lax.scan over stacked "
                   "weights (docs/scan_layers.md)")
    # initialisation (docs/training.md "Initialisation"; the tables are models/init.py's)
    init: str = described(
        "fan_in", doc="initialisation scheme: fan_in, normal, maxtext or legacy "
                      "(models/init.py)")
    init_std: float = described(
        0.02, doc="normal: the std of every matrix (a Hugging Face config's initializer_range)")
    head_init_std: float = described(
        0.0, doc="std of the output head's weights; 0 = the scheme's")
    embed_init_std: float = described(0.0, doc="std of the embedding; 0 = the scheme's")
    init_residual_scaling: bool = described(
        False, doc="residual-output projections (attention out, dense/shared/expert down) "
                   "scaled by 1/sqrt(2 x num_layers)")

    def __post_init__(self) -> None:
        c = "ModelConfig"
        _check_types(self)
        self._check_init()
        _positive_ints(c, self, ("vocab_size", "d_model", "num_layers", "num_heads", "d_ff"))
        _positive_ints(c, self, ("first_k_dense", "num_kv_heads", "head_dim", "q_lora_rank",
                                 "mtp_depth"), allow_zero=True)
        _sizes(c, self, ("vocab_size", "d_model", "num_heads", "d_ff", "num_kv_heads", "head_dim",
                         "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                         "v_head_dim", "max_segments_per_seq", "rope_original_max_position"))
        for name in ("num_layers", "mtp_depth"):
            if getattr(self, name) > MAX_LAYERS:
                _fail(c, name, getattr(self, name), f"is more than {MAX_LAYERS:,} layers (the "
                      "deepest published decoders have about 100-200); a typo?")
        _one_of(c, self, "attention", ATTENTION_KINDS)
        _one_of(c, self, "attention_kernel", ATTENTION_KERNELS)
        if not (type(self.max_segments_per_seq) is int and self.max_segments_per_seq >= 2):
            _fail(c, "max_segments_per_seq", self.max_segments_per_seq, "must be an int >= 2")
        if self.first_k_dense > self.num_layers:
            _fail(c, "first_k_dense", self.first_k_dense,
                  f"must be <= num_layers={self.num_layers}")
        self._check_layer_pattern()
        self._check_rope()
        if self.attention == "mha":
            if self.num_heads % self.kv_heads:
                _fail(c, "num_kv_heads", self.num_kv_heads,
                      f"must divide num_heads={self.num_heads}")
            if self.head_dim == 0 and self.d_model % self.num_heads:
                _fail(c, "num_heads", self.num_heads,
                      f"must divide d_model={self.d_model} when head_dim=0")
            if self.rope_dim % 2:
                _fail(c, "head_dim", self.rope_dim, "must be even (rotary pairs)")
        else:
            _positive_ints(c, self, ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                     "v_head_dim"))
            if self.qk_rope_head_dim % 2:
                _fail(c, "qk_rope_head_dim", self.qk_rope_head_dim, "must be even (rotary pairs)")
        if self.moe is not None and self.moe.d_model != self.d_model:
            _fail(c, "moe.d_model", self.moe.d_model, f"must equal d_model={self.d_model}")
        if not self.rope_theta > 0:
            _fail(c, "rope_theta", self.rope_theta, "must be > 0")
        for name in ("norm_eps", "mla_norm_eps"):
            if not getattr(self, name) > 0:
                _fail(c, name, getattr(self, name), "must be > 0")
        if self.mtp_loss_coef < 0:
            _fail(c, "mtp_loss_coef", self.mtp_loss_coef, "must be >= 0")
        _check_dtype(c, "dtype", self.dtype)
        _check_dtype(c, "weight_dtype", self.weight_dtype)
        if not isinstance(self.scan_layers, bool):
            _fail(c, "scan_layers", self.scan_layers, "must be true or false")

    def _check_init(self) -> None:
        c = "ModelConfig"
        _one_of(c, self, "init", INIT_SCHEMES)
        if not (isinstance(self.init_std, (int, float)) and math.isfinite(self.init_std)
                and self.init_std > 0):
            _fail(c, "init_std", self.init_std, "must be a finite number > 0")
        for name in ("head_init_std", "embed_init_std"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                _fail(c, name, v, "must be a finite number >= 0 (0 = the scheme's std)")
        if not isinstance(self.init_residual_scaling, bool):
            _fail(c, "init_residual_scaling", self.init_residual_scaling, "must be true or false")

    def _check_layer_pattern(self) -> None:
        c, pat = "ModelConfig", self.layer_pattern
        if not isinstance(pat, str):
            _fail(c, "layer_pattern", pat, "must be a string of D (dense) / M (MoE) per layer")
        if not pat:
            return
        if len(pat) != self.num_layers or set(pat) - set(LAYER_KINDS):
            _fail(c, "layer_pattern", pat, f"must be {self.num_layers} letters (num_layers), "
                  "each D (dense) or M (MoE)")
        if self.first_k_dense:
            _fail(c, "first_k_dense", self.first_k_dense,
                  "must be 0 when layer_pattern is set (the pattern says which layers are dense)")
        if self.moe is None and "M" in pat:
            _fail(c, "layer_pattern", pat, "has MoE layers (M) but moe is None")

    def _check_rope(self) -> None:
        c = "ModelConfig"
        _one_of(c, self, "rope_type", ROPE_TYPES)
        if self.rope_type == "yarn":
            if not self.rope_factor >= 1:
                _fail(c, "rope_factor", self.rope_factor, "must be >= 1 for yarn")
            _positive_ints(c, self, ("rope_original_max_position",))
            if not self.rope_beta_fast > self.rope_beta_slow > 0:
                _fail(c, "rope_beta_slow", self.rope_beta_slow,
                      f"must be in (0, rope_beta_fast={self.rope_beta_fast})")
        for name in ("rope_mscale", "rope_mscale_all_dim"):
            if getattr(self, name) < 0:
                _fail(c, name, getattr(self, name), "must be >= 0")

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def mha_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.num_heads

    @property
    def rope_dim(self) -> int:
        """Rotary dims per head: all of them for mha, the decoupled part for mla."""
        return self.mha_head_dim if self.attention == "mha" else self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        if self.attention == "mha":
            return self.mha_head_dim
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def v_dim(self) -> int:
        return self.mha_head_dim if self.attention == "mha" else self.v_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer` (0-based) is an MoE layer; the one place that says so."""
        if self.moe is None:
            return False
        if self.layer_pattern:
            return self.layer_pattern[layer] == "M"
        return layer >= self.first_k_dense

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))
