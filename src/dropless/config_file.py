"""Building a TrainConfig from a preset, a YAML file and `key=value` overrides.

Keys are dotted paths into TrainConfig (`steps`, `mesh.fsdp`, `model.d_model`,
`model.moe.top_k`), `preset`, or MaxText flag names and the flat mesh names
(`fsdp_parallelism`, `dcn_fsdp`, ...), both translated by `dropless.compat.maxtext`. A later
source (the YAML file after the defaults, the command line after the file) wins; within one
source, two names that set the same key must agree, in either order (`one_spelling`: our
`mesh.expert=4` with MaxText's `ici_expert_parallelism=2` is refused naming both), and a name
given twice keeps its later value. Setting `model.d_model` also sets `model.moe.d_model`;
`model.moe=null` makes every layer dense; the node size follows from the mesh (`mesh.dcn_*`),
and `model.moe.devices_per_node` is refused naming those keys. A run's config.json is read back
by `resume_items` (`--resume`); its form (`to_dict`, `from_dict`, `upgrade`) is
`model_dir.run_config`'s. MaxText `xla_*` keys and environment keys add to `xla_flags` /
`environment`, whatever their order in one source (a later value of the same flag or variable
wins). An unknown key is a ValueError that names it and suggests the closest known key; a YAML
syntax error or a key given twice in one mapping is a one-line ValueError naming the file, line
and column. Values are strict: each key's value must be of its field's type
(`config.scalar_fields`): booleans are true/false only (YAML's yes/no/on/off too, never 0, 1 or
"maybe"), ints are not floats, floats are finite numbers (an int, or a string such as 3e-4 that
PyYAML leaves unparsed, is converted), strings are strings (`run_name=2024` is refused: quote
it); a wrong type is a ValueError naming the key, the value and the type expected.
"""
from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path
from typing import Any, Iterable

import yaml

from dropless.compat import maxtext
from dropless.config import (MeshConfig, ModelConfig, MoEConfig, TrainConfig, scalar_fields,
                             scalar_type_error)
from dropless.model_dir import (data_vocab_size, from_dict, init_from_defaults,
                                prepared_vocab_size, read_run_config, resolve_tokenizer,
                                saved_preset, to_dict, upgrade)
from dropless.presets import RUN_SETTINGS, get_preset

DEFAULT_PRESET = "tiny"


# the nested configs: path of dotted-key prefixes -> their class
SECTIONS = {(): TrainConfig, ("mesh",): MeshConfig, ("model",): ModelConfig,
            ("model", "moe"): MoEConfig}
# the MoE layer's node size key, refused: the node size is MeshConfig's (from mesh.dcn_*)
GONE_NODE_SIZE = "model.moe.devices_per_node"


def _fields(cls, prefix: str) -> list[str]:
    return [prefix + f.name for f in dataclasses.fields(cls)
            if f.name not in ("model", "moe", "mesh")]


def known_keys() -> list[str]:
    """Every key `build_config` accepts in our spelling, each once (MaxText names come on top)."""
    keys = ["preset", "model.moe"]
    for path, cls in SECTIONS.items():
        keys += _fields(cls, "".join(p + "." for p in path))
    return list(dict.fromkeys(keys))


MAX_YAML_VALUES = 100_000   # values a document may hold with every alias expanded


class StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last
    silently; a config file where `steps:` appears twice is a mistake, not a choice), and a
    document whose aliases expand to more than MAX_YAML_VALUES values or refer to themselves
    (a few hundred bytes of nested aliases stand for billions of values, which every later
    walk, comparison or message would expand)."""

    def compose_document(self):
        node = super().compose_document()
        _expanded_size(node, {}, set())
        return node

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=deep)
                try:
                    if key in first:
                        raise yaml.constructor.ConstructorError(
                            None, None, f"key {key!r} appears twice in one mapping (first on "
                            f"line {first[key] + 1})", key_node.start_mark)
                    first[key] = key_node.start_mark.line
                except TypeError:   # an unhashable key: the base class says what is wrong
                    break
        return super().construct_mapping(node, deep=deep)


def _expanded_size(node, sizes: dict, open_: set) -> int:
    """The number of values under `node` with every alias expanded (each node counted once per
    place it appears, memoized per node); yaml.YAMLError past MAX_YAML_VALUES or for a node
    inside itself."""
    if id(node) in sizes:
        return sizes[id(node)]
    if id(node) in open_:
        raise yaml.composer.ComposerError(None, None, "an alias refers to a value that holds "
                                          "it (a recursive alias)", node.start_mark)
    children = []
    if isinstance(node, yaml.SequenceNode):
        children = node.value
    elif isinstance(node, yaml.MappingNode):
        children = [n for kv in node.value for n in kv]
    open_.add(id(node))
    total = 1 + sum(_expanded_size(c, sizes, open_) for c in children)
    open_.discard(id(node))
    if total > MAX_YAML_VALUES:
        raise yaml.composer.ComposerError(None, None, f"its aliases expand to more than "
                                          f"{MAX_YAML_VALUES} values (nested aliases?)",
                                          node.start_mark)
    sizes[id(node)] = total
    return total


def parse_yaml(text: str) -> Any:
    """`text` as YAML through `StrictLoader` (raises yaml.YAMLError)."""
    return yaml.load(text, Loader=StrictLoader)  # noqa: S506 - a SafeLoader subclass


MAX_CONFIG_BYTES = 16 * 2 ** 20   # a config file larger than this is not one


def _check_regular(path: str) -> None:
    """ValueError naming `path` unless it is a regular file of at most MAX_CONFIG_BYTES (a FIFO
    would block the read forever, a device reads as anything)."""
    import os
    import stat
    try:
        st = os.stat(path)
    except OSError as e:
        raise ValueError(f"config file {path!r} cannot be read: {e.strerror or e}") from None
    if stat.S_ISDIR(st.st_mode):
        raise ValueError(f"config file {path!r} cannot be read: Is a directory")
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"config file {path!r} is not a regular file (a pipe or a device); "
                         "write the config to a file and pass that")
    if st.st_size > MAX_CONFIG_BYTES:
        raise ValueError(f"config file {path!r} holds {st.st_size} bytes, more than a config "
                         f"can ({MAX_CONFIG_BYTES}); is it the right file?")


def load_yaml(path: str) -> Any:
    """The YAML document in `path`. Raises ValueError (one line: file, line, column, problem)
    for a syntax error, a key given twice in one mapping, and a missing or unreadable file, or
    one that is not a regular file of at most MAX_CONFIG_BYTES."""
    _check_regular(path)
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"config file {path!r} cannot be read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"config file {path!r} is not UTF-8 text (byte {e.start})") from None
    try:
        return parse_yaml(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        context = getattr(e, "context", None)
        why = f"{context}, {problem}" if context else problem
        raise ValueError(f"config file {path}{where}: invalid YAML ({why})") from None


def flatten(d: dict, prefix: str = "") -> list[tuple[str, Any]]:
    """Nested plain data (a YAML file, a saved config.json) -> (dotted key, value) items:
    {"model": {"moe": {"top_k": 2}}} -> [("model.moe.top_k", 2)]."""
    out = []
    for k, v in d.items():
        if isinstance(v, dict):
            out += flatten(v, f"{prefix}{k}.")
        else:
            out.append((f"{prefix}{k}", v))
    return out


def parse_override(text: str) -> tuple[str, Any]:
    """'key=value' -> (key, YAML-parsed value). Raises ValueError without '=' and for a value
    that is not YAML."""
    if "=" not in text:
        raise ValueError(f"override {text!r} must look like key=value")
    key, value = text.split("=", 1)
    if not value.strip():
        return key.strip(), ""
    try:
        return key.strip(), parse_yaml(value)
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ValueError(f"override {text!r}: the value is not valid YAML ({problem}); quote "
                         "it for a string") from None


def _unknown(key: str) -> ValueError:
    candidates = known_keys() + list(maxtext.KNOWN) + ["xla_flags", "environment"]
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.5)
    if not close:  # try the last path component ("model.moe.topk" -> "top_k")
        tail = {c.split(".")[-1]: c for c in candidates}
        hits = difflib.get_close_matches(key.split(".")[-1], list(tail), n=1, cutoff=0.5)
        close = [tail[hits[0]]] if hits else []
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ValueError(f"unknown config key {key!r}{hint} (`dropless config keys` lists the keys)")


def _field_type(key: str) -> tuple[type, bool] | None:
    """(type, None allowed) of a dotted key's field; None for keys that are not a scalar field
    (`model.moe`, `xla_flags+`)."""
    *path, leaf = key.split(".")
    cls = SECTIONS.get(tuple(path))
    return None if cls is None else scalar_fields(cls).get(leaf)


def _coerce(key: str, value: Any) -> Any:
    """`value` as the type of `key`'s field (see the module docstring). Raises ValueError naming
    the key, the value and the type expected."""
    kind = _field_type(key)
    if kind is None:
        return value
    base, optional = kind
    if isinstance(value, str) and base is not str:
        word = value.strip().lower()
        if optional and word in ("none", "null"):
            return None
        if base is bool and word in ("true", "false"):
            return word == "true"
        if base is float:
            # YAML 1.1 (PyYAML) reads 3e-4 and 1e18, without a dot, as strings
            try:
                value = float(value)
            except ValueError:
                raise ValueError(f"config key {key!r}: {value!r} is not a number") from None
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    why = scalar_type_error(value, base, optional)
    if why:
        hint = (f" (quote it: {key}=\"'{value}'\" on the command line, '{value}' in YAML)"
                if base is str and isinstance(value, (int, float)) else "")
        raise ValueError(f"config key {key!r}: {value!r} {why}{hint}")
    return value


def resolve(*sources: Iterable[tuple[str, Any]],
            notes: list[str] | None = None) -> list[tuple[str, Any]]:
    """Settings as given, in `sources` (each a config file, a command line, a run's saved
    config...: (key, value) pairs in order, any spelling: ours or MaxText's) as TrainConfig's
    keys and values, in the same order: a later source wins. Within one source two names that
    set the same key must agree (`one_spelling`); there, MaxText's `xla_*` and environment keys
    add to our `xla_flags` / `environment` whatever their order. `notes` as in `build_config`.
    Raises ValueError naming a key that is unknown or gone, or two names that disagree."""
    sources = tuple(list(s) for s in sources)
    pairs = [pair for source in sources for pair in source]
    ours = set(known_keys())
    for k, v in pairs:
        if k == GONE_NODE_SIZE:
            raise ValueError(f"config key {k!r} ({v!r}) is gone: the node size follows from the "
                             "mesh; set how many nodes each axis spans with mesh.dcn_data, "
                             "mesh.dcn_fsdp, mesh.dcn_expert (MaxText dcn_*_parallelism)")
        if k not in ours and not maxtext.is_known(k):
            raise _unknown(k)
    mt_idx = [i for i, (k, v) in enumerate(pairs)
              if k not in ours or maxtext.spelled_as_maxtext(k, v)]
    groups = dict(zip(mt_idx, maxtext.translate_each([pairs[i] for i in mt_idx],
                                                          context=dict(pairs), notes=notes)))
    resolved: list[tuple[str, Any]] = []
    at = 0
    for source in sources:   # the user's order: a later item wins, whatever spelling
        said = [(pair, [(k, _coerce(k, v)) for k, v in groups.get(at + i, [pair])])
                for i, pair in enumerate(source)]
        at += len(source)
        one_spelling(said)
        got = [kv for _, kvs in said for kv in kvs]
        resolved += [kv for kv in got if not kv[0].endswith("+")]   # xla_flags, then its +
        resolved += [kv for kv in got if kv[0].endswith("+")]
    return [(k, _coerce(k, v)) for k, v in init_from_items(resolved)] + resolved


def _is_maxtexts(name: str) -> bool:
    """Whether `name` is one of MaxText's own names (not ours, nor our former flat mesh keys)."""
    return name in maxtext.KNOWN or maxtext.is_xla_flag(name) or maxtext.is_env_key(name)


def _settings_of(key: str, value: Any) -> list[tuple[str, Any]]:
    """(key, value) as the settings it makes: one XLA flag or environment variable a word for
    `xla_flags` / `environment` (and their `+` forms), keyed "xla_flags --name" /
    "environment NAME" (a later word of the same name wins, as `_add_word` applies them); any
    other key as itself."""
    field = key.rstrip("+")
    if field not in ("xla_flags", "environment") or not isinstance(value, str):
        return [(key, value)]
    words = {word.split("=", 1)[0]: word for word in value.split()}
    return [(f"{field} {name}", word) for name, word in words.items()]


def one_spelling(said: list[tuple[tuple[str, Any], list[tuple[str, Any]]]]) -> None:
    """Raise ValueError when two names of one source (`said`: each (name, value) given and the
    (key, value) pairs it sets, `resolve`'s) set one key to different values: our
    `mesh.expert=4` and MaxText's `ici_expert_parallelism=2`, `seq_len` and
    `max_target_length`, an XLA flag in `xla_flags` and as a MaxText `xla_*` key, in either
    order. The same name given twice (a command line's later `steps=`) and two of MaxText's
    own names (whose precedence is MaxText's, e.g. `n_routing_groups: -1` over
    `topk_routing_group`) are not refused: the later one wins."""
    setters: dict[str, list[tuple[str, Any, Any]]] = {}
    for (name, given), kvs in said:
        for key, value in (s for kv in kvs for s in _settings_of(*kv)):
            for other, other_given, other_value in setters.get(key, []):
                if (other != name and other_value != value
                        and not (_is_maxtexts(other) and _is_maxtexts(name))):
                    shown = key.split(" ")[0].rstrip("+")
                    raise ValueError(
                        f"{_said(other, other_given, shown, other_value)} and "
                        f"{_said(name, given, shown, value)} both set {shown} in one config "
                        "file or command line; keep one of them, or give both the same value")
            setters.setdefault(key, []).append((name, given, value))


def _said(name: str, given: Any, key: str, value: Any) -> str:
    """How a setting is named in an error: `key=value` in our spelling, else the name as given
    and what it sets ("MaxText ici_expert_parallelism=2 (mesh.expert=2)")."""
    if name == key:
        return f"{key}={value!r}"
    who = "MaxText " if _is_maxtexts(name) else ""
    if key in ("xla_flags", "environment"):
        return f"{who}{name}={given!r} ({key}: {value})"
    return f"{who}{name}={given!r} ({key}={value!r})"


def build_config(items: Iterable[tuple[str, Any]] = (), *, yaml_path: str | None = None,
                 notes: list[str] | None = None, mapping: dict | None = None,
                 defaults: Iterable[tuple[str, Any]] = ()) -> TrainConfig:
    """Preset (default 'tiny') <- defaults <- YAML file (or `mapping`, one already loaded) <-
    items, validated once at the end.

    `notes`, when given, receives one line per accepted key that changes nothing (see
    dropless.compat.maxtext); the caller prints them at start-up. Raises ValueError naming the
    key and value for anything wrong.
    """
    from_file: list[tuple[str, Any]] = []
    if yaml_path:
        loaded = load_yaml(yaml_path) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"config file {yaml_path!r} must hold a mapping of key: value")
        from_file = flatten(loaded)
    resolved = resolve(defaults, from_file, flatten(mapping or {}), items, notes=notes)
    preset = next((v for k, v in reversed(resolved) if k == "preset"), DEFAULT_PRESET)
    base = TrainConfig(model=get_preset(str(preset)), preset=str(preset))
    tree = to_dict(base)
    for key, value in RUN_SETTINGS.get(str(preset), {}).items():   # how the preset is trained
        _set(tree, key, value)
    for key, value in resolved:
        if key == "preset":
            continue
        if key == "model.moe" and value is not None:
            raise ValueError(f"config key 'model.moe' only takes null (a dense model); got {value!r}")
        if key.endswith("+"):   # one more XLA flag / environment variable
            tree[key[:-1]] = _add_word(str(tree[key[:-1]] or ""), value)
            continue
        _set(tree, key, value)
        if key == "model.d_model" and tree["model"]["moe"] is not None:
            _set(tree, "model.moe.d_model", value)
    _data_implies(tree, {k for k, _ in resolved}, notes)
    return from_dict(tree)


def _data_implies(tree: dict, keys: set[str], notes: list[str] | None) -> None:
    """The tokenizer as every command reads its name (`model_dir.resolve_tokenizer`: byte,
    hf:DIR, a folder, a tokenizer.json), and model.vocab_size raised to what the data needs
    (the larger of data's and eval_data's: a prepared dataset's manifest, else the tokenizer's
    vocabulary) when no key, YAML or init_from set it. A vocab_size that was set and is smaller
    than a prepared dataset's (data or eval_data) is refused here, in one line naming both; one
    smaller than the tokenizer's, where the data is read."""
    if tree.get("tokenizer"):
        tree["tokenizer"] = resolve_tokenizer(str(tree["tokenizer"]), name="tokenizer")
    sources = [("data", str(tree.get("data") or ""))]
    if tree.get("eval_data"):
        sources.append(("eval_data", str(tree["eval_data"])))
    have = tree["model"]["vocab_size"]
    if "model.vocab_size" in keys or tree.get("init_from"):
        for key, source in sources:
            prepared = prepared_vocab_size(source)
            if prepared is not None and prepared[0] > have:
                given = "model.vocab_size" in keys
                raise ValueError(
                    f"model.vocab_size={have}{'' if given else ' (init_from)'} is smaller than "
                    f"the vocabulary of {key}={source!r} (vocab_size={prepared[0]} in "
                    f"{prepared[1]}); " + (f"raise model.vocab_size to at least {prepared[0]}, "
                                           "or leave it unset" if given else
                                           "prepare the data with that model's tokenizer"))
        return
    needs = [n for _, source in sources
             if (n := data_vocab_size(source, str(tree.get("tokenizer") or ""))) is not None]
    need = max(needs, key=lambda n: n[0], default=None)
    if need is not None and need[0] > have:
        if notes is not None:
            notes.append(f"model.vocab_size={need[0]} (from {need[1]}; the preset's is "
                         f"{tree['model']['vocab_size']})")
        tree["model"]["vocab_size"] = need[0]


def init_from_items(pairs: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """The (key, value) items `init_from` implies, placed before the user's: the folder's model
    (as the preset) and tokenizer, where the user gave none (`model_dir.init_from_defaults`)."""
    spec = next((v for k, v in reversed(pairs) if k == "init_from"), "")
    if not spec:
        return []
    keys = {k for k, _ in pairs}
    preset, model, tok = init_from_defaults(spec, preset_given="preset" in keys,
                                            tokenizer_given="tokenizer" in keys)
    out: list[tuple[str, Any]] = [] if preset is None else [("preset", preset)]
    out += [] if model is None else flatten(upgrade({"model": model}))   # a flat-mesh-form folder too
    return out + ([] if tok is None else [("tokenizer", tok)])


def resume_items(run: str | Path) -> list[tuple[str, Any]]:
    """The (key, value) items that rebuild the config of the run in directory `run` (its
    config.json, in the current form, see `upgrade`), to go before the user's overrides: its
    preset, every saved key, `run_dir` / `run_name` naming `run` where it is now, the model.
    Raises ValueError (one line, see `model_dir.read_run_config`) when `run` is not a run."""
    run = Path(run)
    saved = upgrade(read_run_config(run))
    saved.update(run_dir=str(run.parent), run_name=run.name)
    model = saved.pop("model")
    preset = saved_preset(saved)
    saved.pop("preset", None)
    return [("preset", preset)] + flatten(saved) + flatten({"model": model})


def _add_word(text: str, word: str) -> str:
    """Append `--flag=v` / `NAME=v` to a space-separated list, replacing an earlier one of the
    same name."""
    name = word.split("=", 1)[0]
    kept = [w for w in text.split() if w.split("=", 1)[0] != name]
    return " ".join(kept + [word])


def _set(tree: dict, key: str, value: Any) -> None:
    *path, leaf = key.split(".")
    node = tree
    for p in path:
        if node.get(p) is None:
            raise ValueError(f"config key {key!r}: {'.'.join(path)} is not set in this model "
                             "(a dense model has no model.moe)")
        node = node[p]
    node[leaf] = value


def show(cfg: TrainConfig) -> str:
    """The effective config as YAML."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
