"""The configuration reference (`dropless.config_docs`, docs/config.md): every field of every
config section described once, in config.py; the committed docs equal to the generator's
output; defaults, types and MaxText names checked against the dataclasses and against
compat/maxtext.py's translation."""
import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from dropless import config_docs
from dropless.compat import maxtext
from dropless.config import DOC, described, scalar_fields
from dropless.config_file import SECTIONS, known_keys

DOCS = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def _rows(markdown: str) -> dict[str, dict[str, str]]:
    """key -> {type, default, description, maxtext} from the reference's tables."""
    rows = {}
    for line in markdown.splitlines():
        m = re.match(r"^\| `([^`]+)` \|", line)
        if not m:
            continue
        cells = [c.strip().replace("\\|", "|").replace("\\*", "*")
                 for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        assert m.group(1) not in rows, f"{m.group(1)} has two rows"
        rows[m.group(1)] = dict(zip(("key", "type", "default", "description", "maxtext"), cells))
    return rows


@pytest.fixture(scope="module")
def markdown() -> str:
    return config_docs.reference()


@pytest.fixture(scope="module")
def rows(markdown) -> dict[str, dict[str, str]]:
    return _rows(markdown)


def _maxtext_names(cell: str) -> dict[str, bool]:
    """MaxText cell -> {name: translated}."""
    return {m.group(1): bool(m.group(2))
            for m in re.finditer(r"`([^`]+)`( \(translated\))?", cell)}


@pytest.mark.parametrize("cls", list(SECTIONS.values()), ids=lambda c: c.__name__)
def test_every_field_has_a_one_line_description(cls):
    for f in dataclasses.fields(cls):
        doc = f.metadata.get(DOC, "")
        assert isinstance(doc, str) and doc.strip() and "\n" not in doc, (
            f"{cls.__name__}.{f.name} needs a one-line description: "
            f"described(..., doc=\"...\") in src/dropless/config/")
        assert config_docs.field_doc(cls, f) == doc.strip()


def test_a_field_without_description_is_refused_naming_it():
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Bare:
        steps: int = described(1, doc="steps")
        fresh: int = 3

    with pytest.raises(ValueError, match=r"Bare\.fresh has no one-line description.*"
                                         r"dropless config reference > docs/config\.md"):
        config_docs.entries(Bare, names={})


def test_described_changes_no_behaviour():
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Plain:
        a: int
        b: float = 1.0

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Doc:
        a: int = described(doc="a")
        b: float = described(1.0, doc="b")

    for cls in (Plain, Doc):
        with pytest.raises(TypeError):
            cls(b=2.0)   # a is required
        with pytest.raises(TypeError):
            cls(1)       # keyword-only
        x = cls(a=1)
        assert (x.a, x.b) == (1, 1.0) and x == cls(a=1) and hash(x) == hash(cls(a=1))
        with pytest.raises(dataclasses.FrozenInstanceError):
            x.a = 2
        assert dataclasses.asdict(x) == {"a": 1, "b": 1.0}


def test_every_key_has_one_row_with_its_description(rows):
    assert set(rows) == set(known_keys())
    for path, cls in SECTIONS.items():
        prefix = config_docs.section_prefix(path)
        for f in dataclasses.fields(cls):
            if prefix + f.name in rows:
                assert rows[prefix + f.name]["description"] == f.metadata[DOC]


def test_each_section_is_described_by_its_field(markdown):
    """The fields that are sections (model, mesh, model.moe) are described above their table."""
    for path in SECTIONS:
        if not path:
            continue
        parent = SECTIONS[path[:-1]]
        field = next(f for f in dataclasses.fields(parent) if f.name == path[-1])
        heading = f"## `{'.'.join(path)}.*`"
        assert heading in markdown
        text = markdown.split(heading, 1)[1].split("| key |", 1)[0]
        assert field.metadata[DOC] in text


def test_defaults_and_types_are_the_dataclasses(rows):
    for path, cls in SECTIONS.items():
        prefix = config_docs.section_prefix(path)
        scalars = scalar_fields(cls)
        for f in dataclasses.fields(cls):
            row = rows.get(prefix + f.name)
            if row is None:
                continue
            if f.default is dataclasses.MISSING:
                assert row["default"] == "required", f.name
            else:
                shown = yaml.safe_load(row["default"].strip("`"))
                assert shown == f.default and type(shown) is type(f.default), (f.name, shown)
            if f.name in scalars:
                base, optional = scalars[f.name]
                assert row["type"] == base.__name__ + (" or null" if optional else ""), f.name
    assert rows["model.moe"]["type"] == "MoEConfig or null"
    assert rows["model.moe.capacity_factor"]["default"] == "`null`"
    assert rows["model.d_model"]["default"] == "required"


@pytest.mark.parametrize("name,key,translated", [
    ("base_emb_dim", "model.d_model", False),
    ("num_experts", "model.moe.num_experts", False),
    ("num_experts_per_tok", "model.moe.top_k", False),
    ("base_moe_mlp_dim", "model.moe.d_ff", False),
    ("dtype", "model.dtype", False),
    ("dtype", "model.moe.dtype", False),
    ("max_target_length", "seq_len", False),
    ("ici_expert_parallelism", "mesh.expert", True),
    ("dcn_expert_parallelism", "mesh.expert", True),
    ("dcn_expert_parallelism", "mesh.dcn_expert", True),
    ("remat_policy", "remat", True),
    ("capacity_factor", "model.moe.capacity_factor", True),
])
def test_known_maxtext_names(rows, name, key, translated):
    assert _maxtext_names(rows[key]["maxtext"]).get(name) is translated


def test_maxtext_names_are_what_compat_maxtext_translates(rows):
    """Every rename is listed, plain, at each key it sets; every name listed at a key sets
    that key when compat/maxtext.py translates it."""
    listed = {key: _maxtext_names(r["maxtext"]) for key, r in rows.items()}
    for name, keys in maxtext.RENAMES.items():
        for key in keys:
            assert listed[key].get(name) is False, (name, key)
    assert not listed["model.moe.ep_comm_overlap_chunks"]   # no MaxText name sets it
    assert "ici_data_parallelism" not in listed["mesh.dcn_data"]
    for key, names in listed.items():
        for name, translated in names.items():
            assert translated is (name not in maxtext.RENAMES)
            value = config_docs.PROBES.get(name, 2 if name.endswith("_parallelism") else "x")
            pairs = maxtext.translate([(name, value)])
            assert key in {k for k, _ in pairs}, (name, key, pairs)


def test_every_maxtext_rule_of_its_own_has_a_probe():
    """A name compat/maxtext.py translates by a rule of its own needs a PROBES value, or the
    reference could not say which key it sets."""
    mesh = set(maxtext.ICI) | set(maxtext.DCN)
    assert set(config_docs.PROBES) == set(maxtext.SPECIAL) - mesh, (
        "keep config_docs.PROBES to one value per compat.maxtext.SPECIAL name (mesh names "
        "apart)")


def test_the_committed_reference_is_current(markdown):
    assert DOCS.read_text() == markdown, (
        "docs/config.md is stale: regenerate it with `dropless config reference > "
        "docs/config.md` (from the repository root)")


def test_the_worked_example_is_what_config_show_prints(tmp_path, capsys, monkeypatch):
    """The introduction's example, run as the command it shows."""
    from dropless.cli import main
    from dropless.config_file import flatten
    yaml_text, command, values = config_docs.example()
    assert f"```yaml\n{yaml_text.rstrip()}\n```" in config_docs.introduction()
    (tmp_path / "run.yaml").write_text(yaml_text)
    monkeypatch.chdir(tmp_path)
    argv = command.split()
    assert argv[:3] == ["dropless", "config", "show"]
    assert main(argv[1:]) == 0
    shown = dict(flatten(yaml.safe_load(capsys.readouterr().out)))
    expected = yaml.safe_load(values)
    assert expected == {k: shown[k] for k in expected}
    assert expected["model.moe.top_k"] == 2 and expected["mesh.fsdp"] == 2
