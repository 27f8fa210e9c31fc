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


__all__ = ["bucket", "size_class", "winner", "lookup", "table", "check_table", "device_scope",
           "device_kind"]
