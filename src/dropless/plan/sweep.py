"""Scaling sweeps across cluster sizes and the layout search behind `dropless plan --suggest`:
each variant is the run on another `MeshConfig` (`plan.layout.on_mesh`)."""
from __future__ import annotations

import itertools
from typing import Iterator

from dropless.config import ModelConfig
from dropless.machine import HardwareProfile
from dropless.plan.layout import PlanConfig, divisors, on_mesh
from dropless.plan.memory import memory_per_device, weight_memory
from dropless.plan.model import predict

SWEEP_AXES = ("data", "fsdp")
SUGGEST_REMATS = ("none", "minimal", "offload", "full")
SUGGEST_FACTORS = (1.25, 1.5, 2.0, 3.0)
NO_EP_FACTOR = 1.0   # a layout without EP has no buffers to size


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


def _layouts(cfg: PlanConfig) -> Iterator[PlanConfig]:
    """`cfg` on every FSDP x EP the model and cluster allow (EP a divisor of the device count
    and of the experts), data filling the rest: EP ascending, then FSDP ascending."""
    gpus, moe = cfg.mesh.num_devices, cfg.moe
    eps = [e for e in divisors(gpus) if moe is not None and moe.num_experts % e == 0] or [1]
    for ep in eps:
        for fsdp in divisors(gpus // ep):
            yield on_mesh(cfg, data=gpus // (ep * fsdp), fsdp=fsdp, expert=ep)


def _variants(layout: PlanConfig, models: dict[float, ModelConfig]
              ) -> Iterator[tuple[PlanConfig, float]]:
    """(plan, buffer factor) for each remat policy and buffer factor of `layout`, in
    `SUGGEST_REMATS` order, then the factors' (`models`: the model at each factor tried with
    EP; 1.0 without EP); offload as the remat policy implies."""
    factors = [f for f in models if f != NO_EP_FACTOR] if layout.mesh.expert > 1 else \
        [NO_EP_FACTOR]
    for remat, factor in itertools.product(SUGGEST_REMATS, factors):
        yield layout.replace(run=layout.run.replace(remat=remat, model=models[factor]),
                             offload=None), factor


def _models(cfg: PlanConfig, min_factor: float) -> dict[float, ModelConfig]:
    """The model at each buffer factor a search tries: those of `SUGGEST_FACTORS` from
    `min_factor` on (else the largest), with EP, and `NO_EP_FACTOR` without."""
    factors = [f for f in SUGGEST_FACTORS if f >= min_factor] or [max(SUGGEST_FACTORS)]
    moe = cfg.moe
    return {f: cfg.model if moe is None else
            cfg.model.replace(moe=moe.replace(ragged_buffer_factor=f))
            for f in [*factors, NO_EP_FACTOR]}


def candidate_layouts(cfg: PlanConfig, *, min_factor: float = 1.5
                      ) -> list[tuple[PlanConfig, float]]:
    """(plan, buffer factor) for every (FSDP x EP, remat, buffer factor) the model and cluster
    allow; data fills the rest. The buffer factor is the MoE layer's with EP, 1.0 without.

    Buffer factors below `min_factor` (the expected max/mean expert load) are skipped: they
    would overflow into extra rounds every step.
    """
    models = _models(cfg, min_factor)
    return [v for layout in _layouts(cfg) for v in _variants(layout, models)]


def _weights_floor(layout: PlanConfig) -> float:
    """A lower bound, as a float, of `memory_per_device(c)["total"]` for every variant `c` of
    `layout` (`_variants`): the sum of `memory.weight_memory(layout)`'s parts in its order,
    its `gradients` as 0.0. `memory_per_device`'s total sums the same parts in the same order
    (`weight_memory` reads neither the remat policy nor the buffer factor), its `gradients`
    possibly replaced by the unrolled layout's (>= 0), then adds parts that are all >= 0; a
    float sum never decreases when a term is raised or a non-negative one added."""
    return sum(0.0 if part == "gradients" else v for part, v in weight_memory(layout).items())


def suggest(cfg: PlanConfig, hw: HardwareProfile, *, top: int = 10, min_factor: float = 1.5
            ) -> list[dict]:
    """The layouts that fit (of `candidate_layouts`), best predicted throughput first (at most
    `top`; equal throughput: less memory first, then candidate order).

    Only what fits is predicted, and a layout whose weights alone cannot fit is skipped with
    all its variants (`_weights_floor`). A device count with hundreds of divisors (720,720)
    has thousands of candidates, most of them far too small a share of the weights."""
    usable = hw.usable_memory
    models = _models(cfg, min_factor)
    rows = []
    for layout in _layouts(cfg):
        if _weights_floor(layout) > usable:
            continue
        for c, factor in _variants(layout, models):
            if not memory_per_device(c, hw)["fits"]:
                continue
            rows.append(suggestion_row(c, factor, predict(c, hw)))
    return best_rows(rows, top)


def suggestion_row(c, factor: float, r: dict) -> dict:
    """One row of `suggest`: the layout of candidate `c`, its buffer factor and `predict`'s
    result `r` for it."""
    return {"fsdp": c.mesh.fsdp, "ep": c.mesh.expert, "data": c.mesh.data,
            "remat": c.run.remat, "offload": list(c.offloaded), "ragged_buffer_factor": factor,
            "step_s": r["time"]["step_s"], "tflops_per_device": r["tflops_per_device"],
            "tokens_per_s": r["tokens_per_s"], "mfu": r["mfu"],
            "memory_gib": r["memory"]["total"] / 2 ** 30,
            "headroom_gib": r["memory"]["headroom"] / 2 ** 30}


def best_rows(rows: list[dict], top: int) -> list[dict]:
    """The `top` fastest rows (tokens a second), the smaller memory first among equals."""
    return sorted(rows, key=lambda row: (-row["tokens_per_s"], row["memory_gib"]))[:top]
