"""Memory per device: weights, gradients, optimizer state, activations, EP buffers.

Legend as in dropless.models.arithmetic; T tokens per device in one forward and backward pass
(one micro-batch, `PlanConfig.micro_tokens_per_device`), b bytes per activation element.

Activations are a catalogue of the tensors one layer produces per token (name, elements,
bytes, kind), in two blocks (attention, feed-forward). The run's remat policy decides which are
kept for the backward pass (`plan.layout.REMAT`: none keeps every tensor, minimal layer inputs
and matmul outputs, full and offload layer inputs only; the `offload` tensors (query, value) go
to host memory). Tensors on the expert side of a dispatch live in static receive buffers, so
they scale with `ragged_buffer_factor`.

The peak of a step is the state (`weight_memory`: parameters, optimizer state, the gathered
and cast weights, the accumulator) plus what its backward pass holds at once, which depends on
the layer layout (`ModelConfig.scan_layers`):
  * scanned: the scan's stacked kept activations of all layers and its stacked gradients of
    all parameters (`gradients`) are alive together, with one layer's workspace (its whole set
    of tensors recomputed, and their gradients: twice the largest layer's,
    `Activations.layer`) and the output head's `logits` (bf16, and float32 for the loss).
  * unrolled: each layer's kept activations are freed as its backward pass writes its
    gradients, so the backward holds, at its start, every layer's kept activations and only
    the embedding's and head's gradients, and at its end all gradients and one layer's
    activations; the peak is the larger end (`unrolled_gradients`: `gradients` is what the
    gradients add beyond the activations). The backward runs one block at a time:
    `layer_workspace` is the largest block's tensors and their gradients
    (`workspace_bytes_per_token`, `Activations.block`), and the head's logits, freed before
    the last layer's backward begins, count only where they exceed it (`logits` is that
    excess). Under `num_vocab_tiling` N the logits live a tile at a time: 1/N of them. Measured against XLA's compiled step: tests/train/test_preflight*_gpu_compile.py.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

from dropless.config import MeshConfig, ModelConfig
from dropless.machine import HardwareProfile
from dropless.models.arithmetic import attention_matmul_params, attention_params
from dropless.plan import comm
from dropless.plan.layout import REMAT, PlanConfig, weight_shards
from dropless.plan.model_numbers import layer_params, param_counts

GiB = 2 ** 30
# Gradient accumulation adds up the micro-batches' gradients in float32 (TrainConfig's
# gradient_accumulation_steps).
ACCUMULATOR_BYTES = 4


class Tensor(NamedTuple):
    name: str
    elems: float       # per token
    nbytes: int        # per element
    kind: str          # input | dot | attention | elementwise | expert_dot | expert_elementwise


def attention_tensors(s: ModelConfig, b: int, naive_seq: int = 0) -> list[Tensor]:
    """One attention block's activations per token (`naive_seq` > 0: the S x S scores and
    probabilities of unfused attention over sequences of that length are materialised)."""
    d, h = s.d_model, s.num_heads
    t = [Tensor("layer_input", d, b, "input"), Tensor("attn_norm", d, b, "elementwise")]
    if s.attention == "mla":
        n, r = s.qk_nope_head_dim, s.qk_rope_head_dim
        if s.q_lora_rank:
            t += [Tensor("q_down", s.q_lora_rank, b, "dot"),
                  Tensor("q_norm", s.q_lora_rank, b, "elementwise")]
        t += [Tensor("query", h * (n + r), b, "dot"),
              Tensor("kv_down", s.kv_lora_rank + r, b, "dot"),
              Tensor("kv_norm", s.kv_lora_rank, b, "elementwise"),
              Tensor("key", h * n, b, "dot"), Tensor("value", h * s.v_head_dim, b, "dot"),
              Tensor("qk_rope", 2 * h * (n + r), b, "elementwise")]
    else:
        kh, g = s.mha_head_dim, s.kv_heads
        t += [Tensor("query", h * kh, b, "dot"), Tensor("key", g * kh, b, "dot"),
              Tensor("value", g * kh, b, "dot"), Tensor("qk_rope", (h + g) * kh, b,
                                                        "elementwise")]
    # the attention core's outputs (kind "attention"): products with batch dims, or a fused
    # kernel's, which only `none` keeps
    if naive_seq:
        t += [Tensor("attn_scores", h * naive_seq, 4, "elementwise"),
              Tensor("attn_probs", h * naive_seq, b, "attention")]
    else:
        t.append(Tensor("attn_lse", h, 4, "attention"))
    t += [Tensor("attn_out", h * s.v_dim, b, "attention"), Tensor("out_proj", d, b, "dot")]
    return t


def ffn_tensors(s: ModelConfig, b: int, moe: bool) -> list[Tensor]:
    """One feed-forward block's activations per token (dense SwiGLU or MoE)."""
    d = s.d_model
    t = [Tensor("mlp_input", d, b, "elementwise"), Tensor("mlp_norm", d, b, "elementwise")]
    if not moe:
        return t + [Tensor("gate", s.d_ff, b, "dot"), Tensor("up", s.d_ff, b, "dot"),
                    Tensor("hidden", s.d_ff, b, "elementwise"), Tensor("down", d, b, "dot")]
    k, f = s.moe.top_k, s.moe.d_ff
    t += [Tensor("router_logits", s.moe.num_experts, 4, "dot"),
          Tensor("dispatched", k * d, b, "expert_elementwise"),
          Tensor("expert_gate", k * f, b, "expert_dot"),
          Tensor("expert_up", k * f, b, "expert_dot"),
          Tensor("expert_hidden", k * f, b, "expert_elementwise"),
          Tensor("expert_down", k * d, b, "expert_dot"),
          Tensor("combined", d, b, "elementwise")]
    if s.moe.num_shared_experts:
        fs = s.moe.num_shared_experts * f
        t += [Tensor("shared_gate", fs, b, "dot"), Tensor("shared_up", fs, b, "dot"),
              Tensor("shared_hidden", fs, b, "elementwise"), Tensor("shared_down", d, b, "dot")]
    return t


def block_tensors(s: ModelConfig, b: int, moe: bool, naive_seq: int = 0
                  ) -> tuple[list[Tensor], list[Tensor]]:
    """One layer's activations per token as its two blocks: (attention, feed-forward)."""
    return attention_tensors(s, b, naive_seq), ffn_tensors(s, b, moe)


def layer_tensors(s: ModelConfig, b: int, moe: bool, naive_seq: int = 0) -> list[Tensor]:
    """One layer's activations per token: its attention block's, then its feed-forward's."""
    attention, ffn = block_tensors(s, b, moe, naive_seq)
    return attention + ffn


def naive_seq(cfg: PlanConfig) -> int:
    return cfg.run.seq_len if cfg.attention_impl == "naive" else 0


def _scale(t: Tensor, factor: float) -> float:
    return t.elems * t.nbytes * (factor if t.kind.startswith("expert") else 1.0)


def saved_bytes_per_token(tensors: list[Tensor], remat: str, offloaded: tuple[str, ...],
                          factor: float) -> tuple[float, float]:
    """(device bytes, host bytes) per token kept for the backward pass under `remat`."""
    keeps = REMAT[remat].keeps
    device = host = 0.0
    for t in tensors:
        if t.name in offloaded:
            host += _scale(t, factor)
        elif keeps is None or t.kind in keeps:
            device += _scale(t, factor)
    return device, host


def all_bytes_per_token(tensors: list[Tensor], factor: float) -> float:
    return sum(_scale(t, factor) for t in tensors)


def workspace_bytes_per_token(tensors: list[Tensor], factor: float) -> float:
    """Bytes per token one block's backward pass holds at once: its tensors and their
    gradients (twice its whole set), less the naive attention's probabilities once: of its four
    S x S products (scores, probabilities and their gradients) three are alive together, the
    softmax's backward consuming the probabilities' gradient as it writes the scores'."""
    probs = sum(_scale(t, factor) for t in tensors if t.name == "attn_probs")
    return 2 * all_bytes_per_token(tensors, factor) - probs


def layer_weight_lengths(s: ModelConfig, moe: bool, attention: bool = True
                         ) -> dict[tuple[str, int | None], float]:
    """One layer's parameters by placement group (`plan.layout.WEIGHT_GROUPS`) and the length
    of their FSDP dim (parallel/sharding.py PARAM_AXES; None for the replicated ones, which
    have none): the routed experts' (D), MLA's query and key/value latent ranks (wq_b, wkv_b),
    the model dim (every other matrix); the norm vectors and the router replicated.
    `attention=False`: the feed-forward / MoE block alone (no attention, no norms)."""
    return dict(_layer_weight_lengths(s, moe, attention))


# the model's numbers below depend on the model alone: a layout search asks for them once a
# candidate, thousands of times (tuples: a cached value is never changed by a caller)
@functools.lru_cache(maxsize=256)
def _layer_weight_lengths(s: ModelConfig, moe: bool, attention: bool
                          ) -> tuple[tuple[tuple[str, int | None], float], ...]:
    d, p = s.d_model, layer_params(s, moe)
    out: dict[tuple[str, int | None], float] = {}

    def add(key, n):
        if n:
            out[key] = out.get(key, 0.0) + n
    add(("experts", d), p.get("routed_experts", 0))
    add(("replicated", None), p.get("router", 0))
    add(("sharded", d), p.get("dense_ffn", 0) + p.get("shared_experts", 0))
    if not attention:
        return tuple(out.items())
    matmuls = attention_matmul_params(s)
    add(("replicated", None), p["norms"] + sum(attention_params(s).values())
        - sum(matmuls.values()))
    for k, n in matmuls.items():
        mla = s.attention != "mha"
        length = (s.q_lora_rank if mla and k == "query" and s.q_lora_rank
                  else s.kv_lora_rank if mla and k in ("key", "value") else d)
        add(("sharded", length), n)
    return tuple(out.items())


def weight_groups(s: ModelConfig) -> dict[str, float]:
    """Parameters by placement group (`plan.layout.WEIGHT_GROUPS`), MTP modules included:
    `experts` (the routed experts), `replicated` (norm vectors, the router's weights and bias)
    and `sharded` (everything else: attention and dense or shared-expert matrices, embedding,
    head, MTP projections)."""
    out = dict.fromkeys(("experts", "replicated", "sharded"), 0.0)
    for (group, _), n in block_weight_lengths(s).items():
        out[group] += n
    return out


def block_weight_lengths(s: ModelConfig) -> dict[tuple[str, int | None], float]:
    """The whole model's parameters keyed as `layer_weight_lengths` keys one layer's: every
    block's (the MTP modules' included), the final norm and the MTP modules' three norms
    (replicated), the vocabulary's (embedding and head) and 2D (the MTP projections)."""
    return dict(_block_weight_lengths(s))


@functools.lru_cache(maxsize=64)
def _block_weight_lengths(s: ModelConfig) -> tuple[tuple[tuple[str, int | None], float], ...]:
    d, c = s.d_model, param_counts(s)
    out = {("sharded", s.vocab_size): float(c["embedding"] + c["lm_head"]),
           ("replicated", None): float(d + s.mtp_depth * 3 * d)}
    if s.mtp_depth:
        out["sharded", 2 * d] = float(s.mtp_depth * 2 * d * d)
    blocks = [s.is_moe_layer(i) for i in range(s.num_layers)]
    for moe in blocks + [s.moe is not None] * s.mtp_depth:
        for key, n in layer_weight_lengths(s, moe).items():
            out[key] = out.get(key, 0.0) + n
    return tuple(out.items())


def sharded_lengths(s: ModelConfig) -> dict[int, float]:
    """The `sharded` group's parameters (`weight_groups`) by the length of their FSDP dim
    (`block_weight_lengths`)."""
    return {length: n for (group, length), n in block_weight_lengths(s).items()
            if group == "sharded"}


def sharded_params(cfg: PlanConfig) -> float:
    """Parameters one device holds, each group split as the trainer places it
    (`plan.layout.weight_shards`): the routed experts over expert x fsdp, the other matrices
    over fsdp x expert too (ZeRO-3 over both), norms and the router whole; a dim a mesh axis
    does not divide is whole over that axis (`sharded_lengths`)."""
    return _sharded_params(cfg.model, cfg.mesh)


@functools.lru_cache(maxsize=1024)   # asked several times a plan, once a search's candidate
def _sharded_params(s: ModelConfig, m: MeshConfig) -> float:
    g = weight_groups(s)
    return (g["replicated"] + g["experts"] / weight_shards(m, "experts", length=s.d_model)
            + sum(n / weight_shards(m, "sharded", length=k)
                  for k, n in sharded_lengths(s).items()))


def frozen_params(s: ModelConfig) -> int:
    """Parameters without optimizer state: the router biases (MTP modules' too), which the
    trainer's AdamW leaves to aux-loss-free balancing; whole on every device (`replicated`)."""
    return param_counts(s)["router_bias"] + (s.mtp_depth * s.moe.num_experts
                                             if s.moe is not None else 0)


def compute_weight_params(cfg: PlanConfig) -> float:
    """Parameters of the decoder blocks (and MTP modules) one device holds: what
    `models.decoder.compute_weights` casts; the embedding and the output head are not cast."""
    c = param_counts(cfg.model)
    return (sharded_params(cfg) - (c["embedding"] + c["lm_head"])
            / weight_shards(cfg.mesh, "sharded", length=cfg.model.vocab_size))


def casts_weights_once(cfg: PlanConfig) -> bool:
    """Whether the blocks' weights are cast to a narrower compute dtype once a step
    (`models.decoder.casts_weights_once`: a one-device plan)."""
    return cfg.activation_bytes < cfg.weight_bytes and cfg.mesh.num_devices == 1


def weight_memory(cfg: PlanConfig) -> dict[str, float]:
    """Bytes per device of the weights' parts.

    `parameters`, `gradients` (all of them, in the weights' dtype) and `optimizer_state` (2
    Adam moments, plus a float32 master copy when `master_weights`, of every parameter but the
    `frozen_params`) are split as the trainer places them (`sharded_params`).
    `gathered_weights` holds two layers' worth of all-gathered weights (the layer being
    computed and the one prefetched: its FSDP dims whole, its routed experts the device's
    own). `compute_weights`: where the blocks' weights are cast once a
    step (`casts_weights_once`), the cast copies, alive through the step. With gradient
    accumulation (`cfg.accumulation` > 1) `grad_accumulator` is the step's float32 sum of the
    micro-batches' gradients, the accumulation scan's carry (0 without accumulation;
    `gradients` are one micro-batch's)."""
    s = cfg.model
    wb, ob, ab = cfg.weight_bytes, cfg.optimizer_bytes, cfg.activation_bytes
    params = sharded_params(cfg)
    out = {"parameters": params * wb, "gradients": params * wb,
           "grad_accumulator": params * ACCUMULATOR_BYTES if cfg.accumulation > 1 else 0.0,
           "optimizer_state": (params - frozen_params(s))
                              * (2 * ob + (4 if cfg.master_weights else 0))}
    local = weight_shards(cfg.mesh, "experts", gathered=True)
    moe_l, dense_l = layer_params(s, True) if s.moe is not None else None, layer_params(s, False)
    biggest = max(sum(dense_l.values()),
                  (sum(moe_l.values()) - moe_l["routed_experts"]
                   + moe_l["routed_experts"] / local) if moe_l else 0)
    out["gathered_weights"] = 2 * biggest * ab
    out["compute_weights"] = compute_weight_params(cfg) * ab if casts_weights_once(cfg) else 0.0
    return out


class Activations(NamedTuple):
    """One micro-batch's activation bytes per device."""
    kept: float    # every layer's tensors kept for the backward pass, on the device
    host: float    # the same, offloaded to host memory
    layer: float   # twice the largest layer's whole set (its tensors and their gradients)
    block: float   # the largest block's (attention or feed-forward) workspace_bytes_per_token


def activation_memory(cfg: PlanConfig) -> Activations:
    """The activations of one micro-batch (`micro_tokens_per_device`) as `Activations`."""
    s, ab, t = cfg.model, cfg.activation_bytes, cfg.micro_tokens_per_device
    f = s.moe.ragged_buffer_factor if s.moe is not None and cfg.mesh.expert > 1 else 1.0
    ns = naive_seq(cfg)
    kinds = [(s.num_layers - s.num_moe_layers, False)]
    if s.num_moe_layers:
        kinds.append((s.num_moe_layers + s.mtp_depth, True))
    kept = host = layer = block = 0.0
    for count, moe in kinds:
        blocks = block_tensors(s, ab, moe, ns)
        d_, h_ = saved_bytes_per_token(blocks[0] + blocks[1], cfg.run.remat, cfg.offloaded, f)
        kept += count * d_ * t
        host += count * h_ * t
        layer = max(layer, 2 * all_bytes_per_token(blocks[0] + blocks[1], f) * t)
        block = max(block, *(workspace_bytes_per_token(b_, f) * t for b_ in blocks))
    return Activations(kept, host, layer, block)


def unrolled_gradients(cfg: PlanConfig, kept: float) -> float:
    """Gradient bytes an unrolled step holds at its peak beyond the `kept` activations: the
    embedding's and the output head's, written before the layers' backward pass, and what the
    layers' exceed the activations they replace. Where the blocks' weights are cast once
    (`casts_weights_once`), a block's gradients come in the compute dtype as its cast weights
    die, in their place: nothing to add."""
    blocks = compute_weight_params(cfg)
    head = (sharded_params(cfg) - blocks) * cfg.weight_bytes
    written = 0.0 if casts_weights_once(cfg) else blocks * cfg.weight_bytes
    return head + max(0.0, written - kept)


def memory_per_device(cfg: PlanConfig, hw: HardwareProfile) -> dict[str, float]:
    """Bytes per device by part, their sum (`total`), the device's usable memory and whether
    the total fits, for the model's layer layout as the module docstring describes.

    The parts: `weight_memory`'s, then one micro-batch's (`micro_tokens_per_device`) whatever
    the accumulation: `activations` (`Activations.kept`), `layer_workspace`, `logits` and
    `ep_buffers` (the dispatch/combine send and receive buffers of one layer). `gradients` and
    `logits` are what the layout holds of them at its peak (module docstring).
    `host_offloaded` is the offloaded activations' host bytes, outside the total."""
    s = cfg.model
    out = weight_memory(cfg)
    act = activation_memory(cfg)
    logits = float(cfg.micro_tokens_per_device * s.vocab_size * (cfg.activation_bytes + 4)
                   * (1 + s.mtp_depth)) / cfg.run.num_vocab_tiling
    out["activations"] = act.kept
    if s.scan_layers:
        out.update(layer_workspace=act.layer, logits=logits)
    else:
        out.update(gradients=unrolled_gradients(cfg, act.kept), layer_workspace=act.block,
                   logits=max(0.0, logits - act.block))
    out["ep_buffers"] = (comm.ep_buffer_bytes(cfg) if s.moe is not None and cfg.mesh.expert > 1
                         else 0.0)
    total = sum(out.values())
    usable = hw.usable_memory
    out.update(total=total, host_offloaded=act.host, device_memory=hw.hbm_bytes, usable=usable,
               fits=total <= usable, headroom=usable - total)
    return out


def verdict(mem: dict[str, float]) -> str:
    """'fits, 12.3 GiB to spare' / 'does not fit: 40.1 GiB over (...)'."""
    gib = abs(mem["headroom"]) / GiB
    if mem["fits"]:
        return f"fits: {mem['total'] / GiB:.1f} GiB of {mem['usable'] / GiB:.1f} GiB usable, " \
               f"{gib:.1f} GiB to spare"
    return f"does not fit: {mem['total'] / GiB:.1f} GiB needed, {mem['usable'] / GiB:.1f} GiB " \
           f"usable, {gib:.1f} GiB over"

