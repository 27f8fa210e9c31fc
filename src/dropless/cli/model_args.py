"""Checks of the arguments `dropless eval`, `generate` and `convert` share, run before any model
is read or compiled; each error names the command and the argument (`--seq-len=0 ...`)."""
from __future__ import annotations

import math
from pathlib import Path

HF_PREFIX = "hf:"


def at_least(cmd: str, flag: str, value: int, low: int) -> None:
    if value < low:
        raise ValueError(f"dropless {cmd}: {flag}={value} must be >= {low}")


def check_dtype(cmd: str, value: str | None) -> None:
    """A floating dtype name (numpy's, with ml_dtypes' bfloat16 / float8 names), or None."""
    if value is None:
        return
    import ml_dtypes  # noqa: F401 - registers bfloat16 & co. with numpy
    import numpy as np
    try:
        dt = np.dtype(value)
    except TypeError:
        dt = None
    if dt is None or not (np.issubdtype(dt, np.floating) or dt.name == "bfloat16"):
        raise ValueError(f"dropless {cmd}: --dtype={value!r} is not a floating dtype name "
                         "(try float32 or bfloat16)")


def check_temperature(cmd: str, value: float) -> None:
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"dropless {cmd}: --temperature={value} must be a finite number >= 0 "
                         "(0 = greedy)")


def check_model(cmd: str, spec: str) -> None:
    """MODEL is hf:DIR with a config.json, or a dropless directory (config.json holding a
    model); an HF folder named without hf: is refused with the spelling to use."""
    import json
    folder = Path(spec[len(HF_PREFIX):] if spec.startswith(HF_PREFIX) else spec)
    if not folder.is_dir():
        raise ValueError(f"dropless {cmd} {spec}: no such folder")
    conf = folder / "config.json"
    if not conf.is_file():
        raise ValueError(f"dropless {cmd} {spec}: no config.json in {folder} (want hf:DIR, a "
                         "Hugging Face folder, or a `dropless convert` / run directory)")
    if spec.startswith(HF_PREFIX):
        return
    try:
        saved = json.loads(conf.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"dropless {cmd} {spec}: {conf} is not valid JSON ({e})") from None
    if not isinstance(saved, dict) or "model" not in saved:
        raise ValueError(f"dropless {cmd} {spec}: {folder} looks like a Hugging Face folder; "
                         f"write dropless {cmd} hf:{spec}")


def model_tokenizer(cmd: str, spec: str, override: str | None):
    """The tokenizer for MODEL: `override` ('byte' or a tokenizer.json), else the folder's
    (an HF folder without tokenizer.json is refused, see `train.tokenizer.folder_tokenizer`)."""
    from dropless.train.init_from import folder_tokenizer
    from dropless.train.tokenizer import make_tokenizer
    try:
        return make_tokenizer(override or folder_tokenizer(spec, override="--tokenizer byte"))
    except ValueError as e:
        raise ValueError(f"dropless {cmd} {spec}: {e}") from None
