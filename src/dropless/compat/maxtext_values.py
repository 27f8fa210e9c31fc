"""What a MaxText translator (compat/maxtext.py, compat/maxtext_data.py) reads and returns:
the items given beside its own (`Given`), the pairs of our keys it returns (`Pairs`), its
signature (`Translator`), and the readers of a flag's value that refuse a bad one in a
ValueError naming the flag and the value (`read_bool`, `read_int`, `read_float`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

Pairs = list[tuple[str, Any]]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Given:
    """What a translator reads besides its own (name, value): every item given, by name
    (`seen`), whether `sparse_matmul` is on, and the notes list it appends to."""
    seen: dict[str, Any]
    sparse: bool
    notes: list[str]


# (name, value, given) -> our pairs; raises ValueError naming the name and value
Translator = Callable[[str, Any, Given], Pairs]


def read_bool(name: str, v: Any) -> bool:
    """`v` (a bool, or "true" / "false" in any case) as a bool; ValueError naming `name` and
    `v` otherwise."""
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.lower() in ("true", "false"):
        return v.lower() == "true"
    raise ValueError(f"MaxText {name}={v!r} must be true or false")


def read_int(name: str, v: Any) -> int:
    """`v` (an int, or a string of digits) as an int; ValueError naming `name` and `v`
    otherwise (a float too: 2.5 is never truncated to 2)."""
    if isinstance(v, bool) or not isinstance(v, (int, str)) or not str(v).lstrip("-").isdigit():
        raise ValueError(f"MaxText {name}={v!r} must be an int")
    return int(v)


def read_float(name: str, v: Any) -> float:
    """`v` (an int, a float or a string of one: PyYAML reads 1e-3 as a string) as a finite
    float; ValueError naming `name` and `v` otherwise (nan and inf too: a translator compares
    the value, and nan compares false with everything)."""
    try:
        f = float(v) if isinstance(v, (int, float, str)) and not isinstance(v, bool) else None
    except ValueError:
        f = None
    if f is None or not math.isfinite(f):
        raise ValueError(f"MaxText {name}={v!r} must be a finite number")
    return f
