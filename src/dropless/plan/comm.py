"""Bytes moved per device, split into NVLink (intra-node) and InfiniBand (inter-node)
traffic, and the time each collective takes at the profile's link bandwidths.

Legend as in dropless.models.arithmetic; T tokens per device in one forward and backward pass
(one micro-batch, `PlanConfig.micro_tokens_per_device`), b bytes per activation element,
P parameters. plan/model.py repeats a micro-batch's traffic for each accumulation step.

EP dispatch/combine: without deduplication every (token, choice) row travels to its expert's
device; with it, one row per (token, destination device) travels, carrying the local expert
ids and weights, and the receiver replicates it. The expected number of distinct devices a
token reaches is exact for uniform routing and simulated from the routing rule for
DeepSeek-V3's group-limited routing.

Collectives are modelled as hierarchical rings: for a full buffer of B bytes over a group of n
devices, `inner` per node and `outer` nodes, an all-gather (or reduce-scatter) moves
B*(outer-1)/n bytes per device over InfiniBand and B*(inner-1)/inner over NVLink.
"""
from __future__ import annotations

import functools
import math

from dropless.machine import HardwareProfile
from dropless.plan.layout import REMAT, Group, PlanConfig, groups
from dropless.config import ModelConfig


@functools.lru_cache(maxsize=256)
def expected_devices_per_token(s: ModelConfig, ep: int) -> float:
    """Expected distinct EP devices among a token's top_k experts under balanced routing.

    Device d holds experts [d*E/ep, (d+1)*E/ep). Without expert groups the top_k experts are
    a uniform random subset and the expectation is exact:
    ep * (1 - C(E - E/ep, K) / C(E, K)) (`_none_on_device`). With group-limited routing
    (DeepSeek-V3: groups scored by the sum of their two best experts, the `topk_groups` best
    kept, top_k among those) the chosen groups each tend to hold a winner, so the routing rule
    itself is simulated on i.i.d. scores (fixed seed, `simulated_tokens(E)` tokens: 8,192 up to
    2,048 experts, fewer past them, so that the scores drawn stay within SIMULATED_SCORES).
    """
    e, k = s.moe.num_experts, s.moe.top_k
    if ep == 1:
        return 1.0
    per_dev = e // ep
    if s.moe.n_groups == 1 or s.moe.topk_groups == s.moe.n_groups:
        return ep * (1.0 - _none_on_device(e, per_dev, k))
    return _simulated_devices(e, k, s.moe.n_groups, s.moe.topk_groups, ep,
                              simulated_tokens(e))


# C(E - p, K) / C(E, K) exactly while the smaller of K and p is at most this; past it the
# binomials have thousands of digits (a million experts, top-k in the hundreds of thousands:
# minutes of big-integer arithmetic), and a float product of those terms is as good a plan
EXACT_TERMS = 256


def _none_on_device(e: int, p: int, k: int) -> float:
    """C(e - p, k) / C(e, k): the chance that none of a token's k distinct experts (of e) is
    one of a device's p. Equal, as a rational, to C(e - k, p) / C(e, p), so with m the smaller
    of k and p it is one correctly rounded division of two integers while m <= EXACT_TERMS,
    and past that the product of its m factors in floats."""
    m, big = min(k, p), max(k, p)
    if m <= EXACT_TERMS:
        return math.comb(e - big, m) / math.comb(e, m)
    return max(0.0, math.prod((e - big - i) / (e - i) for i in range(m)))


# the most router scores the simulation draws (8,192 tokens x 2,048 experts): 128 MiB of
# float64, whatever the expert count
SIMULATED_SCORES = 8192 * 2048


def simulated_tokens(e: int) -> int:
    """Tokens the group-limited routing simulation draws for `e` experts: 8,192, fewer past
    2,048 experts (at least one)."""
    return max(1, min(8192, SIMULATED_SCORES // e))


@functools.lru_cache(maxsize=16)
def _simulated_choices(e: int, k: int, n_groups: int, topk_groups: int, n: int):
    """The experts `n` simulated tokens choose ([n, k] ids, read-only) under group-limited
    routing on i.i.d. scores (fixed seed): the same for every EP size, so remembered."""
    import numpy as np
    rng = np.random.default_rng(0)
    scores = rng.random((n, e))
    eg = e // n_groups
    grouped = np.sort(scores.reshape(n, n_groups, eg), axis=-1)[..., -min(2, eg):]
    best = np.argsort(-grouped.sum(-1), axis=1)[:, :topk_groups]
    keep = np.zeros((n, n_groups), bool)
    np.put_along_axis(keep, best, True, axis=1)
    scores = np.where(np.repeat(keep, eg, axis=1), scores, -1.0)
    ids = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    ids.flags.writeable = False
    return ids


def _simulated_devices(e: int, k: int, n_groups: int, topk_groups: int, ep: int,
                       n: int) -> float:
    """Mean distinct EP devices (of `ep`) among the experts `n` simulated tokens choose."""
    import numpy as np
    ids = _simulated_choices(e, k, n_groups, topk_groups, n)
    hit = np.zeros((n, ep), bool)
    np.put_along_axis(hit, ids // (e // ep), True, axis=1)
    return float(hit.sum(1).mean())


def ep_rows(cfg: PlanConfig, hw: HardwareProfile, *, dedup: bool | None = None
            ) -> dict[str, float]:
    """Rows per token leaving a device in one dispatch (combine moves the same rows back):
    `intra` to other devices of its node, `inter` to other nodes, `local` staying home."""
    g = groups(cfg, hw)["expert"]
    ep = cfg.mesh.expert
    dedup = cfg.dedup if dedup is None else dedup
    if cfg.planned_dispatcher == "allgather":   # every device receives its EP group's tokens
        return {"local": 1.0, "intra": g.inner - 1.0, "inter": ep - g.inner * 1.0,
                "per_token": float(ep)}
    per_token = (expected_devices_per_token(cfg.model, ep) if dedup
                 else float(cfg.moe.top_k))
    per_dev = per_token / ep
    return {"local": per_dev, "intra": per_dev * (g.inner - 1),
            "inter": per_dev * (ep - g.inner),
            "per_token": per_token}


def ep_transfers_per_layer(cfg: PlanConfig) -> int:
    """Dispatch + combine forward, their transposes backward, again when the layer is
    recomputed (full / offload remat)."""
    return 6 if REMAT[cfg.run.remat].recomputes_layer else 4


def ep_bytes_per_transfer(cfg: PlanConfig, hw: HardwareProfile, *,
                          dedup: bool | None = None, padded: bool = True) -> dict[str, float]:
    """Bytes one device sends in one dispatch or combine of one layer: intra, inter.

    Each row is D activations plus, with dedup, the K local expert ids and weights (8 bytes
    each pair). `a2a` moves whole static chunks, `ragged_buffer_factor` x the balanced load,
    when `padded`; `ragged_a2a` and `allgather` move only real rows.
    """
    rows = ep_rows(cfg, hw, dedup=dedup)
    dedup = cfg.dedup if dedup is None else dedup
    dispatcher = cfg.planned_dispatcher
    row_bytes = cfg.model.d_model * cfg.activation_bytes
    if dispatcher != "allgather":
        row_bytes += 8 * (cfg.moe.top_k if dedup else 1)
    pad = cfg.moe.ragged_buffer_factor if (padded and dispatcher == "a2a") else 1.0
    t = cfg.micro_tokens_per_device
    return {"intra": rows["intra"] * t * row_bytes * pad,
            "inter": rows["inter"] * t * row_bytes * pad}


def ep_buffer_bytes(cfg: PlanConfig) -> float:
    """One layer's dispatch and combine send + receive buffers on one device."""
    s, ep = cfg.model, cfg.mesh.expert
    b = cfg.activation_bytes
    t = cfg.micro_tokens_per_device
    if cfg.planned_dispatcher == "allgather":
        return 2.0 * t * ep * s.d_model * b
    per_token = expected_devices_per_token(s, ep) if cfg.dedup else s.moe.top_k
    return 4.0 * s.moe.ragged_buffer_factor * t * per_token * s.d_model * b


def ring_bytes(full_bytes: float, g: Group) -> dict[str, float]:
    """Per-device bytes of a hierarchical all-gather / reduce-scatter of `full_bytes`."""
    if g.size == 1:
        return {"intra": 0.0, "inter": 0.0}
    return {"intra": full_bytes * (g.inner - 1) / g.inner,
            "inter": full_bytes * (g.outer - 1) / g.size}


def link_time(nbytes: dict[str, float], hw: HardwareProfile, *, steps: dict[str, int],
              concurrent: bool) -> float:
    """Seconds to move `nbytes` (intra over NVLink, inter over InfiniBand) at link efficiency,
    plus per-step latency. `concurrent`: both links at once (all-to-all), else in sequence
    (the two stages of a hierarchical ring)."""
    ti = nbytes["intra"] / (hw.nvlink_bw * hw.link_efficiency)
    to = nbytes["inter"] / (hw.ib_bw * hw.link_efficiency)
    lat = steps.get("intra", 0) * hw.nvlink_latency_s + steps.get("inter", 0) * hw.ib_latency_s
    return (max(ti, to) if concurrent else ti + to) + lat


def collective_time(full_bytes: float, g: Group, hw: HardwareProfile) -> float:
    """One hierarchical all-gather or reduce-scatter of `full_bytes` over group `g`."""
    if g.size == 1:
        return 0.0
    return link_time(ring_bytes(full_bytes, g), hw,
                     steps={"intra": g.inner - 1, "inter": g.outer - 1}, concurrent=False)


def a2a_time(nbytes: dict[str, float], cfg: PlanConfig, hw: HardwareProfile) -> float:
    """One dispatch or combine: every device sends to its EP peers over both links at once."""
    g = groups(cfg, hw)["expert"]
    if cfg.mesh.expert == 1:
        return 0.0
    return link_time(nbytes, hw, steps={"intra": 1, "inter": 1 if g.outer > 1 else 0},
                     concurrent=True)


# ---- MXFP8 on the wire (MoEConfig.dispatch_quantization="mxfp8", docs/fp8_dispatch.md) ------

def ep_dispatch_wire(cfg: PlanConfig, hw: HardwareProfile) -> dict[str, float]:
    """One device's forward dispatch of one layer with rows in the activation dtype and as
    MXFP8 (D one-byte E4M3 codes + ceil(D/32) one-byte E8M0 scales a row; ids and weights as
    before), and the EP bytes of a step each way: the forward dispatch (and its recomputation
    under full / offload remat) is the only transfer that changes; the combine, and both
    transposes in the backward, stay in the activation dtype. Bytes summed over both links."""
    d = cfg.model.d_model
    per_transfer = sum(ep_bytes_per_transfer(cfg, hw).values())
    row = d * cfg.activation_bytes
    meta = per_transfer - ep_bytes_per_transfer_rows(cfg, hw)
    fp8 = meta + ep_bytes_per_transfer_rows(cfg, hw) * (d + -(-d // 32)) / row
    n = ep_transfers_per_layer(cfg)
    # the forward dispatch, and again when the layer is recomputed
    dispatches = 2 if REMAT[cfg.run.remat].recomputes_layer else 1
    return {"dispatch_bytes": per_transfer, "dispatch_bytes_mxfp8": fp8,
            "dispatch_ratio": fp8 / per_transfer if per_transfer else 1.0,
            "layer_bytes": n * per_transfer,
            "layer_bytes_mxfp8": (n - dispatches) * per_transfer + dispatches * fp8}


def ep_bytes_per_transfer_rows(cfg: PlanConfig, hw: HardwareProfile) -> float:
    """The activation part of ep_bytes_per_transfer (both links): D values a row, no ids."""
    rows = ep_rows(cfg, hw)
    pad = cfg.moe.ragged_buffer_factor if cfg.planned_dispatcher == "a2a" else 1.0
    return ((rows["intra"] + rows["inter"]) * cfg.micro_tokens_per_device
            * cfg.model.d_model * cfg.activation_bytes * pad)
