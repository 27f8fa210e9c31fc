"""Measuring on noisy machines: interleaved timing, medians, contention checks, JSON lines.

Two cores swing ~2x over minutes, so only ratios measured in one process mean anything: every
candidate is timed alternately with its baseline (A, B, A, B, ...) and medians are compared.
"""
from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time
from typing import Any, Callable, Mapping

import jax

from dropless import json_out


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> str:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, text=True,
                              capture_output=True, timeout=5).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine_info() -> dict[str, Any]:
    """What the numbers came from: commit, versions, processor, cores, JAX device."""
    import jaxlib
    dev = jax.devices()[0]
    return {"git_commit": _git_commit(), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "cpu": _cpu_model(), "cores": os.cpu_count(), "platform": dev.platform,
            "device_kind": dev.device_kind, "device_count": jax.device_count()}


def _cpu_times() -> tuple[int, int]:
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields), idle


def busy_fraction(seconds: float = 0.5) -> float | None:
    """Share of all cores busy over `seconds` while we sleep: others' load (None off Linux)."""
    try:
        t0, i0 = _cpu_times()
        time.sleep(seconds)
        t1, i1 = _cpu_times()
    except OSError:
        return None
    return round(1.0 - (i1 - i0) / max(t1 - t0, 1), 3)


def _block(out: Any) -> None:
    jax.block_until_ready(out)


def time_interleaved(fns: Mapping[str, Callable[[], Any]], *, repeats: int = 5,
                     warmup: int = 1) -> dict[str, dict[str, float]]:
    """Time each zero-argument callable `repeats` times, round-robin, after `warmup` calls each.

    Returns {name: {"median_ms", "min_ms", "max_ms", "compile_ms"}}; compile_ms is the first
    call (compilation plus one run).
    """
    stats: dict[str, dict[str, float]] = {}
    for name, fn in fns.items():
        t = time.perf_counter()
        _block(fn())
        stats[name] = {"compile_ms": (time.perf_counter() - t) * 1e3}
        for _ in range(warmup - 1):
            _block(fn())
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            _block(fn())
            samples[name].append((time.perf_counter() - t) * 1e3)
    for name, s in samples.items():
        stats[name].update(median_ms=statistics.median(s), min_ms=min(s), max_ms=max(s))
    return stats


def time_against_baseline(fns: Mapping[str, Callable[[], Any]], core: list[str], *,
                          baseline: str = "dense", repeats: int = 5
                          ) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """Time `core` (which includes `baseline`) in one round-robin, then every other function in
    its own (baseline, function) round-robin, so a slow function's memory traffic never lands
    between the core's runs. Returns (stats, baseline median each function is compared with).
    """
    stats = time_interleaved({nm: fns[nm] for nm in core}, repeats=repeats)
    base_of = {nm: stats[baseline]["median_ms"] for nm in fns}
    for nm in fns:
        if nm not in core:
            pair = time_interleaved({baseline: fns[baseline], nm: fns[nm]}, repeats=repeats)
            stats[nm], base_of[nm] = pair[nm], pair[baseline]["median_ms"]
    return stats, base_of


def write_jsonl(path: str | None, records: list[dict[str, Any]]) -> None:
    """Append records as JSON lines (no-op when path is None); a NaN or infinite number is
    written as null with a `<key>_nonfinite` field (dropless.json_out)."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as f:
        for r in records:
            f.write(json_out.dumps(r, sort_keys=True) + "\n")


def format_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """A plain aligned text table of `columns` from `rows` (floats to 3 significant digits)."""
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return "" if v is None else str(v)
    table = [columns] + [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(columns))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in table)
