"""The Hugging Face config.json keys a dropless directory carries for the way back, and what an
export writes where the folder keeps none.

`dropless convert` HF -> dropless writes KEPT_FILE beside the weights: the source config.json's
keys the model does not determine, verbatim (`hf.round_trip.kept_keys`: token ids,
`max_position_embeddings`, `use_cache`, ...). dropless -> HF writes them back under the model's
own keys (which win; `hf.round_trip.overridden` lists the disagreements, said in one line each),
and fills what the folder keeps nothing for (`fallback_keys`):

* `max_position_embeddings`: the kept value (a training run keeps a copy of its start's, made
  with the run: `train.init_from.keep_start_config`; a run made before that copy existed
  follows `init_from`, through runs, to the model it started from); else a YaRN model's
  original x factor; else a run's `seq_len` (the longest context it trained on); else 4096
  (`hf.round_trip.DEFAULT_MAX_POSITIONS`).
* `bos_token_id` / `eos_token_id`: kept; else the folder's generation_config.json; else its
  tokenizer.json's BOS / EOS (`data.tokenizer`); else absent.
* `initializer_range`: the model's `init_std`, always.

Layer: `model_dir`; reads `hf.round_trip` (which keys), `hf.config_formats` (JSON of an HF
folder) and `data.tokenizer` (special tokens), each when called.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from dropless.model_dir.folder import names_architectures, parse_spec, read_json_object

KEPT_FILE = "hf_kept_config.json"
TOKEN_KEYS = ("bos_token_id", "eos_token_id")
_MAX_HOPS = 16   # init_from links followed from a run to the model it started from


_JSON_TYPES = {list: "an array", str: "a string", int: "a number", float: "a number",
               bool: "a boolean", type(None): "null"}


def _redo(path: Path) -> str:
    return (f"the file carries the source config.json's keys that dropless does not model: "
            f"convert the Hugging Face folder again, or delete {path} to export with the "
            "defaults (docs/hf.md)")


def read_kept(folder: str | Path, *, what: str = "") -> dict[str, Any] | None:
    """The kept keys of a dropless directory (KEPT_FILE), None when it has none (a model
    converted before the keys were kept, or never converted from Hugging Face). Raises
    ValueError starting with `what`, naming the file and what to do, when it is not a JSON
    object."""
    path = Path(folder) / KEPT_FILE
    if not path.is_file():
        return None
    prefix = f"{what}: " if what else ""
    try:
        kept = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{prefix}{path} is not valid JSON ({e}); {_redo(path)}") from None
    if not isinstance(kept, dict):
        raise ValueError(f"{prefix}{path} holds {_JSON_TYPES[type(kept)]}, not a JSON object "
                         f"of config.json keys; {_redo(path)}")
    return kept


def kept_of_hf_folder(folder: str | Path) -> dict[str, Any]:
    """The keys of an HF folder's config.json to keep (`hf.round_trip.kept_keys`)."""
    from dropless.hf.config_formats import read_json
    from dropless.hf.round_trip import kept_keys
    conf = Path(folder) / "config.json"
    return kept_keys(read_json(conf), str(conf))


def is_run(folder: str | Path) -> bool:
    """A run directory (checkpoints/, no params/), not a `dropless convert` output."""
    return not (Path(folder) / "params").is_dir()


def origin_keys(folder: str | Path, saved: dict, *, what: str = "",
                announce: Callable[[str], Any] | None = None
                ) -> tuple[dict[str, Any] | None, Path | None]:
    """(the kept keys that go with the dropless directory `folder`, the file they come from):
    its own KEPT_FILE (for a run, the copy made at its start); else, for a run (its config.json
    as saved: `saved`), those of the model it started from (`init_from`: an HF folder's
    config.json, or a dropless directory's KEPT_FILE, followed through runs); (None, None) when
    the model came from no Hugging Face folder. A start that is gone or unreadable is said to
    `announce` and counts as none. Raises ValueError for a KEPT_FILE that is not a JSON object
    (`read_kept`)."""
    folder, seen = Path(folder), set()
    for _ in range(_MAX_HOPS):
        kept = read_kept(folder, what=what)
        if kept is not None or not is_run(folder) or not saved.get("init_from"):
            return kept, (folder / KEPT_FILE if kept is not None else None)
        start = str(saved["init_from"])
        seen.add(folder.absolute())
        try:
            if names_architectures(start, what=start):
                conf = parse_spec(start).folder / "config.json"
                return kept_of_hf_folder(conf.parent), conf
            folder = parse_spec(start).folder
            if folder.absolute() in seen:
                return None, None
            saved = read_json_object(folder / "config.json", what=start)
            if not isinstance(saved, dict):
                raise ValueError(f"{folder / 'config.json'} is not a dropless config")
        except (OSError, ValueError) as e:
            if announce is not None:
                announce(f"{what or folder}: the model started from {start}, which cannot be "
                         f"read now ({str(e).splitlines()[0][:200]}); its config.json keys "
                         "are not kept, the defaults are written (docs/hf.md)")
            return None, None
    return None, None


def _generation_ids(folder: Path, *, what: str) -> dict[str, Any]:
    path = folder / "generation_config.json"
    if not path.is_file():
        return {}
    gen = read_json_object(path, what=what)
    return {k: gen[k] for k in TOKEN_KEYS if isinstance(gen, dict) and gen.get(k) is not None}


def _tokenizer_ids(tokenizer: str) -> dict[str, Any]:
    if not (tokenizer.endswith(".json") and Path(tokenizer).is_file()):
        return {}
    from dropless.data.tokenizer import make_tokenizer
    tok = make_tokenizer(tokenizer)
    ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id}
    return {k: v for k, v in ids.items() if v is not None}


def fallback_keys(folder: str | Path, saved: dict, kept: dict[str, Any] | None, *,
                  tokenizer: str, what: str = "") -> dict[str, Any]:
    """What the export writes where `kept` (`origin_keys`) has nothing (module doc): a run's
    `seq_len` as max_position_embeddings, the token ids of the folder's generation_config.json
    or of `tokenizer` (a tokenizer.json path; 'byte' and '' give none). Raises ValueError
    starting with `what` for a generation_config.json or tokenizer.json that cannot be read."""
    folder, kept = Path(folder), kept or {}
    out: dict[str, Any] = {}
    seq_len = saved.get("seq_len")
    if "max_position_embeddings" not in kept and is_run(folder) and isinstance(seq_len, int) \
            and not isinstance(seq_len, bool) and seq_len > 0:
        out["max_position_embeddings"] = seq_len
    if all(k in kept for k in TOKEN_KEYS):
        return out
    for source in (lambda: _generation_ids(folder, what=what), lambda: _tokenizer_ids(tokenizer)):
        for key, value in source().items():
            if key not in kept:
                out.setdefault(key, value)
        if all(k in kept or k in out for k in TOKEN_KEYS):
            break
    return out


def override_words(source: Path | None, changed: dict[str, tuple[Any, Any]]) -> list[str]:
    """One line per kept key the model overrides (`hf.round_trip.overridden`), naming the file
    the kept keys came from (`origin_keys`)."""
    return [f"{source}: {key}={was!r} is not the model's; writing the model's {key}={now!r}"
            for key, (was, now) in changed.items()]


__all__ = ["KEPT_FILE", "TOKEN_KEYS", "read_kept", "kept_of_hf_folder", "is_run", "origin_keys",
           "fallback_keys", "override_words"]
