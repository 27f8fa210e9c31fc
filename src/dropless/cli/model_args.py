"""Checks of the arguments `dropless eval`, `generate` and `convert` share, run before any model
is read or compiled; each error names the command and the argument (`--seq-len=0 ...`)."""
from __future__ import annotations

import contextlib
import math
from typing import Iterator


def add_model_options(parser) -> None:
    """--tokenizer and --dtype, as eval and generate take them (after their own options)."""
    parser.add_argument("--tokenizer", help="byte, hf:DIR, a folder holding tokenizer.json, "
                                            "or a tokenizer.json path (default: the model "
                                            "folder's tokenizer.json; an HF folder without one "
                                            "is refused)")
    parser.add_argument("--dtype", help="parameter/activation dtype (default: the model's)")


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
    from dropless.model_dir import parse_spec, read_dropless_config
    what = f"dropless {cmd} {spec}"
    folder = parse_spec(spec).folder
    if not folder.is_dir():
        raise ValueError(f"{what}: no such folder")
    if not parse_spec(spec).hf:
        read_dropless_config(folder, what=what, as_hf=f"dropless {cmd} hf:{spec}")
    elif not (folder / "config.json").is_file():
        raise ValueError(f"{what}: no config.json in {folder} (want a Hugging Face folder as "
                         "hf:DIR, or a `dropless convert` / run directory)")


def model_tokenizer(cmd: str, spec: str, override: str | None):
    """The tokenizer for MODEL: `override` (named as every command names one,
    `model_dir.resolve_tokenizer`), else the folder's (an HF folder without tokenizer.json is
    refused, see `model_dir.hf_tokenizer`)."""
    from dropless.model_dir import folder_tokenizer, resolve_tokenizer
    from dropless.data.tokenizer import make_tokenizer
    try:
        return make_tokenizer(resolve_tokenizer(override, name="--tokenizer") if override
                              else folder_tokenizer(spec, override="--tokenizer byte"))
    except ValueError as e:
        raise ValueError(f"dropless {cmd} {spec}: {e}") from None


@contextlib.contextmanager
def usage_errors() -> Iterator[None]:
    """A model folder that lacks a file (no config.json, no *.safetensors: the HF reader's
    FileNotFoundError) is a mistake in the command's arguments: re-raised as ValueError with
    the same text, so `cli.main` prints it as one line with exit status 2."""
    try:
        yield
    except FileNotFoundError as e:
        raise ValueError(str(e)) from e
