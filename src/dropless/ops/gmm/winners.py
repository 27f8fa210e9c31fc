"""The measured winners `auto` picks from on a GPU: per (device kind, shape bucket, direction).

Legend: M rows (sorted by group), K contraction dim, N output dim, G groups, R rows per group
(M / G).

A grouped matmul is placed in a bucket by its forward operands (lhs [M, K], rhs [G, K, N]):
`bucket(m, k, n, g)` names the class of R and of K and N (`r<R>_k<K>_n<N>`, each the power of
four at or above it, written 64, 256, 1k, 4k, 16k, 64k, ...). The shapes table
(`ops/gmm/shapes.py`) falls into distinct buckets, so a row measured at one of its shapes
covers that model's products. The table (`winners.json` beside this file) is a committed
record of a device run: its `provenance` names the commit, the date, the device, the versions
and the result file; each row names a device kind, a bucket, a direction (`fwd`, `dlhs`,
`drhs`: `shapes.DIRECTIONS`), the winning backend and the times that chose it.

`auto` on CUDA reads it through `winner(device_kind, m, k, n, g, direction)`; a bucket or a
device kind the table lacks gives None, and `auto` then takes its chain's default (registry.py).
The device kind is jax's `device_kind` string of the GPU in this process ("NVIDIA H200");
without one (compiling on a CPU host for a compile-only GPU) `device_scope(kind)` names it, and
otherwise no row applies.

`from_records` builds the table from one device check's records (`dropless bench gpu`'s
gpu_bench.jsonl; `python benchmarks/gpu/tables.py winners` is its command): per bucket of the
shapes measured and direction, the backend fastest at every routing measured there. The gmm
section times `dlhs` and `drhs` alone at the model shapes it reaches; a direction a run did not
time alone (a unit dropped to fit the budget, an older run's records) takes its mode's
stand-in: `dlhs` and `drhs` the forward+backward time.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import math
from importlib import resources
from typing import Iterator

from dropless.ops.gmm.shapes import DIRECTIONS

TABLE_FILE = "winners.json"
PROVENANCE_FIELDS = ("commit", "date", "device", "source", "jax", "dtype", "note")
ROW_FIELDS = ("device_kind", "bucket", "direction", "backend", "shape", "times_ms")
# the device check's baselines timed beside the grouped matmuls (never a winner): XLA's dense
# matmul of the same useful FLOPs and the torch peer
NOT_CANDIDATES = ("dense_xla", "torch_grouped_mm", "torch_dense")
# the mode whose time stands for a direction the records did not time alone
MODE_OF = {"fwd": "fwd", "dlhs": "fwd+bwd", "drhs": "fwd+bwd"}
_DEVICE: contextvars.ContextVar[str | None] = contextvars.ContextVar("dropless_gmm_device",
                                                                    default=None)
_TABLE: contextvars.ContextVar[dict | None] = contextvars.ContextVar("dropless_gmm_winners",
                                                                    default=None)


def size_class(x: float) -> str:
    """The power of four at or above x (at least 64), as 64, 256, 1k, 4k, 16k, 64k, 256k, ..."""
    p = 64
    while p < x:
        p *= 4
    for unit, div in (("m", 1 << 20), ("k", 1 << 10)):
        if p >= div:
            return f"{p // div}{unit}"
    return str(p)


def bucket(m: int, k: int, n: int, g: int) -> str:
    """The bucket of a grouped matmul with forward operands lhs [M, K], rhs [G, K, N].

    Example: M=8192, K=N=1024, G=64 (128 rows a group) -> "r256_k1k_n1k".
    """
    return f"r{size_class(math.ceil(m / max(g, 1)))}_k{size_class(k)}_n{size_class(n)}"


def check_table(table: dict, where: str = TABLE_FILE) -> dict:
    """`table` if it has a provenance with every field and well-formed rows; else ValueError
    naming `where` and the first thing wrong."""
    prov = table.get("provenance")
    if not isinstance(prov, dict):
        raise ValueError(f"{where}: no 'provenance' object (fields {list(PROVENANCE_FIELDS)})")
    missing = [f for f in PROVENANCE_FIELDS if not prov.get(f)]
    if missing:
        raise ValueError(f"{where}: provenance lacks {missing}")
    rows = table.get("rows")
    if not isinstance(rows, list):
        raise ValueError(f"{where}: 'rows' must be a list")
    seen = set()
    for i, row in enumerate(rows):
        lacks = [f for f in ROW_FIELDS if f not in row]
        if lacks:
            raise ValueError(f"{where}: row {i} lacks {lacks}")
        if row["direction"] not in DIRECTIONS:
            raise ValueError(f"{where}: row {i} direction={row['direction']!r} is not one of "
                             f"{DIRECTIONS}")
        key = (row["device_kind"], row["bucket"], row["direction"])
        if key in seen:
            raise ValueError(f"{where}: row {i} repeats {key}")
        seen.add(key)
    return table


@functools.cache
def table() -> dict:
    """The committed table (read once per process)."""
    text = resources.files("dropless.ops.gmm").joinpath(TABLE_FILE).read_text()
    return check_table(json.loads(text))


def _index(tab: dict) -> dict:
    return {(r["device_kind"], r["bucket"], r["direction"]): r for r in tab["rows"]}


def lookup(device_kind: str | None, bucket_name: str, direction: str,
           tab: dict | None = None) -> dict | None:
    """The row for (device kind, bucket, direction) of `tab` (default: the committed table);
    None when there is none."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction={direction!r} is not one of {DIRECTIONS}")
    if device_kind is None:
        return None
    tab = tab if tab is not None else _TABLE.get() or table()
    return _index(tab).get((device_kind, bucket_name, direction))


def winner(device_kind: str | None, m: int, k: int, n: int, g: int, direction: str,
           tab: dict | None = None) -> str | None:
    """The backend measured fastest for this device kind, bucket and direction (None: none)."""
    row = lookup(device_kind, bucket(m, k, n, g), direction, tab)
    return None if row is None else row["backend"]


@contextlib.contextmanager
def device_scope(device_kind: str | None, tab: dict | None = None) -> Iterator[None]:
    """Within the block, `auto` looks winners up for `device_kind` (compile-only lowering on a
    host without the GPU; tests) in `tab` (checked by `check_table`; default: the committed
    table)."""
    token = _DEVICE.set(device_kind)
    token_t = _TABLE.set(check_table(tab, "device_scope(tab=...)") if tab is not None else None)
    try:
        yield
    finally:
        _TABLE.reset(token_t)
        _DEVICE.reset(token)


def device_kind() -> str | None:
    """The GPU kind winners are looked up for: `device_scope`'s, else the abstract GPU being
    lowered for (`jax.sharding.use_abstract_mesh`, as `triton_check.abstract_gpu_target` sets
    it), else the first GPU of this process (jax's `device_kind`), else None."""
    scoped = _DEVICE.get()
    if scoped is not None:
        return scoped
    import jax  # noqa: PLC0415 (kept out of the table's import for the bench's readers)
    get_mesh = getattr(jax.sharding, "get_abstract_mesh", None)
    abstract = getattr(get_mesh(), "abstract_device", None) if get_mesh else None
    if abstract is not None and abstract.platform == "gpu":
        return abstract.device_kind
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        return None
    return gpus[0].device_kind if gpus else None


def _candidates(recs: list[dict]) -> list[dict]:
    """The gmm section's timed grouped matmuls that can name a winner: not a baseline, not
    aligned segments (another layout than `auto`'s callers pass), and run by the backend asked
    for (a record where another ran, after a fallback, times that other one)."""
    return [r for r in recs if r.get("section") == "gmm" and "median_ms" in r
            and r.get("backend") not in NOT_CANDIDATES and not r.get("aligned")
            and r.get("ran", r.get("backend")) == r.get("backend")]


def _fastest_everywhere(times: dict) -> tuple[str | None, dict]:
    """(the backend fastest at every key, the times compared): only backends measured at every
    key are compared; None when no one of them is fastest at all of them."""
    keys = set().union(*times.values()) if times else set()
    full = {b: t for b, t in sorted(times.items()) if set(t) == keys}
    best = [b for b, t in full.items() if all(t[k] == min(u[k] for u in full.values())
                                              for k in keys)]
    return (best[0] if best else None), full


def from_records(recs: list[dict], *, source: str, date: str) -> dict:
    """The winner table (checked by `check_table`) of one device check's records.

    Per bucket of the shapes the gmm section timed and per direction: the backend with the
    lowest median (ms, to 4 decimals) at every (shape, routing) of the bucket, among the
    backends measured at all of them; a bucket and direction where none is fastest everywhere
    gets no row (`auto` takes its chain's default there; the note names them); a tie goes to
    the first name in alphabetical order. `dlhs` and `drhs` use their own mode's times
    where the records have them, else the forward+backward time (`MODE_OF`). Provenance: the
    info record's commit, device and versions, `source` (the records' file) and `date`.
    Raises ValueError (one line naming `source`) for a dry run's records, no info record, no
    commit, or no grouped-matmul timing to choose from.
    """
    info = next((r for r in recs if r.get("section") == "info" and "device_kind" in r), None)
    if info is None:
        raise ValueError(f"{source}: no info record (device kind, versions): not the records "
                         f"of `dropless bench gpu`")
    if any(r.get("dry_run") for r in recs):
        raise ValueError(f"{source}: the records of a dry run (CPU, numbers meaningless); build "
                         f"the table from a device run's gpu_bench.jsonl")
    if not info.get("git_commit"):
        raise ValueError(f"{source}: the info record names no git_commit (the table must say "
                         f"which commit it measured)")
    timed = _candidates(recs)
    if not timed:
        raise ValueError(f"{source}: no grouped-matmul timing (section gmm, a backend that ran "
                         f"as asked) to choose winners from")
    kind = info["device_kind"]
    # (bucket, mode) -> backend -> "routing" (or "shape routing" where shapes share a bucket)
    shapes_of: dict[str, list[str]] = {}
    for r in timed:
        b = bucket(r["m"], r["k"], r["n"], r["groups"])
        shapes_of.setdefault(b, [])
        if r["shape"] not in shapes_of[b]:
            shapes_of[b].append(r["shape"])
    times: dict[tuple, dict] = {}
    for r in timed:
        b = bucket(r["m"], r["k"], r["n"], r["groups"])
        key = r["routing"] if len(shapes_of[b]) == 1 else f"{r['shape']} {r['routing']}"
        times.setdefault((b, r["mode"]), {}).setdefault(r["backend"], {})[key] = round(
            r["median_ms"], 4)
    rows, none = [], []
    for b in sorted(shapes_of):
        for direction in DIRECTIONS:
            mode = direction if (b, direction) in times else MODE_OF[direction]
            if (b, mode) not in times:
                continue
            won, compared = _fastest_everywhere(times[(b, mode)])
            if won is None:
                none.append(f"{b} {direction}")
                continue
            rows.append({"device_kind": kind, "bucket": b, "direction": direction,
                         "backend": won, "shape": ", ".join(shapes_of[b]), "mode": mode,
                         "times_ms": compared})
    alone = sorted({r["mode"] for r in timed} & {"dlhs", "drhs"})
    stand_in = [d for d in ("dlhs", "drhs") if d not in alone]
    smi = info.get("nvidia_smi")
    note = (f"Built by from_records (python benchmarks/gpu/tables.py winners) from "
            f"{len(timed)} grouped-matmul medians of section gmm: "
            f"{', '.join(sorted({r['backend'] for r in timed}))} at "
            f"{', '.join(sorted({r['shape'] for r in timed}))}, routings "
            f"{', '.join(sorted({r['routing'] for r in timed}))}. A row's backend is the fastest "
            f"at every routing measured; records where another backend ran (a fallback) are "
            f"left out. "
            + (f"Timed alone: {', '.join(alone)}. " if alone else "")
            + (f"{' and '.join(stand_in)} not timed alone: their rows take the "
               f"forward+backward median. " if stand_in else "")
            + (f"No backend fastest everywhere, so no row: {'; '.join(none)}." if none else ""))
    table_ = {"provenance": {
        "commit": info["git_commit"], "date": date,
        "device": f"one {kind}" + (f" (nvidia-smi: {smi})" if smi else ""), "source": source,
        "jax": f"{info.get('jax')} (tokamax {info.get('tokamax')}, triton {info.get('triton')})",
        "dtype": ", ".join(sorted({str(r.get("dtype")) for r in timed})), "note": note.strip()},
        "rows": rows}
    return check_table(table_, source)


__all__ = ["bucket", "size_class", "winner", "lookup", "table", "check_table", "device_scope",
           "device_kind", "from_records"]
