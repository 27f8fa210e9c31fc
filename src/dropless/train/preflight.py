"""Pre-flight: refuse a training config that cannot fit in device memory, before compiling.

The estimate is the planner's memory model (`dropless.plan.memory.memory_per_device`, the same
one `dropless plan` prints) applied to the trainer's layout: weights, gradients and Adam moments
in the model's weight dtype (float32 moments), activations in the compute dtype, the trainer's
plain-XLA attention (the S x S scores are materialised, `attention_impl="naive"`). The device's
memory is what JAX reports (`bytes_limit`) on an accelerator and, on a CPU, the host's RAM (or
its cgroup limit) shared by the local host devices. The check refuses only an estimate above
the whole device: the model is an estimate, and a near miss is better left to the allocator.
DROPLESS_NO_PREFLIGHT=1 skips it.
"""
from __future__ import annotations

import os

from dropless.config import TrainConfig

GiB = 2 ** 30
_HINTS = {
    "parameters": "use a smaller model or shard it (mesh.fsdp, mesh.expert)",
    "gradients": "use a smaller model or shard it (mesh.fsdp, mesh.expert)",
    "optimizer_state": "use a smaller model or shard it (mesh.fsdp, mesh.expert)",
    "gathered_weights": "use a smaller model",
    "activations": "lower seq_len or per_device_batch_size, or set remat=full",
    "layer_workspace": "lower seq_len or per_device_batch_size",
    "logits": "lower seq_len or per_device_batch_size",
    "ep_buffers": "lower per_device_batch_size",
}
PARTS = tuple(_HINTS)


class DoesNotFit(ValueError):
    """The config's estimated memory per device exceeds the device's memory."""


def _fmt(b: float) -> str:
    return f"{b / 2 ** 40:.1f} TiB" if b >= 2 ** 40 else f"{b / GiB:.2f} GiB"


def device_memory() -> tuple[float, str]:
    """(bytes one device may use, where the number came from): `runtime.environment`'s."""
    from dropless.runtime.environment import device_memory as measured
    return measured()


def estimate(cfg: TrainConfig) -> dict[str, float]:
    """Bytes per device by part (the planner's terms) and their `total`."""
    from dropless.machine import PROFILES
    from dropless.plan.layout import DTYPE_BYTES, PlanConfig
    from dropless.plan.memory import memory_per_device
    m = cfg.model
    dt = lambda d: d if d in DTYPE_BYTES else "float32"   # noqa: E731 (float64 -> 4 bytes)
    run = cfg.replace(model=m.replace(dtype=dt(m.dtype), weight_dtype=dt(m.weight_dtype)))
    plan = PlanConfig(run=run, optimizer_dtype=dt(m.weight_dtype), attention_impl="naive")
    mem = memory_per_device(plan, PROFILES["h100"])  # hardware: only for `usable`
    return {k: float(mem[k]) for k in PARTS + ("total",)}


def check(cfg: TrainConfig, *, limit: float | None = None, source: str = "") -> dict:
    """The estimate, or DoesNotFit naming the biggest term and what to change."""
    est = estimate(cfg)
    if os.environ.get("DROPLESS_NO_PREFLIGHT") == "1":
        return est
    if limit is None:
        limit, source = device_memory()
    if est["total"] <= limit:
        return est
    big = max(PARTS, key=lambda k: est[k])
    raise DoesNotFit(
        f"per_device_batch_size={cfg.per_device_batch_size} x seq_len={cfg.seq_len} "
        f"(remat={cfg.remat}) does not fit: about {_fmt(est['total'])} per device, "
        f"{_fmt(limit)} available ({source}); the biggest term is {big} "
        f"({_fmt(est[big])}). {_HINTS[big][0].upper() + _HINTS[big][1:]} "
        "(DROPLESS_NO_PREFLIGHT=1 skips this check)")
