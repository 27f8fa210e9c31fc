"""The benches' side of measuring on noisy machines: each candidate timed against its baseline,
JSON lines. The round-robin timer itself (`time_interleaved`), what machine a number came from
and how busy it was are `dropless.machine` (the planner's calibration times with it too); the
readable table is `dropless.text_table`.

Two cores swing ~2x over minutes, so only ratios measured in one process mean anything: every
candidate is timed alternately with its baseline (A, B, A, B, ...) and medians are compared.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Mapping

from dropless import json_out, machine


def time_against_baseline(fns: Mapping[str, Callable[[], Any]], core: list[str], *,
                          baseline: str = "dense", repeats: int = 5
                          ) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """Time `core` (which includes `baseline`) in one round-robin, then every other function in
    its own (baseline, function) round-robin, so a slow function's memory traffic never lands
    between the core's runs. Returns (stats, baseline median each function is compared with).
    """
    stats = machine.time_interleaved({nm: fns[nm] for nm in core}, repeats=repeats)
    base_of = {nm: stats[baseline]["median_ms"] for nm in fns}
    for nm in fns:
        if nm not in core:
            pair = machine.time_interleaved({baseline: fns[baseline], nm: fns[nm]},
                                            repeats=repeats)
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
