"""Measuring on noisy machines: interleaved timing, medians, JSON lines. What machine a number
came from and how busy it was are `dropless.machine` (`machine_info`, `busy_fraction`); the
readable table is `dropless.text_table`.

Two cores swing ~2x over minutes, so only ratios measured in one process mean anything: every
candidate is timed alternately with its baseline (A, B, A, B, ...) and medians are compared.
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Any, Callable, Mapping

import jax

from dropless import json_out


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
