"""Fault rows: config values refused in one line naming the key, the value and what was expected
(strict booleans, strict types, no duplicate YAML keys), before anything is computed. Every row
runs in-process (the refusal comes before any JAX computation)."""
from pathlib import Path

from tests._support.fault import Fault


def _yaml(text: str):
    def setup(case: Path, _artifacts) -> None:
        (case / "c.yaml").write_text(text)
    return setup


def show(id_, overrides, words, **kw):
    return Fault(id_, ["config", "show", *overrides], rc=2, words=words, in_process=True, **kw)


def train(id_, overrides, words, **kw):
    return Fault(id_, ["train", "steps=1", "time_kernels=false", "run_dir=runs", *overrides],
                 rc=2, words=words, in_process=True, unchanged=("runs",), **kw)


ROWS = [
    show("config-yaml-duplicate-key", ["--config", "c.yaml"],
         ("c.yaml", ":3:", "'steps'", "twice", "line 1"),
         setup=_yaml("steps: 2\nseq_len: 64\nsteps: 3\n"), unchanged=("c.yaml",)),
    show("config-yaml-duplicate-nested-key", ["--config", "c.yaml"],
         ("c.yaml", "'d_model'", "twice"),
         setup=_yaml("model:\n  d_model: 64\n  num_layers: 2\n  d_model: 32\n")),
    show("config-bool-maybe", ["async_checkpoints=maybe"],
         ("async_checkpoints", "'maybe'", "true or false")),
    show("config-bool-int", ["model.tie_embeddings=2"],
         ("model.tie_embeddings", "2", "true or false")),
    show("config-bool-yaml-int", ["--config", "c.yaml"], ("check_nan", "1", "true or false"),
         setup=_yaml("check_nan: 1\n")),
    show("config-float-list", ["learning_rate=[0.1]"], ("learning_rate", "[0.1]", "number")),
    show("config-float-nan", ["weight_decay=nan"], ("weight_decay", "nan", "finite")),
    show("config-str-int", ["run_name=2024"], ("run_name", "2024", "string")),
    show("config-str-null", ["tokenizer=null"], ("tokenizer", "None", "string")),
    show("config-int-float", ["steps=2.5"], ("steps", "2.5", "int")),
    show("config-int-string", ["model.moe.top_k=two"], ("model.moe.top_k", "'two'", "int")),
    show("config-nested-dict-for-value", ["seq_len={a: 1}"], ("seq_len", "{'a': 1}", "int")),
    show("config-override-not-yaml", ["steps=[1"], ("steps=[1", "yaml")),
    show("config-preset-int", ["preset=7"], ("preset", "7", "string")),
    train("config-train-data-int", ["data=123"], ("data", "123", "string")),
    train("config-train-init-from-int", ["init_from=5"], ("init_from", "5", "string")),
    train("config-train-option-after-override", ["--preset", "tiny", "run_name=z"],
          ("--preset", "before")),
    show("config-show-option-after-override", ["steps=3", "--config", "c.yaml", "seq_len=8"],
         ("--config", "before"), setup=_yaml("steps: 2\n")),
]
