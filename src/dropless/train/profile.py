"""`train --profile-steps N`: which steps the JAX profiler traces, and the per-kernel table
written from the trace.

The trace covers N steps from the third (the first two carry the compile and the dispatch that
follows it) when the run has that many; a shorter run traces its last steps, down to its only
one, so any step count gives a trace. The table (RUN_DIR/profile_kernels.jsonl, one JSON
object a line) is `runtime.kernel_table`'s reading of the trace: one "kernel" record each
(name, group, count, total_us, share of the traced device time, per-step microseconds), then
one "group" record each of attention / moe_gmm / dispatch_permute / router / optimizer / other,
largest first, so that a change can be judged from the committed file without a device.
"""
from __future__ import annotations

import json
from pathlib import Path

from dropless.runtime import files
from dropless.runtime.kernel_table import GROUPS, kernel_table

TABLE = "profile_kernels.jsonl"


def window(start: int, end: int, steps: int) -> range:
    """The 0-based loop indices i whose step (i + 1) is traced, for a run doing steps
    start+1..end: `steps` of them from index start+2, or fewer, ending at `end`, starting as
    late as start+2 allows (empty when `steps` is 0 or there is nothing to run).

    >>> window(0, 10, 3), window(0, 2, 5), window(0, 1, 2), window(4, 4, 2)
    (range(2, 5), range(1, 2), range(0, 1), range(0, 0))
    """
    if steps <= 0 or end <= start:
        return range(0)
    first = start + min(2, end - start - 1)
    return range(first, min(first + steps, end))


def table_records(rows: list[dict], *, steps: int) -> list[dict]:
    """Records of the table from `kernel_table` rows (name, count, total_us, share, group,
    hlo_op, scope): one "kernel" record each with its per-step time, then the groups' sums
    (every group of GROUPS, those with no kernel at 0), largest first."""
    out, sums = [], dict.fromkeys(GROUPS, 0.0)
    total = sum(r["total_us"] for r in rows) or 1.0
    for r in rows:
        sums[r["group"]] += r["total_us"]
        out.append({"event": "kernel", **{k: r.get(k) for k in (
            "name", "group", "count", "total_us", "share", "hlo_op", "scope")},
            "us_per_step": r["total_us"] / steps})
    for g in sorted(sums, key=lambda k: -sums[k]):
        out.append({"event": "group", "group": g, "total_us": sums[g],
                    "share": sums[g] / total, "us_per_step": sums[g] / steps})
    return out


def write_table(out_dir: Path, *, steps: int) -> tuple[Path, list[dict]]:
    """Read the trace under OUT_DIR/profile and write OUT_DIR/profile_kernels.jsonl whole or
    not at all; (its path, its group records). Raises what the trace reader raises for a
    missing or unreadable trace."""
    recs = table_records(kernel_table(Path(out_dir) / "profile"), steps=steps)
    path = Path(out_dir) / TABLE
    files.write_text(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in recs))
    return path, [r for r in recs if r["event"] == "group"]


def group_line(groups: list[dict]) -> str:
    """'attention 41.2%, moe_gmm 30.1%, ...' (the groups with any time)."""
    return ", ".join(f"{g['group']} {100 * g['share']:.1f}%" for g in groups if g["total_us"])
