"""Training metrics arithmetic: device peak FLOPS and MFU, expert-load summaries. FLOPs per
token (model and executed) come from the one arithmetic model, `dropless.models.arithmetic`.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Callable

import numpy as np

from dropless.machine import peak_for, profile_for_device

# Set to a number (FLOP/s for the whole CPU) to use it instead of the cached measurement.
CPU_PEAK_ENV = "DROPLESS_CPU_PEAK_FLOPS"

def device_peak_flops(device_kind: str, precision: str) -> float | None:
    """Dense peak FLOP/s of a GPU by its jax device_kind (e.g. 'NVIDIA H100 80GB HBM3') for a
    dtype name ('float32' = TF32, 'bfloat16', 'fp8', 'mxfp8'), from the planner's sourced
    profiles (`dropless.machine.PROFILES`); None for an unknown device or precision."""
    hw = profile_for_device(device_kind)
    if hw is None:
        return None
    try:
        return peak_for(hw, precision)
    except ValueError:
        return None


def measure_cpu_peak(dtype: str = "float32", size: int = 1024, repeats: int = 10) -> float:
    """Best-of-N FLOP/s of one jitted size^3 matmul on the default device (XLA:CPU spreads one
    matmul over every core, so this is the whole machine's rate)."""
    import jax
    import jax.numpy as jnp
    a = jnp.ones((size, size), dtype)
    f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    f(a, a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(a, a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2.0 * size ** 3 / best


def cpu_model() -> str:
    """This machine's CPU model name (/proc/cpuinfo on Linux, platform.processor() elsewhere)."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith(("model name", "Model", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine() or "unknown-cpu"


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dropless"


def cpu_peak_flops(dtype: str = "float32", *, cache_dir: str | Path | None = None,
                   measure: Callable[[str], float] = measure_cpu_peak) -> tuple[float, str]:
    """The CPU peak MFU divides by: (FLOP/s for the whole machine, where it came from).

    Measured once per (CPU model, usable cores, dtype) with `measure` and cached as one JSON
    file per key in `cache_dir` (default `$XDG_CACHE_HOME/dropless/cpu_peak`, else
    `~/.cache/dropless/cpu_peak`); every later run reads the cached figure, so two runs on one
    machine divide by the same number. The file is created atomically and exclusively, so when
    two processes measure at once the first one's figure is what both use. `$DROPLESS_CPU_PEAK_
    FLOPS` overrides the cache. Delete the file to measure again (e.g. after a first measurement
    on a busy machine). Raises ValueError for a non-numeric or non-positive override.
    """
    env = os.environ.get(CPU_PEAK_ENV)
    if env:
        try:
            value = float(env)
        except ValueError:
            raise ValueError(f"{CPU_PEAK_ENV}={env!r} must be a number of FLOP/s") from None
        if not value > 0:
            raise ValueError(f"{CPU_PEAK_ENV}={env!r} must be > 0")
        return value, f"${CPU_PEAK_ENV}"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    key = f"{cpu_model()} | {cores} cores | {dtype}"
    folder = Path(cache_dir) if cache_dir is not None else _cache_dir() / "cpu_peak"
    slug = "".join(c if c.isalnum() else "_" for c in key)[:80]
    file = folder / f"{slug}-{hashlib.sha1(key.encode()).hexdigest()[:10]}.json"
    entry = _read_entry(file, key)
    if entry is None:
        folder.mkdir(parents=True, exist_ok=True)
        new = {"key": key, "flops": measure(dtype),
               "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "how": "best of 10 jitted "
               "1024^3 matmuls on one device"}
        tmp = file.with_name(f".{file.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(new, indent=1))
        try:
            os.link(tmp, file)          # fails if another run got there first: keep theirs
        except FileExistsError:
            if _read_entry(file, key) is None:   # unreadable leftover: replace it
                os.replace(tmp, file)
        tmp.unlink(missing_ok=True)
        entry = _read_entry(file, key) or new
    return float(entry["flops"]), f"CPU matmul peak measured {entry['measured']}, cached in {file}"


def _read_entry(file: Path, key: str) -> dict | None:
    try:
        entry = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(entry, dict) and entry.get("key") == key and \
        isinstance(entry.get("flops"), (int, float)) and entry["flops"] > 0
    return entry if ok else None


def peak_flops_per_device(dtype: str) -> tuple[float | None, str]:
    """(peak FLOP/s per device for MFU, where it came from) for jax's default devices: the
    profile table on GPUs (None for an unknown GPU), the cached CPU peak shared by the host
    devices on CPU."""
    import jax
    dev = jax.devices()[0]
    if dev.platform == "cpu":
        peak, how = cpu_peak_flops(dtype)
        return peak / max(1, jax.device_count()), how
    return device_peak_flops(dev.device_kind, dtype), f"table: {dev.device_kind}"


def expert_load_summary(tokens_per_expert_LE) -> dict[str, float]:
    """max/mean load per MoE layer: the worst layer and the mean over layers (1.0 = balanced)."""
    t = np.asarray(tokens_per_expert_LE, np.float64)
    if t.size == 0:
        return {}
    ratio_L = t.max(axis=-1) / np.maximum(t.mean(axis=-1), 1e-9)
    return {"expert_load_max_over_mean": float(ratio_L.max()),
            "expert_load_max_over_mean_avg": float(ratio_L.mean())}


def throughput(*, step_time_s: float, tokens: int, flops_per_token: float, num_devices: int,
               peak_flops_per_device: float | None) -> dict[str, float | None]:
    """tokens/s, model TFLOPS per device and MFU (None when the peak is unknown)."""
    tflops = tokens * flops_per_token / step_time_s / num_devices / 1e12
    mfu = None if not peak_flops_per_device else tflops * 1e12 / peak_flops_per_device
    return {"tokens_per_s": tokens / step_time_s, "tflops_per_device": tflops, "mfu": mfu}
