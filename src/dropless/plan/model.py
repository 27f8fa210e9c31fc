"""The step-time model: compute at an achievable fraction of peak, collectives at link
bandwidths, memory-bound work at HBM bandwidth, combined with the overlap the schedule allows.

Per layer (dense and MoE separately, then times their counts):
  compute   = sum over kinds (gemm, gmm, attention) of executed FLOPs / (peak x efficiency)
              + elementwise bytes / HBM bandwidth
  fsdp      = all-gather forward + all-gather backward + reduce-scatter of the layer's weights
              (the experts' over fsdp, the other matrices' over fsdp x expert, an axis that
              does not divide a matrix's FSDP dim left out: layout.weight_collective_groups)
  ep        = dispatch/combine transfers (4, or 6 when the layer is recomputed)
  offload   = offloaded activations written to host in forward and read back in backward
  data      = all-reduce of the layer's gradient shards across their replicas (the mesh axes
              that split none of a weight's dims: data for the experts and the others alike,
              every axis for the norms and the router)
A step with gradient accumulation (`gradient_accumulation_steps` k > 1) is k forward and
backward passes over micro-batches (a lax.scan) and one optimizer update, with the collectives
where XLA:GPU puts them (jax 0.11.2, tests/train/test_step_accumulation_gpu_compile.py): each
micro-batch gathers and reduce-scatters its layers' weights, dispatches and offloads its own
tokens (k times one micro-batch's), while the replicas' gradient all-reduce leaves the loop:
once a step, after the last micro-batch, with no compute left to hide behind (fully exposed).
The optimizer runs once; FLOPs, tokens/s and MFU count the step's k micro-batches.
overlap=none adds every part. overlap=fsdp hides fsdp, data and offload behind the layer's
compute (exposed = max(0, part - compute)); overlap=full hides EP transfers too. A chunked MoE
layer (`moe.ep_comm_overlap_chunks` > 1) hides its EP transfers behind its own grouped
matmuls as plan/overlap.py's pipeline allows, under overlap none and fsdp alike.
`kernel_time` (the sum of all parts, nothing hidden) gives the shares the reference quotes
("84% of kernel time in communication"); `step_time` is what a user waits for.
"""
from __future__ import annotations

from dropless.machine import HardwareProfile
from dropless.models import arithmetic as ar
from dropless.models.arithmetic import KINDS
from dropless.plan import comm, flops, memory
from dropless.plan import model_numbers as mn
from dropless.plan.layout import (REMAT, Group, PlanConfig, flat_settings, groups, node_size,
                                  weight_collective_groups)
from dropless.plan.overlap import chunks, ep_pipeline

# Each activation byte is touched ~6 times by memory-bound kernels in a training step: written
# and read in the forward pass, its gradient written and read, and once more by the
# recompute / optimizer-free elementwise backward (norms, SwiGLU, rope, permutation).
ELEMENTWISE_PASSES = 6
COMM_PARTS = ("fsdp", "ep", "data", "offload")


def _rates(hw: HardwareProfile, cfg: PlanConfig) -> dict[str, float]:
    gmm = (hw.peak_fp8 * hw.fp8_efficiency if cfg.mxfp8
           else hw.peak_bf16 * hw.gmm_efficiency)
    return {"gemm": hw.peak_bf16 * hw.gemm_efficiency, "gmm": gmm,
            "attention": hw.peak_bf16 * hw.attention_efficiency}


def _recompute_flops(cfg: PlanConfig, fwd: dict[str, float]) -> dict[str, float]:
    """Forward FLOPs per token recomputed in the backward pass of one layer."""
    remat = REMAT[cfg.run.remat]
    if not remat.recomputes_layer:
        return {k: fwd[k] if k == "attention" and remat.recomputes_attention else 0.0
                for k in fwd}
    out = dict(fwd)
    skip = {"query": ("query", "q_down"), "key": ("key",), "value": ("value",)}
    proj = ar.attention_proj_flops(cfg.model)
    for name in cfg.offloaded:
        for p in skip[name]:
            out["gemm"] -= proj.get(p, 0.0)
    return out


def _layer_weight_bytes(cfg: PlanConfig, moe: bool, attention: bool = True
                        ) -> dict[tuple[str, int | None], float]:
    """{(placement group, FSDP dim length): bytes} of one layer's weights in the compute dtype
    (`memory.layer_weight_lengths`), the routed experts' the local ones (E / ep)."""
    b, ep = cfg.activation_bytes, cfg.mesh.expert
    return {(w, n): p * b / (ep if w == "experts" else 1)
            for (w, n), p in memory.layer_weight_lengths(cfg.model, moe, attention).items()}


def fsdp_collectives(layer_b: dict[tuple[str, int | None], float], cfg: PlanConfig,
                     hw: HardwareProfile) -> list[tuple[float, Group]]:
    """(gathered bytes, group) of one layer's weight all-gathers and gradient reduce-scatters
    (`layer_b`: `_layer_weight_bytes`): one a placement group and gather group, the local
    experts' over their `gather` group, the other matrices' over theirs
    (`layout.weight_collective_groups`, by the length of their FSDP dim); the replicated weights
    are not gathered."""
    out: dict[tuple[str, Group], float] = {}
    for (w, n), b in layer_b.items():
        gather = weight_collective_groups(cfg, hw, w, n)[0]
        if gather.size > 1:
            out[w, gather] = out.get((w, gather), 0.0) + b
    return [(b, g) for (_, g), b in out.items()]


def gradient_all_reduces(layer_b: dict[tuple[str, int | None], float], cfg: PlanConfig,
                         hw: HardwareProfile, grad_scale: float) -> list[tuple[float, Group]]:
    """(bytes, group) of each all-reduce of one layer's gradient shards across their replicas
    (`layer_b`: `_layer_weight_bytes`, `grad_scale` the weight dtype's bytes over the compute
    dtype's): each weight's shard (its bytes over its `gather` group) over its `replicas` group
    (`layout.weight_collective_groups`; the replicated weights whole, over every device), one
    all-reduce a replicas group."""
    out: dict[Group, float] = {}
    for (w, n), b in layer_b.items():
        gather, replicas = weight_collective_groups(cfg, hw, w, n)
        if replicas.size > 1:
            out[replicas] = out.get(replicas, 0.0) + b / gather.size * grad_scale
    return [(b, g) for g, b in out.items()]


def layer_times(cfg: PlanConfig, hw: HardwareProfile, moe: bool, *,
                attention: bool = True) -> dict[str, float]:
    """Seconds one layer spends in each part in one forward and backward pass (one
    micro-batch; nothing overlapped yet).

    `attention=False` leaves the attention block out (the feed-forward / MoE block alone, as
    the CPU calibration times it).
    """
    s, ep = cfg.model, cfg.mesh.expert
    t = cfg.micro_tokens_per_device
    rates = _rates(hw, cfg)
    fwd = mn.layer_forward_flops(s, cfg.run.seq_len, moe)
    if not attention:
        fwd["gemm"] -= sum(ar.attention_proj_flops(s).values())
        fwd["attention"] = 0.0
    rec = _recompute_flops(cfg, fwd)
    # each chunk of a chunked layer pads its own expert groups
    pad = 1.0 + flops.padding_fraction(s, t // chunks(cfg), ep, cfg.gmm_tile) if moe else 1.0
    out = {}
    waste = {"gmm": pad, "attention": 2.0 if cfg.attention_impl == "naive" else 1.0}
    for k in KINDS:
        executed = (3 * fwd[k] + rec[k]) * waste.get(k, 1.0)
        out[k] = executed * t / rates[k]
    ab = cfg.activation_bytes
    tensors = (memory.layer_tensors(s, ab, moe, memory.naive_seq(cfg)) if attention
               else memory.ffn_tensors(s, ab, moe))
    out["elementwise"] = (ELEMENTWISE_PASSES * memory.all_bytes_per_token(tensors, 1.0) * t
                          / (hw.hbm_bw * hw.hbm_efficiency))
    layer_b = _layer_weight_bytes(cfg, moe, attention)
    grad_scale = cfg.weight_bytes / cfg.activation_bytes
    out["fsdp"] = sum((2 + grad_scale) * comm.collective_time(b, grp, hw)
                      for b, grp in fsdp_collectives(layer_b, cfg, hw))
    out["data"] = sum(2 * comm.collective_time(b, grp, hw)
                      for b, grp in gradient_all_reduces(layer_b, cfg, hw, grad_scale))
    # every chunk's dispatch and combine (plan/overlap.py; one chunk unless the layer is chunked)
    out["ep"] = ep_pipeline(cfg, hw, out["gmm"])["kernel_s"] if moe and ep > 1 else 0.0
    host = sum(x.elems * x.nbytes for x in tensors if x.name in cfg.offloaded)
    out["offload"] = 2 * host * t / hw.host_bw
    return out


def _exposed(parts: dict[str, float], overlap: str, cost: float,
             ep_chunked: dict[str, float] | None = None) -> dict[str, float]:
    """What each part adds to the step: a hidden part shows where it outlasts the layer's
    compute, plus `cost` x the overlapped time (the SMs and HBM the collective takes).
    `ep_chunked` (plan/overlap.ep_pipeline of a chunked MoE layer): EP exposed as its
    pipeline leaves it, unless overlap="full" hides more."""
    compute = sum(parts[k] for k in (*KINDS, "elementwise"))
    hidden = {"none": (), "fsdp": ("fsdp", "data", "offload"),
              "full": ("fsdp", "data", "offload", "ep")}[overlap]
    out = {}
    for k, v in parts.items():
        out[k] = max(0.0, v - compute) + cost * min(v, compute) if k in hidden else v
    if ep_chunked is not None and "ep" not in hidden:
        out["ep"] = ep_chunked["exposed_s"] + cost * ep_chunked["hidden_s"]
    return out


def head_times(cfg: PlanConfig, hw: HardwareProfile) -> dict[str, float]:
    """Output head (and MTP heads) in one micro-batch: logits matmul forward + backward (and
    the forward again in the backward under num_vocab_tiling > 1: train/cross_entropy.py), loss
    elementwise."""
    s, t = cfg.model, cfg.micro_tokens_per_device
    passes = 3 + (cfg.run.num_vocab_tiling > 1)
    f = passes * ar.head_forward_flops(s) * t * (1 + s.mtp_depth)
    logits = t * s.vocab_size * (cfg.activation_bytes + 4) * (1 + s.mtp_depth)
    return {"gemm": f / _rates(hw, cfg)["gemm"],
            "elementwise": 3 * logits / (hw.hbm_bw * hw.hbm_efficiency)}


def optimizer_time(cfg: PlanConfig, hw: HardwareProfile) -> float:
    """AdamW update, once a step: read weights, gradients and two moments, write weights and
    moments."""
    p = memory.sharded_params(cfg)
    wb, ob = cfg.weight_bytes, cfg.optimizer_bytes
    return p * (3 * wb + 4 * ob) / (hw.hbm_bw * hw.hbm_efficiency)


def predict(cfg: PlanConfig, hw: HardwareProfile, *, name: str = "custom") -> dict:
    """The full plan for the run `cfg.run` on `hw` (its model named `name` in the result):
    memory, FLOPs, bytes, step time and shares. Every part but the optimizer's runs once per
    micro-batch, `cfg.accumulation` times a step."""
    s, passes = cfg.model, cfg.accumulation
    n_moe = s.num_moe_layers + (s.mtp_depth if s.moe is not None else 0)
    n_dense = s.num_layers - s.num_moe_layers + (s.mtp_depth if s.moe is None else 0)
    per_type = [(n_dense, layer_times(cfg, hw, False), None)]
    if n_moe:
        parts = layer_times(cfg, hw, True)
        chunked = (ep_pipeline(cfg, hw, parts["gmm"])
                   if chunks(cfg) > 1 and cfg.mesh.expert > 1 else None)
        per_type.append((n_moe, parts, chunked))
    kernel: dict[str, float] = {}
    exposed: dict[str, float] = {}
    for count, parts, chunked in per_type:
        for k, v in parts.items():
            kernel[k] = kernel.get(k, 0.0) + (1 if k == "data" else passes) * count * v
        for k, v in _exposed(parts, cfg.overlap, hw.overlap_cost, chunked).items():
            if k == "data" and passes > 1:   # once, after the loop: nothing hides it
                v, n = parts["data"], 1
            else:
                n = passes
            exposed[k] = exposed.get(k, 0.0) + n * count * v
    for k, v in head_times(cfg, hw).items():
        kernel[k] += passes * v
        exposed[k] += passes * v
    kernel["optimizer"] = exposed["optimizer"] = optimizer_time(cfg, hw)
    step = sum(exposed.values())
    total_kernel = sum(kernel.values())
    t = cfg.step_tokens_per_device
    seq = cfg.run.seq_len
    model_flops = mn.model_flops_per_token(s, seq) * t
    executed = sum(kernel[k] * _rates(hw, cfg)[k] for k in KINDS)
    comm_kernel = sum(kernel[k] for k in COMM_PARTS)
    return {
        "model": name, "hardware": hw.name, "layout": layout_summary(cfg, hw),
        "memory": memory.memory_per_device(cfg, hw),
        "flops": {"model_per_device": model_flops, "executed_per_device": executed,
                  "model_per_token": model_flops / t,
                  "six_n_per_token": mn.six_n_flops_per_token(s),
                  "by_kind_forward_per_token": mn.forward_flops(s, seq)},
        "bytes": bytes_per_step(cfg, hw),
        "time": {"step_s": step, "kernel_s": kernel, "exposed_s": exposed,
                 "kernel_total_s": total_kernel},
        "tflops_per_device": model_flops / step / 1e12,
        "mfu": model_flops / step / hw.peak_bf16,
        "tokens_per_s_per_device": t / step,
        "tokens_per_s": t * cfg.mesh.num_devices / step,
        "shares": {"kernel": {k: v / total_kernel for k, v in kernel.items()},
                   "step": {k: v / step for k, v in exposed.items()},
                   "communication_of_kernel": comm_kernel / total_kernel,
                   "communication_exposed_of_step": sum(exposed[k] for k in COMM_PARTS) / step},
    }


def layout_summary(cfg: PlanConfig, hw: HardwareProfile) -> dict:
    """The layout as the planner understood it (`flat_settings` with the offloaded tensors,
    the node size and the collective groups resolved)."""
    g = groups(cfg, hw)
    d = flat_settings(cfg)
    d["offload"] = list(cfg.offloaded)
    d["devices_per_node"] = node_size(cfg, hw)
    d["groups"] = {k: {"size": v.size, "per_node": v.inner, "nodes": v.outer}
                   for k, v in g.items()}
    return d


def bytes_per_step(cfg: PlanConfig, hw: HardwareProfile) -> dict:
    """Bytes one device sends per step: FSDP, EP (real, padded, without dedup), data, host;
    each micro-batch's, `cfg.accumulation` times, but the replicas' gradient reduction once
    (`ep_rows_per_token` and the wire format's per-dispatch figures stay one dispatch's)."""
    s, ep, passes = cfg.model, cfg.mesh.expert, cfg.accumulation
    out: dict = {}
    fsdp = {"intra": 0.0, "inter": 0.0}
    data = {"intra": 0.0, "inter": 0.0}
    grad_scale = cfg.weight_bytes / cfg.activation_bytes
    n_moe = s.num_moe_layers + (s.mtp_depth if s.moe is not None else 0)
    for count, moe in ((s.num_layers - s.num_moe_layers, False), (n_moe, True)):
        if not count:
            continue
        layer_b = _layer_weight_bytes(cfg, moe)
        for full, grp in fsdp_collectives(layer_b, cfg, hw):
            rb = comm.ring_bytes(full, grp)
            for k in fsdp:
                fsdp[k] += passes * count * (2 + grad_scale) * rb[k]
        for shard, grp in gradient_all_reduces(layer_b, cfg, hw, grad_scale):
            rb = comm.ring_bytes(shard, grp)
            for k in data:   # once a step: the sum of the micro-batches' gradients
                data[k] += count * 2 * rb[k]
    out["fsdp"], out["data"] = fsdp, data
    if s.moe is not None and ep > 1:
        n = comm.ep_transfers_per_layer(cfg) * n_moe * passes
        def scaled(d):
            return {k: n * v for k, v in d.items()}
        out["ep"] = scaled(comm.ep_bytes_per_transfer(cfg, hw))
        out["ep_real_rows"] = scaled(comm.ep_bytes_per_transfer(cfg, hw, padded=False))
        out["ep_without_dedup"] = scaled(comm.ep_bytes_per_transfer(cfg, hw, dedup=False,
                                                                    padded=False))
        out["ep_with_dedup"] = scaled(comm.ep_bytes_per_transfer(cfg, hw, dedup=True,
                                                                 padded=False))
        out["ep_rows_per_token"] = {"with_dedup": comm.expected_devices_per_token(s, ep),
                                    "without_dedup": float(s.moe.top_k)}
        wire = comm.ep_dispatch_wire(cfg, hw)   # MXFP8 on the wire (docs/fp8_dispatch.md)
        out["ep_dispatch_wire"] = {**wire, "step_bytes": passes * n_moe * wire["layer_bytes"],
                                   "step_bytes_mxfp8": passes * n_moe
                                   * wire["layer_bytes_mxfp8"]}
    # the offloadable tensors are the attention block's (a dense model has no MoE block)
    tensors = memory.attention_tensors(s, cfg.activation_bytes)
    host = sum(x.elems * x.nbytes for x in tensors if x.name in cfg.offloaded)
    out["host_offload"] = 2 * host * cfg.step_tokens_per_device * s.num_layers
    return out
