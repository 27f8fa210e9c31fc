"""The benches' side of measuring on noisy machines: the start-up they share, each candidate timed
against its baseline, JSON lines. The round-robin timer itself (`time_interleaved`), what
machine a number came from and how busy it was are `dropless.machine` (the planner's
calibration times with it too); the readable table is `dropless.text_table`.

Two cores swing ~2x over minutes, so only ratios measured in one process mean anything: every
candidate is timed alternately with its baseline (A, B, A, B, ...) and medians are compared.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Mapping, Protocol, TypeVar

from dropless import json_out, machine


class QuickSized(Protocol):
    """A bench's options with a smoke-run form: `quick` asks for it, `quick_sized` returns it."""
    quick: bool

    def quick_sized(self): ...


Options = TypeVar("Options", bound=QuickSized)


def start(args: Options, *, devices: int | None = None
          ) -> tuple[Options, dict[str, Any], float | None]:
    """The start-up of a timed bench: `args` in their smoke-run sizes when `args.quick`, the
    machine (`machine.machine_info()`) and how busy others keep it (`machine.busy_fraction()`),
    printed as the header line `# CPU xCORES, jax V, PLATFORM; others' load before start: B`
    (with `devices`: `N PLATFORM devices` in place of the platform).
    Returns (the options to run, the machine, the busy fraction)."""
    if args.quick:
        args = args.quick_sized()
    info = machine.machine_info()
    busy = machine.busy_fraction()
    where = info["platform"] if devices is None else f"{devices} {info['platform']} devices"
    print(f"# {info['cpu']} x{info['cores']}, jax {info['jax']}, {where}; "
          f"others' load before start: {busy}", flush=True)
    return args, info, busy


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
