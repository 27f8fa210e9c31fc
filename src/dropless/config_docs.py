"""The configuration reference (docs/config.md), generated from the config dataclasses.

For every key a user sets (`steps`, `mesh.fsdp`, `model.d_model`, `model.moe.top_k`, as
`config_file.known_keys` spells them): its type, its default (the dataclass's), its one-line
description (the field's `config.DOC` metadata, written once, in config.py) and the MaxText names
that `compat.maxtext` translates to it, learnt by running its translators. `reference()` returns
the markdown; `dropless config reference` prints it, and tests/test_config_docs.py holds
docs/config.md equal to it. The worked example in the introduction is built by `build_config`
each time the reference is made, so the values it shows are what the code gives.

Layer: 8, beside `config_file` (its sections, keys and `build_config`).
"""
from __future__ import annotations

import dataclasses
import typing
from typing import Any

import yaml

from dropless.compat import maxtext
from dropless.config import DOC
from dropless.config_file import (DEFAULT_PRESET, SECTIONS, build_config, flatten, known_keys,
                                  parse_override, parse_yaml)
from dropless.model_dir import to_dict
from dropless.presets import PRESETS

REGENERATE = "dropless config reference > docs/config.md"
REQUIRED = "required"   # the default cell of a field without a default
TRANSLATED = " (translated)"   # after a MaxText name whose value is translated, not copied

# one value per MaxText name with rules of its own (compat.maxtext.SPECIAL), given to its
# translator to learn which of our keys it sets; the mesh names (ici_*, dcn_*) are read from
# compat.maxtext.ICI / DCN instead
PROBES: dict[str, Any] = {
    "sparse_matmul": True, "megablox": True, "use_tokamax_gmm": True,
    "te_gmm_quantization": "te_mxfp8", "capacity_factor": 1.0, "remat_policy": "full",
    "n_routing_groups": 8, "topk_routing_group": 4, "warmup_steps_fraction": 0.1,
    "learning_rate_schedule_steps": 1000,
    "attention_type": "mla", "decoder_block": "deepseek", "enable_checkpointing": False,
    "te_moe_block": True, "hardware": "gpu", "prefuse_moe_weights": True, "dataset_type": "hf",
    "hf_path": ".", "hf_data_dir": "", "hf_train_files": "train.jsonl",
    "grain_train_files": "train.jsonl", "hf_eval_files": "eval.jsonl", "train_split": "train",
    "eval_split": "validation", "packing": True, "add_bos": True, "add_eos": True,
    "tokenizer_path": "tokenizer.json", "grain_worker_count": 1, "base_num_kv_heads": 16,
    "routed_bias": False, "attention": "cudnn_flash_te", "max_segments_per_seq": 32,
}
PROBE_CONTEXT = {"hf_path": "."}   # what hf_data_dir needs beside it

# the worked example of the introduction: a YAML file, then overrides on the command line
EXAMPLE_YAML = """\
preset: deepseek3-test
steps: 200
mesh:
  expert: 4
model:
  moe:
    top_k: 4
"""
EXAMPLE_OVERRIDES = ("model.moe.top_k=2", "learning_rate=1e-3", "ici_fsdp_parallelism=2")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Entry:
    """One row of the reference: a key as the user writes it and what it is."""
    key: str
    type: str
    default: Any            # the dataclass default, or REQUIRED
    doc: str
    maxtext: tuple[tuple[str, bool], ...]   # (MaxText name, whether its value is translated)


def field_doc(cls: type, field: dataclasses.Field) -> str:
    """The one-line description of `cls`'s `field` (`config.described`). Raises ValueError
    naming the field when it has none, or one that is not a single line."""
    doc = field.metadata.get(DOC, "")
    if not isinstance(doc, str) or not doc.strip() or "\n" in doc:
        raise ValueError(f"{cls.__name__}.{field.name} has no one-line description: declare it "
                         f"with config.described(..., doc=\"...\") and run `{REGENERATE}`")
    return doc.strip()


def type_words(hint: Any) -> str:
    """A field's type as a user reads it: int, float, bool, str, a section's class name, with
    'or null' where None is allowed."""
    args = typing.get_args(hint)
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), hint) if args else hint
    return getattr(base, "__name__", str(base)) + (" or null" if optional else "")


def maxtext_names() -> dict[str, tuple[tuple[str, bool], ...]]:
    """Our key -> the MaxText names `compat.maxtext` translates to it, each with whether its
    value is translated (True) or copied (a rename). Learnt from the translators themselves:
    each name of `maxtext.KNOWN` is translated once (renames with any value, the rules of their
    own with their PROBES value); the mesh axes from `maxtext.ICI` / `DCN` (mesh.<axis> is
    ici x dcn, mesh.dcn_<axis> the dcn part). Raises KeyError for a MaxText name with a rule of
    its own and no PROBES value."""
    out: dict[str, list[tuple[str, bool]]] = {}
    for name in maxtext.KNOWN:
        if name in maxtext.ICI or name in maxtext.DCN:
            axis = maxtext.ICI.get(name) or maxtext.DCN[name]
            keys = [f"mesh.{axis}"] + ([f"mesh.dcn_{axis}"] if name in maxtext.DCN else [])
        else:
            special = name in maxtext.SPECIAL
            if special and name not in PROBES:
                raise KeyError(f"compat.maxtext translates {name!r} by a rule of its own: give "
                               "it a value in config_docs.PROBES")
            value = PROBES[name] if special else maxtext.NOOP_ONLY.get(name, object())
            pairs = maxtext.translate_each([(name, value)], context={**PROBE_CONTEXT, name: value},
                                           notes=[])[0]
            keys = [k for k, _ in pairs]
        for key in dict.fromkeys(keys):
            out.setdefault(key, []).append((name, name not in maxtext.RENAMES))
    return {k: tuple(v) for k, v in out.items()}


def section_prefix(path: tuple[str, ...]) -> str:
    """A section's key prefix: () -> "", ("model", "moe") -> "model.moe."."""
    return "".join(p + "." for p in path)


def entries(cls: type, prefix: str = "", *, names: dict | None = None) -> list[Entry]:
    """The reference's rows for config class `cls` whose keys start with `prefix` ("" for the
    top level, "model.moe." for the MoE layer): every field a key reaches (a nested section is a
    row only where it is a key itself, as `model.moe`, which takes null). Raises ValueError for
    a field without a description."""
    names = maxtext_names() if names is None else names
    keys = set(known_keys())
    hints = typing.get_type_hints(cls)
    rows = []
    for f in dataclasses.fields(cls):
        doc = field_doc(cls, f)
        key = prefix + f.name
        if key not in keys:
            continue
        default = REQUIRED if f.default is dataclasses.MISSING else f.default
        rows.append(Entry(key=key, type=type_words(hints[f.name]), default=default, doc=doc,
                          maxtext=names.get(key, ())))
    return rows


def value_text(value: Any) -> str:
    """`value` as YAML writes it on one line (true, null, 1.0e-06, '' ...)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10 ** 6)
    return text.removesuffix("\n").removesuffix("\n...").strip()


def _cell(text: str) -> str:
    """`text` safe in a table cell: `|` escaped, and `*` outside code spans (never emphasis)."""
    parts = text.replace("|", "\\|").split("`")
    return "`".join(p if i % 2 else p.replace("*", "\\*") for i, p in enumerate(parts))


def _maxtext_cell(names: tuple[tuple[str, bool], ...]) -> str:
    return ", ".join(f"`{n}`" + (TRANSLATED if translated else "") for n, translated in names)


def table(rows: list[Entry]) -> str:
    """Markdown table of `rows`: key, type, default, description, MaxText names."""
    lines = ["| key | type | default | description | MaxText |", "|---|---|---|---|---|"]
    for r in rows:
        default = REQUIRED if r.default is REQUIRED else f"`{_cell(value_text(r.default))}`"
        lines.append(f"| `{r.key}` | {r.type} | {default} | {_cell(r.doc)} | "
                     f"{_maxtext_cell(r.maxtext)} |")
    return "\n".join(lines)


def _first_paragraph(cls: type) -> str:
    return " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())


def _section_doc(path: tuple[str, ...]) -> str:
    """What the section is: the parent's field description, then the class docstring's first
    paragraph."""
    cls = SECTIONS[path]
    if not path:
        return f"`{cls.__name__}`: {_first_paragraph(cls)}"
    parent = SECTIONS[path[:-1]]
    field = next(f for f in dataclasses.fields(parent) if f.name == path[-1])
    doc = field_doc(parent, field)
    return f"`{cls.__name__}`, {doc}. {_first_paragraph(cls)}"


def example() -> tuple[str, str, str]:
    """The worked example: (YAML file, command line, the values it gives to the keys it sets,
    as flat YAML), the values computed by `build_config`."""
    mapping = parse_yaml(EXAMPLE_YAML)
    items = [parse_override(o) for o in EXAMPLE_OVERRIDES]
    cfg = dict(flatten(to_dict(build_config(items, mapping=mapping))))
    keys = ["preset", "steps", "learning_rate", "mesh.fsdp", "mesh.expert",
            "model.moe.top_k"]
    command = f"dropless config show --config run.yaml {' '.join(EXAMPLE_OVERRIDES)}"
    values = "\n".join(f"{k}: {value_text(cfg[k])}" for k in keys)
    return EXAMPLE_YAML, command, values


def introduction() -> str:
    """How keys are set: presets, YAML, overrides, MaxText names; the worked example."""
    yaml_text, command, values = example()
    presets = ", ".join(f"`{p}`" for p in PRESETS)
    return f"""\
A run's config is a `TrainConfig`, built from these sources, a later one winning:

1. a preset (`--preset NAME` or the key `preset`; `{DEFAULT_PRESET}` when none is named): a
   named model, which gives every `model.*` key; `hf:DIR` takes a Hugging Face folder's model.
   The presets: {presets}.
2. a YAML file (`--config FILE`): nested sections (`model:` / `moe:` / `top_k: 4`) or dotted
   keys (`model.moe.top_k: 4`);
3. `key=value` overrides on the command line, each value read as YAML
   (`model.moe.capacity_factor=null`, `run_name="'2024'"` for a string of digits).

MaxText's flag names are accepted wherever our keys are and translated (`compat/maxtext.py`),
as are its `xla_*` keys and environment keys (`XLA_*`, `NCCL_*`, ...). Within one file or one
command line, two names that set the same key (`mesh.expert=4` and `ici_expert_parallelism=2`,
`seq_len` and `max_target_length`, an XLA flag in `xla_flags` and as an `xla_*` key) must give
it the same value, in whatever order, or the config is refused naming both; there, MaxText's
`xla_*` and environment keys add to `xla_flags` / `environment`. A value must have its key's
type (booleans are true/false, ints are not floats); an unknown key is an error that suggests
the closest one. `dropless config show` prints the config a command would get
(`--maxtext`: in MaxText's flags), and `dropless config keys` lists every accepted name.

For example, with `run.yaml`:

```yaml
{yaml_text.rstrip()}
```

the command line wins over the file for `model.moe.top_k`, and the MaxText name
`ici_fsdp_parallelism` sets `mesh.fsdp`:

```console
$ {command}
```

gives, among the rest:

```yaml
{values}
```

In the tables below, the default is the dataclass's: a preset replaces the `model.*` ones, and
required keys come from it. The MaxText column names the MaxText keys that set a key; the
value of one marked "translated" is translated rather than copied (`compat/maxtext.py` says how:
`mesh.fsdp` is `ici_fsdp_parallelism` x `dcn_fsdp_parallelism`, `remat_policy`'s values map to
ours, ...)."""


def reference() -> str:
    """The configuration reference as markdown (docs/config.md): the introduction, then one
    table per section (top level, `mesh`, `model`, `model.moe`). Raises ValueError naming a
    config field without a description."""
    names = maxtext_names()
    parts = ["# Configuration reference",
             f"<!-- generated from src/dropless/config/ by `{REGENERATE}`: edit the field "
             "descriptions there, not this file -->",
             introduction()]
    for path, cls in SECTIONS.items():
        title = f"`{'.'.join(path)}.*`" if path else "Top-level keys"
        parts += [f"## {title}", _section_doc(path),
                  table(entries(cls, section_prefix(path), names=names))]
    return "\n\n".join(parts) + "\n"
