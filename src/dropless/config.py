"""Typed, frozen, keyword-only configs, validated on construction.

Every error names the field and the value, e.g. `MoEConfig.top_k=9 must be <= num_experts=8`.
Every field carries its one-line description (`described`), from which `config_docs` writes the
configuration reference, docs/config.md.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import typing
from typing import Any

import jax.numpy as jnp

from dropless.runtime.environment import check_environment
from dropless.runtime.xla_flags import RECIPES, check_flags

SCORE_FUNCS = ("softmax", "sigmoid")
GMM_QUANTIZATIONS = ("none", "mxfp8", "nvfp4")
# The expert-parallel strategies, each with what it does. config sits below moe, so it names
# them and moe/dispatch/registry.py builds each one's spec from these names (its import fails
# when a name here has no implementation there)
DISPATCH_STRATEGIES: dict[str, str] = {
    "allgather": "gather all tokens, run local experts, reduce-scatter back",
    "a2a": "deduplicated rows over all_to_all in static per-peer chunks (every backend)",
    "ragged_a2a": "deduplicated rows over ragged_all_to_all (GPU/TPU; padding never travels)",
    "node_a2a": "node-level dedup: one row per (token, node) across nodes, fanned out inside "
                "the node",
}
# MoEConfig.dispatcher's values: "auto" (a strategy chosen per mesh and platform), "local" (no
# dispatcher: the single-device layer), then the strategies
DISPATCHERS = ("auto", "local", *DISPATCH_STRATEGIES)
OVERFLOW_POLICIES = ("rounds", "error")
# How documents fill a batch's rows (TrainConfig.packing): "documents" packs several per row with
# segment ids and positions that restart per document, attention and loss never crossing a
# boundary (MaxText's packing=true); "pad" holds one document per row, padded (packing=false);
# "stream" joins documents with EOS and lets windows run across them (runs made before packing).
PACKINGS = ("documents", "pad", "stream")
# ModelConfig.init's schemes (models/init.py holds each one's table: per parameter kind, the
# distribution and std) and the fields that only say how a model starts (they never change the
# parameter tree, so weights trained under one scheme load under another)
INIT_SCHEMES = ("fan_in", "normal", "maxtext", "legacy")
INIT_FIELDS = ("init", "init_std", "head_init_std", "embed_init_std", "init_residual_scaling")


def _fail(cls: str, field: str, value: Any, why: str) -> None:
    raise ValueError(f"{cls}.{field}={value!r} {why}")


DOC = "doc"   # the metadata key of a config field's one-line description


def described(default: Any = dataclasses.MISSING, *, doc: str) -> Any:
    """A dataclass field carrying its one-line description `doc` in its metadata (under `DOC`):
    the one place a config key is described (`config_docs` writes docs/config.md from it).
    `default` is `dataclasses.field`'s; without one the field is required."""
    return dataclasses.field(default=default, metadata={DOC: doc})


SCALAR_WORDS = {bool: "true or false", int: "an int", float: "a finite number", str: "a string"}


@functools.lru_cache(maxsize=None)
def scalar_fields(cls) -> dict[str, tuple[type, bool]]:
    """name -> (bool | int | float | str, whether None is allowed) for each of `cls`'s scalar
    fields (nested configs are left out). The one description of what a config value may be."""
    out = {}
    for name, hint in typing.get_type_hints(cls).items():
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        base = args[0] if len(args) == 1 else hint
        if base in SCALAR_WORDS:
            out[name] = (base, type(None) in typing.get_args(hint))
    return out


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    name = {bool: "a boolean", int: "an int", float: "a float", str: "a string", list: "a list",
            dict: "a mapping"}.get(type(value), f"a {type(value).__name__}")
    return name


def scalar_type_error(value: Any, base: type, optional: bool) -> str | None:
    """Why `value` cannot be a config value of type `base` ('must be ..., not ...'), or None when
    it can. Booleans are strict (no 0/1, no strings), ints are not floats, floats are finite and
    accept ints; numpy scalars count as the Python type they stand for."""
    if value is None:
        ok = optional
    elif base is bool:
        ok = isinstance(value, bool) or type(value).__name__ == "bool_"
    elif base is int:
        ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    elif base is float:
        ok = (isinstance(value, numbers.Real) and not isinstance(value, bool)
              and math.isfinite(value))
    else:
        ok = isinstance(value, base)
    if ok:
        return None
    return f"must be {SCALAR_WORDS[base]}{' or null' if optional else ''}, not {_describe(value)}"


def _check_types(obj: Any) -> None:
    """Every scalar field of a config dataclass holds a value of its declared type."""
    cls = type(obj)
    for name, (base, optional) in scalar_fields(cls).items():
        why = scalar_type_error(getattr(obj, name), base, optional)
        if why:
            _fail(cls.__name__, name, getattr(obj, name), why)


def _positive_ints(cls: str, obj: Any, names: tuple[str, ...], *, allow_zero: bool = False) -> None:
    """Each field in `names` holds an int > 0 (>= 0 with `allow_zero`); bools are not ints."""
    for name in names:
        v = getattr(obj, name)
        ok = isinstance(v, int) and not isinstance(v, bool) and (v >= 0 if allow_zero else v > 0)
        if not ok:
            _fail(cls, name, v, "must be an int >= 0" if allow_zero else "must be a positive int")


def _one_of(cls: str, obj: Any, name: str, choices: tuple[str, ...]) -> None:
    """Field `name` holds one of `choices`."""
    if getattr(obj, name) not in choices:
        _fail(cls, name, getattr(obj, name), f"must be one of {choices}")


def _check_dtype(cls: str, field: str, value: str) -> None:
    try:
        dt = jnp.dtype(value)
    except TypeError:
        _fail(cls, field, value, "is not a dtype name (try 'float32' or 'bfloat16')")
    if not jnp.issubdtype(dt, jnp.floating):
        _fail(cls, field, value, "must be a floating dtype")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """One MoE layer: routing, experts, the grouped-matmul backend and the dispatcher.

    `capacity_factor=None` (the default) is dropless. A number selects the capacity baseline:
    each expert takes at most ceil(T * top_k / num_experts * capacity_factor) rows and the rest
    are dropped (counted in `aux["dropped_tokens"]`), as Switch Transformer and MaxText's dense
    path do.
    """

    num_experts: int = described(doc="routed experts in the layer")
    top_k: int = described(doc="experts each token is routed to")
    d_model: int = described(doc="the layer's input and output width; must equal model.d_model, "
                                 "which sets it too")
    d_ff: int = described(doc="hidden width of each expert's SwiGLU")
    num_shared_experts: int = described(
        0, doc="experts every token passes through beside its top_k, run as one SwiGLU of "
               "width num_shared_experts x d_ff")
    score_func: str = described(
        "softmax", doc="router scores: softmax over the experts (Mixtral, Qwen3-MoE) or an "
                       "independent sigmoid per expert (DeepSeek-V3)")
    norm_topk_prob: bool = described(
        True, doc="renormalise the chosen experts' weights to sum to one")
    routed_scaling_factor: float = described(
        1.0, doc="multiplies the routed experts' combine weights (DeepSeek-V3: 2.5)")
    n_groups: int = described(
        1, doc="expert groups for group-limited routing (DeepSeek-V3: 8); 1 = no groups")
    topk_groups: int = described(
        1, doc="groups a token may choose experts from: those whose two best scores sum highest")
    capacity_factor: float | None = described(
        None, doc="null = dropless; a number = the capacity baseline: each expert keeps at most "
                  "ceil(tokens x top_k / num_experts x capacity_factor) rows, the rest dropped")
    gmm_backend: str = described(
        "auto", doc="grouped-matmul backend: auto (chosen per platform when lowered) or a name "
                    "in the ops.gmm registry (an unknown name's error lists them)")
    gmm_quantization: str = described(
        "none", doc="expert matmuls in low precision: none, mxfp8 (docs/mxfp8.md) or nvfp4 "
                    "(docs/nvfp4.md)")
    mx_scale_rounding: str = described(
        "floor", doc="MXFP8 block scales rounded floor (the OCP spec) or up (never saturates)")
    mx_grad_elem: str = described("e4m3", doc="MXFP8 element format of gradients: e4m3 or e5m2")
    # NVFP4 recipe pieces (gmm_quantization="nvfp4"; docs/nvfp4.md)
    nvfp4_weight_blocks: str = described(
        "2d", doc="NVFP4 weight scale blocks: 2d (16x16) or 1d (1x16)")
    nvfp4_tensor_scale: bool = described(
        True, doc="NVFP4: an FP32 per-tensor scale above the block scales")
    nvfp4_rht: bool = described(
        True, doc="NVFP4: a random Hadamard transform on the weight-gradient matmul's inputs")
    nvfp4_stochastic_rounding: bool = described(
        True, doc="NVFP4: gradients quantized with stochastic rounding")
    nvfp4_seed: int = described(
        0, doc="NVFP4: seed of the Hadamard signs and of the rounding key (< 2^32)")
    # rows travel as 1x32 E4M3 blocks with E8M0 scales; the combine stays in `dtype`
    dispatch_quantization: str = described(
        "none", doc="none, or mxfp8: routed rows quantized once before the dispatch, sent so "
                    "and fed to the MXFP8 grouped matmul (needs gmm_quantization=mxfp8; "
                    "docs/fp8_dispatch.md)")
    dtype: str = described("float32", doc="activations and the expert matmuls' inputs")
    weight_dtype: str = described(
        "float32", doc="stored expert and shared-expert weights (the router stays float32)")
    prefuse_moe_weights: bool = described(
        False, doc="experts hold one [E, D, 2F] gate+up weight instead of two")
    load_balance_coef: float = described(
        0.0, doc="weight of the Switch/Mixtral load-balance loss (Mixtral: 0.02)")
    seq_aux_coef: float = described(
        0.0, doc="weight of DeepSeek-V3's sequence-wise balance loss (V3: 1e-4)")
    z_loss_coef: float = described(0.0, doc="weight of the ST-MoE router z-loss (1e-3 there)")
    # None = by score function: 0.001 for sigmoid (DeepSeek-V3), 0.0 for softmax: Mixtral and
    # Qwen3-MoE have no routing bias, and updating one would make a fine-tuned model's routing
    # drift from the reference it was loaded from.
    bias_update_speed: float | None = described(
        None, doc="DeepSeek-V3's gamma, the update speed of the aux-loss-free routing bias; "
                  "null = 0.001 for sigmoid, 0.0 for softmax")
    # expert parallelism (used only when a mesh with an `expert` axis is given)
    dispatcher: str = described(
        "auto", doc="how routed rows reach their experts' devices: auto (by mesh and "
                    "platform), local (no dispatcher), allgather, a2a, ragged_a2a or node_a2a")
    ragged_buffer_factor: float = described(
        2.0, doc="expert-parallel send/receive buffers hold this x the rows a balanced routing "
                 "sends each peer (>= 1)")
    overflow: str = described(
        "rounds", doc="rows past a full buffer: rounds (sent in extra rounds, none dropped) or "
                      "error (dropped; the run stops at the last good step)")
    overflow_check_every_n_steps: int = described(
        1, doc="with overflow=error: steps between the loop's reads of the overflow flag (each "
               "read is a host sync)")
    # each chunk is its own dispatch -> experts -> combine, so chunk i+1's dispatch and chunk
    # i-1's combine can run while chunk i computes (moe/dispatch/overlap.py). Megatron-Core's
    # nearest is overlap_moe_expert_parallel_comm (two micro-batches); Tutel / DeepSpeed call
    # this number a2a_ffn_overlap_degree.
    ep_comm_overlap_chunks: int = described(
        1, doc="each device's tokens in this many chunks so the dispatch overlaps the expert "
               "matmuls (docs/overlap.md); 1 = off")

    def __post_init__(self) -> None:
        c = "MoEConfig"
        _check_types(self)
        _positive_ints(c, self, ("num_experts", "top_k", "d_model", "d_ff", "n_groups",
                                 "overflow_check_every_n_steps", "ep_comm_overlap_chunks"))
        _positive_ints(c, self, ("num_shared_experts",), allow_zero=True)
        if self.top_k > self.num_experts:
            _fail(c, "top_k", self.top_k, f"must be <= num_experts={self.num_experts}")
        _one_of(c, self, "score_func", SCORE_FUNCS)
        if not self.routed_scaling_factor > 0:
            _fail(c, "routed_scaling_factor", self.routed_scaling_factor, "must be > 0")
        if self.num_experts % self.n_groups:
            _fail(c, "n_groups", self.n_groups,
                  f"must divide num_experts={self.num_experts}")
        if not isinstance(self.topk_groups, int) or not 0 < self.topk_groups <= self.n_groups:
            _fail(c, "topk_groups", self.topk_groups, f"must be in [1, n_groups={self.n_groups}]")
        if self.n_groups > 1:
            reachable = self.topk_groups * (self.num_experts // self.n_groups)
            if reachable < self.top_k:
                _fail(c, "topk_groups", self.topk_groups,
                      f"leaves {reachable} selectable experts, fewer than top_k={self.top_k}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            _fail(c, "capacity_factor", self.capacity_factor, "must be > 0, or None for dropless")
        _one_of(c, self, "gmm_quantization", GMM_QUANTIZATIONS)
        _one_of(c, self, "mx_scale_rounding", ("floor", "up"))
        _one_of(c, self, "mx_grad_elem", ("e4m3", "e5m2"))
        _one_of(c, self, "nvfp4_weight_blocks", ("2d", "1d"))
        _positive_ints(c, self, ("nvfp4_seed",), allow_zero=True)
        if self.nvfp4_seed >= 2 ** 32:
            _fail(c, "nvfp4_seed", self.nvfp4_seed, "must be < 2**32")
        _one_of(c, self, "dispatch_quantization", ("none", "mxfp8"))
        if self.dispatch_quantization == "mxfp8" and self.gmm_quantization != "mxfp8":
            _fail(c, "dispatch_quantization", self.dispatch_quantization,
                  f"needs gmm_quantization='mxfp8' (got {self.gmm_quantization!r}): the MXFP8 "
                  f"grouped matmul is what consumes the dispatched rows")
        if not isinstance(self.prefuse_moe_weights, bool):
            _fail(c, "prefuse_moe_weights", self.prefuse_moe_weights, "must be a bool")
        _check_dtype(c, "dtype", self.dtype)
        _check_dtype(c, "weight_dtype", self.weight_dtype)
        if self.bias_update_speed is None:
            object.__setattr__(self, "bias_update_speed",
                               0.001 if self.score_func == "sigmoid" else 0.0)
        for name in ("load_balance_coef", "seq_aux_coef", "z_loss_coef", "bias_update_speed"):
            if getattr(self, name) < 0:
                _fail(c, name, getattr(self, name), "must be >= 0")
        if not self.ragged_buffer_factor >= 1.0:
            _fail(c, "ragged_buffer_factor", self.ragged_buffer_factor, "must be >= 1.0")
        _one_of(c, self, "overflow", OVERFLOW_POLICIES)
        # the backend name is checked against its registry (below config), read at call time
        from dropless.ops.gmm.registry import check_backend_name
        check_backend_name(self.gmm_backend, where="MoEConfig.gmm_backend")
        _one_of(c, self, "dispatcher", DISPATCHERS)

    def replace(self, **changes: Any) -> "MoEConfig":
        return dataclasses.replace(self, **changes)

    @property
    def experts_per_group(self) -> int:
        return self.num_experts // self.n_groups


MESH_AXES = ("data", "fsdp", "expert")   # the mesh axes, in mesh order


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """The device mesh: sizes of the `data`, `fsdp` and `expert` axes (product = device count),
    and of each, how many nodes (ICI domains, MaxText's dcn_*) it spans; the rest of the axis is
    inside one node.

    Tokens are sharded over all three axes; expert weights over `expert` (their first dim) and,
    with fsdp > 1, over `fsdp` (their model dim). Devices are grouped into nodes of
    `devices_per_node` consecutive ids (`parallel.mesh.make_mesh`); the expert axis varies
    fastest, so an expert group stays inside a node when dcn_expert = 1. The node size is read
    from here only: `parallel.mesh.train_mesh` puts it beside the mesh (a `NodeMesh`), which is
    how the dispatcher gets it.
    """

    data: int = described(1, doc="devices on the data axis: the batch split, weights replicated")
    fsdp: int = described(1, doc="devices on the fsdp axis: the batch split, weights and "
                                 "optimizer state sharded")
    expert: int = described(1, doc="devices on the expert axis: the batch split, experts "
                                   "divided among them (must divide model.moe.num_experts)")
    dcn_data: int = described(1, doc="nodes the data axis spans (divides data); the rest of the "
                                     "axis is inside a node")
    dcn_fsdp: int = described(1, doc="nodes the fsdp axis spans (divides fsdp)")
    dcn_expert: int = described(1, doc="nodes the expert axis spans (divides expert)")

    def __post_init__(self) -> None:
        c = "MeshConfig"
        _check_types(self)
        _positive_ints(c, self, MESH_AXES + tuple(f"dcn_{a}" for a in MESH_AXES))
        for axis in MESH_AXES:
            total, dcn = getattr(self, axis), getattr(self, f"dcn_{axis}")
            if total % dcn:
                _fail(c, f"dcn_{axis}", dcn, f"must divide {axis}={total}")

    @property
    def shape(self) -> tuple[int, ...]:
        """Axis sizes in MESH_AXES order."""
        return tuple(getattr(self, a) for a in MESH_AXES)

    @property
    def dcn_shape(self) -> tuple[int, ...]:
        """Nodes each axis spans, in MESH_AXES order."""
        return tuple(getattr(self, f"dcn_{a}") for a in MESH_AXES)

    @property
    def ici_shape(self) -> tuple[int, ...]:
        """The in-node part of each axis (shape / dcn_shape), in MESH_AXES order."""
        return tuple(n // d for n, d in zip(self.shape, self.dcn_shape))

    @property
    def num_devices(self) -> int:
        return math.prod(self.shape)

    @property
    def num_nodes(self) -> int:
        """Nodes (ICI domains) the mesh spans: the product of the dcn_* sizes."""
        return math.prod(self.dcn_shape)

    @property
    def devices_per_node(self) -> int:
        """Devices inside one node: num_devices // num_nodes (the product of the ICI parts)."""
        return self.num_devices // self.num_nodes

    def replace(self, **changes: Any) -> "MeshConfig":
        return dataclasses.replace(self, **changes)


ATTENTION_KINDS = ("mla", "mha")
ROPE_TYPES = ("default", "yarn")
LAYER_KINDS = {"D": "dense", "M": "moe"}
# Each remat policy -> the jax.checkpoint_policies policy it is (None: no rematerialisation);
# models/deepseek.py builds the policy from that name
REMAT_CHECKPOINT_POLICIES: dict[str, str | None] = {
    "none": None,
    "full": "nothing_saveable",
    "minimal": "dots_with_no_batch_dims_saveable",
    "offload": "save_and_offload_only_these_names",   # attention's marked activations to host
}
REMAT_POLICIES = tuple(REMAT_CHECKPOINT_POLICIES)     # TrainConfig.remat's values



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
        0, doc="DeepSeek-V3 multi-token prediction modules; 0 = off")
    mtp_loss_coef: float = described(
        0.3, doc="weight of the mean MTP cross-entropy in the loss")
    dtype: str = described("float32", doc="activations")
    weight_dtype: str = described("float32", doc="stored weights")
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
        _one_of(c, self, "attention", ATTENTION_KINDS)
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training run: the model, optimizer, data, parallelism, checkpoints and metrics.

    The global batch is `per_device_batch_size * number of devices in the mesh`
    (data * fsdp * expert, `mesh`), as in MaxText.
    """

    model: ModelConfig = described(doc="the model; its keys start from the preset's values")
    mesh: MeshConfig = described(
        MeshConfig(), doc="parallelism (MaxText's `ici_*` x `dcn_*` parallelism)")
    preset: str = described(
        "", doc="the named preset the model came from (a key: picks the model to start from, "
                "tiny when none is named)")
    steps: int = described(400, doc="optimizer steps the run trains for")
    per_device_batch_size: int = described(
        16, doc="sequences per device per step; the global batch is this x the mesh's devices")
    seq_len: int = described(128, doc="tokens per sequence")
    learning_rate: float = described(3e-3, doc="peak learning rate, reached after the warmup")
    warmup_steps: int = described(20, doc="steps of linear warmup from 0 to learning_rate")
    min_lr_ratio: float = described(
        0.1, doc="the cosine decays to learning_rate x min_lr_ratio")
    lr_decay_steps: int = described(
        0, doc="step the cosine ends at (constant after); 0 = steps, and a resumed run keeps "
               "its first horizon")
    weight_decay: float = described(
        0.1, doc="AdamW's decoupled weight decay, on matrices only (not norms or biases)")
    adam_b1: float = described(0.9, doc="AdamW's beta1")
    adam_b2: float = described(0.95, doc="AdamW's beta2")
    adam_eps: float = described(1e-8, doc="AdamW's epsilon")
    grad_clip: float = described(1.0, doc="gradients clipped to this global norm; 0 = no clip")
    seed: int = described(0, doc="seed of the initial weights and of the data order")
    init_from: str = described(
        "", doc="start from these weights (fine-tuning): hf:DIR (a Hugging Face folder), a "
                "`dropless convert` output or a run directory")
    remat: str = described(
        "none", doc="rematerialisation: none, full, minimal, or offload (attention's marked "
                    "activations to host)")
    xla_recipe: str = described(
        "none", doc="XLA flags and environment set before JAX starts: none, gpu, or cpu8 (8 "
                    "host devices)")
    xla_flags: str = described(
        "", doc="extra XLA flags (\"--name=value ...\"); MaxText's `xla_*` keys add to them")
    environment: str = described(
        "", doc="\"NAME=value ...\" set before JAX starts; MaxText's environment keys add to it")
    distributed: bool = described(
        False, doc="start jax.distributed from the cluster environment (several processes)")
    # data
    data: str = described(
        "stdlib", doc="training data: stdlib (the Python standard library's .py files), or a "
                      "path: .txt/.py/.md, .jsonl, .npy, .bin, a folder or a prepared dataset")
    tokenizer: str = described(
        "byte", doc="byte (one token per byte), or a path to a Hugging Face tokenizer.json")
    bin_dtype: str = described(
        "uint16", doc="element type of pre-tokenized .bin files: uint8, uint16, int32 or uint32")
    eval_fraction: float = described(
        0.02, doc="share of the data's documents held out for evaluation, where eval_data is "
                  "empty")
    eval_every: int = described(50, doc="steps between evaluations (and one at the end)")
    eval_batches: int = described(2, doc="batches each evaluation reads")
    packing: str = described(
        "documents", doc="documents (several per row, attention and loss never crossing one), "
                         "pad (one per row, padded) or stream (joined with EOS, windows cross)")
    sft: bool = described(
        False, doc="supervised fine-tuning: records are prompt/completion or chat messages")
    sft_completion_only: bool = described(
        True, doc="with sft: the loss counts completion tokens only")
    eval_data: str = described(
        "", doc="held-out data (a path, as data); \"\" = eval_fraction of data")
    prefetch: int = described(2, doc="batches the loader builds ahead of the step")
    # output
    run_dir: str = described("runs", doc="folder the run's directory is made in")
    run_name: str = described("", doc="the run directory's name; \"\" = a timestamped name")
    log_every: int = described(1, doc="steps between printed step lines")
    checkpoint_every: int = described(
        100, doc="steps between checkpoints; 0 = no periodic checkpoints")
    keep_checkpoints: int = described(3, doc="newest checkpoints kept; older ones are deleted")
    async_checkpoints: bool = described(
        True, doc="write checkpoints in the background while training goes on")
    time_kernels: bool = described(
        True, doc="time the grouped matmul, dispatch and combine at start-up (the start record)")
    profile_steps: int = described(
        0, doc="a JAX profiler trace of this many steps, from the third; 0 = none")
    check_nan: bool = described(
        False, doc="stop at the first non-finite loss, gradient or parameter, naming the step, "
                   "layer and parameter (train/nonfinite.py)")

    def __post_init__(self) -> None:
        c = "TrainConfig"
        if not isinstance(self.model, ModelConfig):
            _fail(c, "model", type(self.model).__name__, "must be a ModelConfig")
        if not isinstance(self.mesh, MeshConfig):
            _fail(c, "mesh", type(self.mesh).__name__, "must be a MeshConfig")
        _check_types(self)
        _positive_ints(c, self, ("steps", "per_device_batch_size", "seq_len", "eval_every",
                                 "eval_batches", "log_every", "keep_checkpoints"))
        _positive_ints(c, self, ("warmup_steps", "checkpoint_every", "seed", "profile_steps",
                                 "lr_decay_steps"),
                       allow_zero=True)
        if not self.learning_rate > 0:
            _fail(c, "learning_rate", self.learning_rate, "must be > 0")
        if not 0 <= self.min_lr_ratio <= 1:
            _fail(c, "min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")
        for name in ("weight_decay", "grad_clip", "adam_eps"):
            if getattr(self, name) < 0:
                _fail(c, name, getattr(self, name), "must be >= 0")
        for name in ("adam_b1", "adam_b2"):
            if not 0 <= getattr(self, name) < 1:
                _fail(c, name, getattr(self, name), "must be in [0, 1)")
        _one_of(c, self, "remat", REMAT_POLICIES)
        if not 0 < self.eval_fraction < 1:
            _fail(c, "eval_fraction", self.eval_fraction, "must be in (0, 1)")
        _one_of(c, self, "bin_dtype", ("uint8", "uint16", "int32", "uint32"))
        _one_of(c, self, "packing", PACKINGS)
        if self.sft is True and self.packing == "stream":
            _fail(c, "packing", self.packing, "cannot hold SFT examples (attention would cross "
                  "them): use packing=documents or packing=pad with sft=true")
        _positive_ints(c, self, ("prefetch",), allow_zero=True)
        _one_of(c, self, "xla_recipe", tuple(RECIPES))
        moe = self.model.moe
        if moe is not None and moe.num_experts % self.mesh.expert:
            _fail(c, "mesh.expert", self.mesh.expert,
                  f"must divide model.moe.num_experts={moe.num_experts}")
        for name in ("distributed", "check_nan", "sft", "sft_completion_only"):
            if not isinstance(getattr(self, name), bool):
                _fail(c, name, getattr(self, name), "must be true or false")
        check_flags(self.xla_flags)
        check_environment(self.environment)

    def replace(self, **changes: Any) -> "TrainConfig":
        return dataclasses.replace(self, **changes)

    @property
    def num_devices(self) -> int:
        """Devices of the mesh (`mesh.num_devices`)."""
        return self.mesh.num_devices

    @property
    def global_batch_size(self) -> int:
        return self.per_device_batch_size * self.num_devices
