"""tokamax's tuned kernel configs, shipped per device kind and applied around its calls.

Legend: M rows (sorted by group), K contraction dim, N output dim, G groups.

tokamax chooses a kernel config (block sizes, stages, persistence) per shape from its autotuning
cache; for a shape the cache lacks it uses its heuristic (tokamax 0.0.17 ships data for
`nvidia_h100_80gb_hbm3` and `nvidia_b200` only). A restricted `tokamax.autotune` on the device
yields an `AutotuningResult`, whose `.dump()` is a JSON object {"device_kind": ..., "data":
[...]}; used as a context, it overlays tokamax's cache while traced calls pick their configs.

This package ships such dumps under `ops/gpu/tuned/`, one file per device kind:
`tokamax_<kind>.json`, the kind lower-cased with every other character an underscore ("NVIDIA
H200" -> tokamax_nvidia_h200.json). `tuned(device_kind)` finds, checks and loads the file (once
a process) and says what it did in one line; `tokamax_backend` enters it around the forward and
the backward of each tokamax call and records that line in the choice (`configs`). No file for
the kind, or no GPU kind known: tokamax's own cache and heuristic, recorded as such. A file that
is not a dump for its kind is an error naming the file.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import re
from importlib import resources
from typing import Any, Iterator

PACKAGE, FOLDER = "dropless.ops.gpu", "tuned"


def file_name(device_kind: str) -> str:
    """The shipped file for a device kind: 'NVIDIA H200' -> 'tokamax_nvidia_h200.json'."""
    return "tokamax_" + re.sub(r"[^a-z0-9]+", "_", device_kind.lower()).strip("_") + ".json"


def check_dump(text: str, device_kind: str, where: str) -> dict:
    """The parsed dump if `text` is an AutotuningResult dump for `device_kind`; else ValueError
    naming `where` and what is wrong."""
    try:
        dump = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e.msg} at line {e.lineno}); expected a "
                         "tokamax AutotuningResult dump") from None
    if not isinstance(dump, dict) or not isinstance(dump.get("data"), list):
        raise ValueError(f"{where}: expected a tokamax AutotuningResult dump, an object with "
                         "'device_kind' and a 'data' list")
    if dump.get("device_kind") != device_kind:
        raise ValueError(f"{where}: tuned for device_kind={dump.get('device_kind')!r}, not "
                         f"{device_kind!r}; write it to {file_name(str(dump.get('device_kind')))}")
    return dump


@dataclasses.dataclass(frozen=True)
class Tuned:
    """What applies to tokamax's calls: `result` (an AutotuningResult, None: the heuristic) and
    `status`, the one line a choice records."""
    result: Any
    status: str


def shipped_text(device_kind: str) -> str | None:
    """The shipped dump's text for `device_kind` (None: the package has none)."""
    path = resources.files(PACKAGE).joinpath(FOLDER, file_name(device_kind))
    return path.read_text() if path.is_file() else None


def result_class(tokamax):
    """tokamax's AutotuningResult class (public name, else its module; None: neither)."""
    cls = getattr(tokamax, "AutotuningResult", None)
    if cls is None:
        try:
            from tokamax._src.autotuning.api import AutotuningResult as cls  # noqa: PLC0415
        except Exception:  # noqa: BLE001 (layout moved: no tuned configs, said so)
            return None
    return cls


@functools.lru_cache(maxsize=16)
def _tuned(device_kind: str | None, tokamax) -> Tuned:
    if device_kind is None:
        return Tuned(None, "heuristic: no GPU device kind in this process")
    text = shipped_text(device_kind)
    name = file_name(device_kind)
    if text is None:
        return Tuned(None, f"heuristic: no tuned configs for {device_kind} ({FOLDER}/{name} "
                           "is not in the package)")
    dump = check_dump(text, device_kind, f"{PACKAGE}/{FOLDER}/{name}")
    cls = result_class(tokamax)
    if cls is None:
        return Tuned(None, f"heuristic: this tokamax has no AutotuningResult to load {name}")
    return Tuned(cls.loads(text), f"tuned: {FOLDER}/{name} ({len(dump['data'])} configs)")


def tuned(device_kind: str | None, tokamax) -> Tuned:
    """The shipped configs for `device_kind`, loaded into `tokamax`'s AutotuningResult (cached
    per process). Raises ValueError naming the file when it is not a dump for its kind."""
    return _tuned(device_kind, tokamax)


@contextlib.contextmanager
def applied(t: Tuned) -> Iterator[None]:
    """Within the block, tokamax picks configs from `t.result` first (nothing: the heuristic)."""
    if t.result is None:
        yield
        return
    with t.result:
        yield


__all__ = ["file_name", "check_dump", "tuned", "applied", "Tuned", "shipped_text"]
