"""Scaling sweeps across cluster sizes and the layout search behind `dropless plan --suggest`:
each variant is the run on another `MeshConfig` (`plan.layout.on_mesh`)."""
from __future__ import annotations

import itertools

from dropless.machine import HardwareProfile
from dropless.plan.layout import PlanConfig, divisors, on_mesh
from dropless.plan.model import predict

SWEEP_AXES = ("data", "fsdp")
SUGGEST_REMATS = ("none", "minimal", "offload", "full")
SUGGEST_FACTORS = (1.25, 1.5, 2.0, 3.0)


def sweep_gpus(cfg: PlanConfig, hw: HardwareProfile, gpus: list[int], *, axis: str = "data"
               ) -> list[dict]:
    """Predicted throughput at each cluster size, growing `axis` (data replicas or FSDP) with the
    other axes fixed. Scaling efficiency = TFLOPS/device relative to the first size."""
    if axis not in SWEEP_AXES:
        raise ValueError(f"sweep axis={axis!r} must be one of {SWEEP_AXES}")
    m = cfg.mesh
    rows = []
    for n in gpus:
        other = m.expert * (m.fsdp if axis == "data" else m.data)
        if n % other:
            raise ValueError(f"sweep gpus={n} is not a multiple of the fixed axes "
                             f"({'fsdp x ep' if axis == 'data' else 'data x ep'} = {other})")
        sizes = {"data": m.data, "fsdp": m.fsdp, axis: n // other}
        c = on_mesh(cfg, expert=m.expert, **sizes)
        r = predict(c, hw)
        rows.append({"gpus": n, "data": c.mesh.data, "fsdp": c.mesh.fsdp, "ep": c.mesh.expert,
                     "step_s": r["time"]["step_s"], "tflops_per_device": r["tflops_per_device"],
                     "tokens_per_s": r["tokens_per_s"], "mfu": r["mfu"],
                     "fits": r["memory"]["fits"],
                     "communication_of_kernel": r["shares"]["communication_of_kernel"]})
    base = rows[0]["tflops_per_device"]
    for row in rows:
        row["scaling_efficiency"] = row["tflops_per_device"] / base
    return rows


def candidate_layouts(cfg: PlanConfig, *, min_factor: float = 1.5
                      ) -> list[tuple[PlanConfig, float]]:
    """(plan, buffer factor) for every (FSDP x EP, remat, buffer factor) the model and cluster
    allow; data fills the rest. The buffer factor is the MoE layer's with EP, 1.0 without.

    Buffer factors below `min_factor` (the expected max/mean expert load) are skipped: they
    would overflow into extra rounds every step.
    """
    out = []
    gpus, moe = cfg.mesh.num_devices, cfg.moe
    eps = [e for e in divisors(gpus) if moe is not None and moe.num_experts % e == 0] or [1]
    factors = [f for f in SUGGEST_FACTORS if f >= min_factor] or [max(SUGGEST_FACTORS)]
    for ep in eps:
        for fsdp in divisors(gpus // ep):
            layout = on_mesh(cfg, data=gpus // (ep * fsdp), fsdp=fsdp, expert=ep)
            for remat, factor in itertools.product(SUGGEST_REMATS, factors if ep > 1 else [1.0]):
                c = layout.replace_run(remat=remat).replace(offload=None)
                if moe is not None:
                    c = c.replace_moe(ragged_buffer_factor=factor)
                out.append((c, factor))
    return out


def suggest(cfg: PlanConfig, hw: HardwareProfile, *, top: int = 10, min_factor: float = 1.5
            ) -> list[dict]:
    """The layouts that fit, best predicted throughput first (at most `top`)."""
    rows = []
    for c, factor in candidate_layouts(cfg, min_factor=min_factor):
        r = predict(c, hw)
        if not r["memory"]["fits"]:
            continue
        rows.append({"fsdp": c.mesh.fsdp, "ep": c.mesh.expert, "data": c.mesh.data,
                     "remat": c.run.remat, "offload": list(c.offloaded),
                     "ragged_buffer_factor": factor,
                     "step_s": r["time"]["step_s"], "tflops_per_device": r["tflops_per_device"],
                     "tokens_per_s": r["tokens_per_s"], "mfu": r["mfu"],
                     "memory_gib": r["memory"]["total"] / 2 ** 30,
                     "headroom_gib": r["memory"]["headroom"] / 2 ** 30})
    rows.sort(key=lambda row: (-row["tokens_per_s"], row["memory_gib"]))
    return rows[:top]
