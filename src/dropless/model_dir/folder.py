"""The folder formats, as files: the `hf:DIR` spec, a dropless directory's and a run's
config.json, and the tokenizer a folder implies. No weights are read here (`model_dir.weights`).

A MODEL argument (`init_from=`, `dropless eval|generate|convert`) is one of:

* `hf:DIR`: a Hugging Face folder (config.json naming `architectures`, *.safetensors,
  tokenizer.json and its side files);
* `DIR`: a dropless directory: config.json (a TrainConfig as `model_dir.to_dict` writes it)
  + params/ (orbax, `dropless convert` output), or a run directory: config.json + checkpoints/.

Also the one reading of a tokenizer's name (`resolve_tokenizer`: byte, hf:DIR, a folder, a
tokenizer.json, for every command) and the vocabulary the training data needs
(`data_vocab_size`: a prepared dataset's manifest, `prepared_vocab_size`, else the
tokenizer's).

Layer: above `hf` (an `hf:` preset reads the folder's config.json through `hf.read_config`,
imported when asked) and `data` (manifests and tokenizers, imported when asked), below
`presets` and `config_file`, which read folders through here; it imports nothing else of
dropless.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

HF_PREFIX = "hf:"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A parsed MODEL argument: `text` as given, `folder` it names, `hf` when it said `hf:`."""
    text: str
    folder: Path
    hf: bool


def parse_spec(spec: str | Path) -> ModelSpec:
    """`hf:DIR` -> ModelSpec(folder=DIR, hf=True); anything else names a dropless directory.
    Raises ValueError for an empty spec or a bare `hf:`."""
    text = str(spec)
    hf = text.startswith(HF_PREFIX)
    name = text[len(HF_PREFIX):] if hf else text
    if not name:
        raise ValueError(f"model folder {text!r} is empty (want hf:DIR for a Hugging Face "
                         "folder, or DIR for a dropless directory)")
    return ModelSpec(text=text, folder=Path(name), hf=hf)


def is_hf(spec: str | Path) -> bool:
    """True for `hf:DIR`."""
    return str(spec).startswith(HF_PREFIX)


def read_json_object(path: Path, *, what: str = "") -> Any:
    """The JSON document in `path` (any JSON value); ValueError starting with `what` (when
    given) if the file is not JSON (or not UTF-8)."""
    try:
        return json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = f"{what}: " if what else ""
        raise ValueError(f"{where}{path} is not valid JSON ({e})") from None


def names_architectures(spec: str, *, what: str) -> bool:
    """True when `spec` is `hf:DIR`, or a folder whose config.json names `architectures` (a
    Hugging Face folder given without `hf:`; `dropless convert` follows it)."""
    parsed = parse_spec(spec)
    if parsed.hf:
        return True
    conf = parsed.folder / "config.json"
    if not conf.is_file():
        return False
    data = read_json_object(conf, what=what)
    return isinstance(data, dict) and "architectures" in data


def read_dropless_config(folder: str | Path, *, what: str = "", as_hf: str = "") -> dict:
    """A dropless directory's config.json as saved (nested plain data: `model_dir.from_dict`
    makes it a TrainConfig). Errors start with `what` (the command and argument the user gave:
    "init_from='DIR'", "dropless eval DIR"); a Hugging Face folder is refused with `as_hf`, the
    spelling to use instead (default: init_from='hf:DIR' for the default `what`, else "name it
    hf:DIR")."""
    folder = Path(folder)
    if not what:
        what, as_hf = f"init_from={str(folder)!r}", as_hf or f"init_from='hf:{folder}'"
    as_hf = as_hf or f"name it hf:{folder}"
    path = folder / "config.json"
    if not path.is_file():
        raise ValueError(f"{what}: no config.json in {folder} (want a Hugging Face folder "
                         f"as hf:DIR, or a `dropless convert` / run directory)")
    saved = read_json_object(path, what=what)
    if not isinstance(saved, dict) or "model" not in saved:
        if isinstance(saved, dict) and "architectures" in saved:
            raise ValueError(f"{what}: {folder} looks like a Hugging Face folder; write {as_hf}")
        raise ValueError(f"{what}: {path} holds neither a dropless config (no 'model') nor a "
                         "Hugging Face one (no 'architectures'); want a `dropless convert` / "
                         "run directory, or a Hugging Face folder as hf:DIR")
    from dropless.model_dir.run_config import check_keys
    check_keys(saved, f"{what}: {path}")
    return saved


def saved_preset(saved: dict) -> str:
    """The preset a saved config.json names; an old one without (or with null) says tiny, the
    preset every run started from before config.json held it."""
    return saved.get("preset") or "tiny"


def read_run_config(run: str | Path) -> dict:
    """The config.json of the training run directory `run` (to resume it); ValueError (one
    line, saying what to use instead) when `run` is not a run's directory: missing, without
    config.json, unreadable, or a model directory (`dropless convert` output, an HF folder)."""
    run = Path(run)
    if not (run / "config.json").is_file():
        what = "is not a run directory (no config.json)" if run.is_dir() else "does not exist"
        raise ValueError(f"--resume {run}: {what}; `ls {run.parent}` lists the runs, or "
                         "drop --resume to start a new run")
    try:
        saved = json.loads((run / "config.json").read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"--resume {run}: {run / 'config.json'} is not readable JSON "
                         f"({type(e).__name__}); it is not a run this version can resume, "
                         "drop --resume to start a new run") from None
    if not isinstance(saved, dict) or not {"model", "steps"} <= set(saved) or \
            (run / "params").is_dir():
        raise ValueError(f"--resume {run}: a model directory (`dropless convert` output or a "
                         "Hugging Face folder), not a training run; to train from its weights "
                         f"use init_from={run} and drop --resume")
    from dropless.model_dir.run_config import check_keys
    check_keys(saved, f"--resume {run}: {run / 'config.json'}")
    return saved


def saved_run_config(run: str | Path) -> dict | None:
    """A run directory's config.json as saved, None when it has none (a run not started)."""
    path = Path(run) / "config.json"
    return json.loads(path.read_text()) if path.exists() else None


def hf_model_config(spec: str):
    """The ModelConfig of the Hugging Face folder `hf:DIR` (its config.json; the `hf:` preset)."""
    from dropless.hf import read_config
    return read_config(parse_spec(spec).folder)[0]


def sentencepiece_howto(folder: Path) -> str:
    """The command that writes tokenizer.json beside a SentencePiece tokenizer.model."""
    return (f"python -c \"from transformers import AutoTokenizer; AutoTokenizer.from_pretrained("
            f"'{folder}').save_pretrained('{folder}')\" (needs transformers, sentencepiece, "
            "protobuf)")


def hf_tokenizer(folder: str | Path, *, override: str) -> str:
    """The tokenizer.json of a Hugging Face folder. Raises ValueError, naming `override` (how
    the user picks another: "--tokenizer byte", "tokenizer=byte"), when there is none, or only a
    SentencePiece tokenizer.model (with the command that writes tokenizer.json): an HF model is
    never fed byte tokens unless the user asks for `byte`."""
    folder = Path(folder)
    if (folder / "tokenizer.json").is_file():
        return str(folder / "tokenizer.json")
    if (folder / "tokenizer.model").is_file():
        raise ValueError(f"{folder} has only a SentencePiece tokenizer.model; write its "
                         f"tokenizer.json with: {sentencepiece_howto(folder)}; or pass {override}")
    raise ValueError(f"{folder} has no tokenizer.json; copy the model's tokenizer.json there, or "
                     f"pass {override} (bytes) or a tokenizer.json path")


def folder_tokenizer(spec: str, *, override: str = "tokenizer=byte") -> str:
    """The tokenizer a model folder implies: an HF folder's tokenizer.json (refused when it has
    none, see `hf_tokenizer`; `override` says how to choose another), a dropless directory's
    tokenizer.json, else the tokenizer its config.json names ("" when it names none)."""
    parsed = parse_spec(spec)
    if parsed.hf:
        return hf_tokenizer(parsed.folder, override=override)
    if (parsed.folder / "tokenizer.json").is_file():
        return str(parsed.folder / "tokenizer.json")
    if (parsed.folder / "config.json").is_file():
        saved = read_json_object(parsed.folder / "config.json")
        return saved.get("tokenizer", "byte") if isinstance(saved, dict) else "byte"
    return "byte"


def resolve_tokenizer(spec: str, *, name: str = "tokenizer") -> str:
    """The one reading of a tokenizer name, the same for `data prepare --tokenizer`, `train
    tokenizer=`, `eval` / `generate --tokenizer`: "byte", or the tokenizer.json path that `spec`
    names (a tokenizer.json path, `hf:DIR`, or a folder: an HF folder's or a dropless
    directory's tokenizer.json). `name` is how the user set it ("--tokenizer", "tokenizer");
    raises ValueError starting with `name=spec` when it names no tokenizer.json."""
    what = f"{name}={spec!r}"
    override = f"{name}{' ' if name.startswith('-') else '='}byte"
    if spec == "byte":
        return spec
    if not spec:
        raise ValueError(f"{what}: name a tokenizer: byte, hf:DIR, a folder holding "
                         "tokenizer.json, or a tokenizer.json path")
    if spec.endswith(".json"):
        path = Path(spec)
        if path.is_dir():
            raise ValueError(f"{what} is a folder, not a tokenizer.json file")
        if not path.is_file():
            raise ValueError(f"{what} does not exist")
        return spec
    if is_hf(spec) or Path(spec).is_dir():
        try:
            path = folder_tokenizer(spec, override=override)
        except ValueError as e:
            raise ValueError(f"{what}: {e}") from None
        if path == "byte" and (parse_spec(spec).folder / "config.json").is_file():
            return path                  # a dropless directory trained on bytes
        if not path.endswith(".json") or not Path(path).is_file():
            raise ValueError(f"{what}: the folder holds no tokenizer.json (pass {override} "
                             "or a tokenizer.json path)")
        return path
    if not Path(spec).exists():
        raise ValueError(f"{what} does not exist (want byte, hf:DIR, a folder holding "
                         "tokenizer.json, or a tokenizer.json path)")
    raise ValueError(f"{what} must be byte, hf:DIR, a folder holding tokenizer.json, or a "
                     "tokenizer.json path")


def prepared_vocab_size(data: str) -> tuple[int, str] | None:
    """(the vocab_size of a prepared dataset's manifest (`data prepare`), the manifest's path),
    or None when `data` is not a prepared dataset."""
    from dropless.data.manifest import MANIFEST, read_manifest
    folder = Path(data)
    if data and folder.is_dir() and (folder / MANIFEST).is_file():
        return read_manifest(folder).vocab_size, str(folder / MANIFEST)
    return None


def data_vocab_size(data: str, tokenizer: str) -> tuple[int, str] | None:
    """(the vocabulary size the training data needs, where that comes from): a prepared
    dataset's manifest (`prepared_vocab_size`), else the tokenizer's (a tokenizer.json or byte,
    named as `resolve_tokenizer` reads it); None for token files (.npy, .bin), whose ids say it."""
    prepared = prepared_vocab_size(data)
    if prepared is not None:
        return prepared
    folder = Path(data)
    if folder.suffix in (".npy", ".bin") or not tokenizer:
        return None
    from dropless.data.tokenizer import make_tokenizer
    tok = make_tokenizer(resolve_tokenizer(tokenizer))
    return tok.vocab_size, f"tokenizer {tok.name}"


def init_from_defaults(spec: str, *, preset_given: bool, tokenizer_given: bool
                       ) -> tuple[str | None, dict | None, str | None]:
    """What `init_from=spec` implies when the user did not say: (preset, the saved model as
    nested data or None, tokenizer), each None where given or not implied. An `hf:` folder is
    its own preset; a dropless directory names its preset and model. Raises ValueError starting
    with `init_from=...`."""
    preset = model = tok = None
    if not preset_given:
        if is_hf(spec):
            preset = spec
        else:
            saved = read_dropless_config(parse_spec(spec).folder)
            preset, model = saved_preset(saved), saved["model"]
    if not tokenizer_given:
        try:
            tok = folder_tokenizer(spec, override="tokenizer=byte")
        except ValueError as e:
            raise ValueError(f"init_from={spec!r}: {e}") from None
        if not tok:
            raise ValueError(f"init_from={spec!r}: the folder names no tokenizer (converted from "
                             "a Hugging Face folder without tokenizer.json); set tokenizer=byte "
                             "or tokenizer=PATH/tokenizer.json")
    return preset, model, tok
