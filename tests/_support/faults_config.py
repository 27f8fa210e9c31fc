"""Fault rows: config values refused in one line naming the key, the value and what was expected
(strict booleans, strict types, no duplicate YAML keys), before anything is computed. Every row
runs in-process (the refusal comes before any JAX computation)."""
from pathlib import Path

from tests._support.fault import Fault


def _yaml(text: str):
    def setup(case: Path, _artifacts) -> None:
        (case / "c.yaml").write_text(text)
    return setup


def _bomb(levels: int) -> str:
    """A few hundred bytes of YAML whose nested aliases stand for 9**levels strings."""
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def _short_line(limit: int):
    def check(_case: Path, res) -> None:
        line = res.err.splitlines()[0]
        assert len(line) <= limit + 80, f"an error line of {len(line)} characters"
    return check


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
    # bounded work and bounded messages for any input
    show("config-yaml-alias-bomb", ["--config", "c.yaml"],
         ("c.yaml", "aliases expand to more than"), setup=_yaml(_bomb(9)),
         unchanged=("c.yaml",), timeout=30, check=_short_line(400)),
    show("config-yaml-alias-recursive", ["--config", "c.yaml"], ("c.yaml", "recursive alias"),
         setup=_yaml("steps: &a [1, *a]\n")),
    show("config-override-alias-bomb", [f"steps={{a: &a [1,1,1,1,1,1,1,1,1,1], b: &b "
                                        f"[{','.join(['*a'] * 10)}], c: &c "
                                        f"[{','.join(['*b'] * 10)}], d: &d "
                                        f"[{','.join(['*c'] * 10)}], e: [{','.join(['*d'] * 20)}]}}"],
         ("steps=", "aliases expand to more than"), check=_short_line(400)),
    show("config-huge-value-cut", ["steps=[" + ",".join(["7"] * 20000) + "]"],
         ("steps", "characters cut", "must be an int"), check=_short_line(400)),
    show("config-huge-unknown-key", ["x" * 50000 + "=1"], ("unknown", "characters cut"),
         check=_short_line(400)),
    show("config-yaml-bomb-as-key-value", ["--config", "c.yaml"], ("c.yaml", "aliases"),
         setup=_yaml("a: &a [x, x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a,"
                     " *a, *a, *a]\nc: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c,"
                     " *c, *c, *c, *c, *c, *c, *c, *c]\nsteps: [*d, *d, *d, *d, *d, *d, *d, *d, *d,"
                     " *d, *d]\n")),
]
