"""Scaling sweeps across cluster sizes and the layout search behind `dropless plan --suggest`."""
from __future__ import annotations

import itertools

from dropless.machine import HardwareProfile
from dropless.plan.layout import PlanConfig
from dropless.plan.model import predict
from dropless.config import ModelConfig

SWEEP_AXES = ("data", "fsdp")
SUGGEST_REMATS = ("none", "minimal", "offload", "full")
SUGGEST_FACTORS = (1.25, 1.5, 2.0, 3.0)


def sweep_gpus(s: ModelConfig, cfg: PlanConfig, hw: HardwareProfile, gpus: list[int], *,
               axis: str = "data") -> list[dict]:
    """Predicted throughput at each cluster size, growing `axis` (data replicas or FSDP) with the
    other axes fixed. Scaling efficiency = TFLOPS/device relative to the first size."""
    if axis not in SWEEP_AXES:
        raise ValueError(f"sweep axis={axis!r} must be one of {SWEEP_AXES}")
    rows = []
    for n in gpus:
        other = cfg.ep * (cfg.fsdp if axis == "data" else cfg.replicas)
        if n % other:
            raise ValueError(f"sweep gpus={n} is not a multiple of the fixed axes "
                             f"({'fsdp x ep' if axis == 'data' else 'data x ep'} = {other})")
        if axis == "data":
            c = cfg.replace(gpus=n, data=n // other)
        else:
            c = cfg.replace(gpus=n, fsdp=n // other, data=cfg.replicas)
        r = predict(s, c, hw)
        rows.append({"gpus": n, "data": c.replicas, "fsdp": c.fsdp, "ep": c.ep,
                     "step_s": r["time"]["step_s"], "tflops_per_device": r["tflops_per_device"],
                     "tokens_per_s": r["tokens_per_s"], "mfu": r["mfu"],
                     "fits": r["memory"]["fits"],
                     "communication_of_kernel": r["shares"]["communication_of_kernel"]})
    base = rows[0]["tflops_per_device"]
    for row in rows:
        row["scaling_efficiency"] = row["tflops_per_device"] / base
    return rows


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(s: ModelConfig, cfg: PlanConfig, *, min_factor: float = 1.5
                      ) -> list[PlanConfig]:
    """Every (FSDP x EP, remat, buffer factor) the model and cluster allow; data fills the rest.

    Buffer factors below `min_factor` (the expected max/mean expert load) are skipped: they
    would overflow into extra rounds every step.
    """
    out = []
    eps = [e for e in _divisors(cfg.gpus) if s.moe is None or s.moe.num_experts % e == 0]
    if s.moe is None:
        eps = [1]
    factors = [f for f in SUGGEST_FACTORS if f >= min_factor] or [max(SUGGEST_FACTORS)]
    for ep in eps:
        for fsdp in _divisors(cfg.gpus // ep):
            for remat, factor in itertools.product(SUGGEST_REMATS, factors if ep > 1 else [1.0]):
                out.append(cfg.replace(ep=ep, fsdp=fsdp, data=cfg.gpus // (ep * fsdp),
                                       remat=remat, offload=None, ragged_buffer_factor=factor))
    return out


def suggest(s: ModelConfig, cfg: PlanConfig, hw: HardwareProfile, *, top: int = 10,
            min_factor: float = 1.5) -> list[dict]:
    """The layouts that fit, best predicted throughput first (at most `top`)."""
    rows = []
    for c in candidate_layouts(s, cfg, min_factor=min_factor):
        r = predict(s, c, hw)
        if not r["memory"]["fits"]:
            continue
        rows.append({"fsdp": c.fsdp, "ep": c.ep, "data": c.replicas, "remat": c.remat,
                     "offload": list(c.offloaded), "ragged_buffer_factor": c.ragged_buffer_factor,
                     "step_s": r["time"]["step_s"], "tflops_per_device": r["tflops_per_device"],
                     "tokens_per_s": r["tokens_per_s"], "mfu": r["mfu"],
                     "memory_gib": r["memory"]["total"] / 2 ** 30,
                     "headroom_gib": r["memory"]["headroom"] / 2 ** 30})
    rows.sort(key=lambda row: (-row["tokens_per_s"], row["memory_gib"]))
    return rows[:top]
