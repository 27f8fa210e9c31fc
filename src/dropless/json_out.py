"""JSON that other programs can read: never a NaN or Infinity token.

Python's `json` writes float('nan') as `NaN`, which is not JSON (RFC 8259); `jq`, JavaScript and
most parsers refuse the whole document. Every JSON the command line prints or writes goes through
`dumps`: a non-finite number becomes null, and the object holding it gains a field
`<key>_nonfinite` saying what it was ("nan", "inf", "-inf"; for a list or nested value, which
elements: "[3]: nan, [7]: inf"). Nothing else is changed. `restore` reads such an object back
with the non-finite numbers in place (how metrics.jsonl's NaN losses return to `report`).
"""
from __future__ import annotations

import json
import math
from typing import Any


def _kind(x: float) -> str:
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def _clean(obj: Any, path: str, found: list[str]) -> Any:
    """`obj` with non-finite floats replaced by None; each replaced one appended to `found` as
    '<path>: <kind>' (path relative to the enclosing object's field)."""
    if isinstance(obj, float) or type(obj).__name__ in ("float32", "float16", "bfloat16"):
        x = float(obj)
        if math.isfinite(x):
            return obj
        found.append(f"{path}: {_kind(x)}" if path else _kind(x))
        return None
    if isinstance(obj, dict):
        return finite(obj)
    if isinstance(obj, (list, tuple)):
        return [_clean(v, f"{path}[{i}]", found) for i, v in enumerate(obj)]
    return obj


def finite(obj: Any) -> Any:
    """A copy of `obj` (dicts, lists, tuples, scalars) with every non-finite float replaced by
    None and explained in a `<key>_nonfinite` field of the dict holding it (see the module)."""
    if not isinstance(obj, dict):
        return _clean(obj, "", []) if not isinstance(obj, (list, tuple)) else \
            [finite(v) if isinstance(v, dict) else _clean(v, "", []) for v in obj]
    out: dict = {}
    for k, v in obj.items():
        found: list[str] = []
        out[k] = _clean(v, "", found)
        if found:
            out[f"{k}_nonfinite"] = ", ".join(found)
    return out


def dumps(obj: Any, **kwargs) -> str:
    """`json.dumps` of `finite(obj)` with allow_nan=False (a NaN left anywhere is a bug here)."""
    return json.dumps(finite(obj), allow_nan=False, **kwargs)


_VALUES = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _put(value: Any, path: str, x: float) -> Any:
    """`value` with the element at `path` ("" or "[3]" or "[1][2]") set to x."""
    if not path:
        return x
    i, rest = path[1:].split("]", 1)
    out = list(value)
    out[int(i)] = _put(out[int(i)], rest, x)
    return out


def restore(obj: Any) -> Any:
    """The inverse of `finite`: every null explained by a `<key>_nonfinite` field becomes the
    number it was, and those fields go. Anything else is returned as it is."""
    if isinstance(obj, list):
        return [restore(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    out = {k: restore(v) for k, v in obj.items()}
    for key in [k for k in out if k.endswith("_nonfinite")]:
        base, why = key[:-len("_nonfinite")], out[key]
        if base not in out or not isinstance(why, str):
            continue
        value = out[base]
        for part in why.split(", "):
            path, _, kind = part.rpartition(": ") if ": " in part else ("", "", part)
            if kind in _VALUES:
                value = _put(value, path, _VALUES[kind])
        out[base] = value
        del out[key]
    return out
