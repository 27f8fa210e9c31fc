"""JSON that other programs can read: never a NaN or Infinity token.

Python's `json` writes float('nan') as `NaN`, which is not JSON (RFC 8259); `jq`, JavaScript and
most parsers refuse the whole document. Every JSON the command line prints or writes goes through
`dumps`: a non-finite number becomes null, and the object holding it gains a field
`<key>_nonfinite` saying what it was ("nan", "inf", "-inf"; for a list or nested value, which
elements: "[3]: nan, [7]: inf"). Nothing else is changed.
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
