"""What every config field shares: its one-line description (`described`), what a scalar value
may be (`scalar_fields`, `scalar_type_error`), and the checks the configs' `__post_init__`s run.

Every error names the field and the value, e.g. `MoEConfig.top_k=9 must be <= num_experts=8`.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import typing
from typing import Any

import numpy as np

from dropless.config.names import MAX_SIZE, MODEL_DTYPES


def _fail(cls: str, field: str, value: Any, why: str) -> None:
    raise ValueError(f"{cls}.{field}={value!r} {why}")


DOC = "doc"   # the metadata key of a config field's one-line description


def described(default: Any = dataclasses.MISSING, *, doc: str) -> Any:
    """A dataclass field carrying its one-line description `doc` in its metadata (under `DOC`):
    the one place a config key is described (`config_docs` writes docs/config.md from it).
    `default` is `dataclasses.field`'s; without one the field is required."""
    return dataclasses.field(default=default, metadata={DOC: doc})


SCALAR_WORDS = {bool: "true or false", int: "an int", float: "a finite number", str: "a string"}


@functools.lru_cache(maxsize=None)
def scalar_fields(cls) -> dict[str, tuple[type, bool]]:
    """name -> (bool | int | float | str, whether None is allowed) for each of `cls`'s scalar
    fields (nested configs are left out). The one description of what a config value may be."""
    out = {}
    for name, hint in typing.get_type_hints(cls).items():
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        base = args[0] if len(args) == 1 else hint
        if base in SCALAR_WORDS:
            out[name] = (base, type(None) in typing.get_args(hint))
    return out


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    name = {bool: "a boolean", int: "an int", float: "a float", str: "a string", list: "a list",
            dict: "a mapping"}.get(type(value), f"a {type(value).__name__}")
    return name


def scalar_type_error(value: Any, base: type, optional: bool) -> str | None:
    """Why `value` cannot be a config value of type `base` ('must be ..., not ...'), or None when
    it can. Booleans are strict (no 0/1, no strings), ints are not floats, floats are finite and
    accept ints; numpy scalars count as the Python type they stand for."""
    if value is None:
        ok = optional
    elif base is bool:
        ok = isinstance(value, bool) or type(value).__name__ == "bool_"
    elif base is int:
        ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    elif base is float:
        ok = (isinstance(value, numbers.Real) and not isinstance(value, bool)
              and math.isfinite(value))
    else:
        ok = isinstance(value, base)
    if ok:
        return None
    return f"must be {SCALAR_WORDS[base]}{' or null' if optional else ''}, not {_describe(value)}"


def _check_types(obj: Any) -> None:
    """Every scalar field of a config dataclass holds a value of its declared type."""
    cls = type(obj)
    for name, (base, optional) in scalar_fields(cls).items():
        why = scalar_type_error(getattr(obj, name), base, optional)
        if why:
            _fail(cls.__name__, name, getattr(obj, name), why)


def _positive_ints(cls: str, obj: Any, names: tuple[str, ...], *, allow_zero: bool = False) -> None:
    """Each field in `names` holds an int > 0 (>= 0 with `allow_zero`); bools are not ints."""
    for name in names:
        v = getattr(obj, name)
        ok = isinstance(v, int) and not isinstance(v, bool) and (v >= 0 if allow_zero else v > 0)
        if not ok:
            _fail(cls, name, v, "must be an int >= 0" if allow_zero else "must be a positive int")


def _sizes(cls: str, obj: Any, names: tuple[str, ...]) -> None:
    """Each field in `names` (an int, checked before) is below MAX_SIZE (2**31)."""
    for name in names:
        v = getattr(obj, name)
        if v >= MAX_SIZE:
            _fail(cls, name, v, f"must be < 2**31 = {MAX_SIZE:,} (sizes and positions are "
                  "int32 on the device); a typo?")


def _one_of(cls: str, obj: Any, name: str, choices: tuple[str, ...]) -> None:
    """Field `name` holds one of `choices`."""
    if getattr(obj, name) not in choices:
        _fail(cls, name, getattr(obj, name), f"must be one of {choices}")


def _check_dtype(cls: str, field: str, value: str) -> None:
    """`value` is one of MODEL_DTYPES, by name (a numpy spelling such as 'half' is named as the
    dtype it stands for)."""
    if value in MODEL_DTYPES:
        return
    import ml_dtypes  # noqa: F401,PLC0415 (registers bfloat16, float8_*: np.dtype reads their
    #                    names; imported here, off the common path: it takes ~0.7 s to import)
    try:
        dt = np.dtype(value)
    except TypeError:
        _fail(cls, field, value, f"is not a dtype name (one of {', '.join(MODEL_DTYPES)})")
    if dt.name in MODEL_DTYPES:
        _fail(cls, field, value, f"must be spelled {dt.name!r}")
    why = "; float64 runs as float32 in JAX" if dt.name == "float64" else ""
    _fail(cls, field, value, f"is not a model dtype (one of {', '.join(MODEL_DTYPES)}{why})")
