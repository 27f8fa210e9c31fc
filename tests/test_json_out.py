"""JSON the command line writes holds no NaN/Infinity token: json_out against
Python's own parser with NaN refused, and the plan / bench / config show outputs."""
import json
import math

import pytest
import yaml

from dropless import json_out


def strict_loads(text: str):
    """json.loads that refuses NaN, Infinity and -Infinity, as RFC 8259 parsers do."""
    def refuse(token):
        raise AssertionError(f"non-JSON token {token}")
    return json.loads(text, parse_constant=refuse)


def test_nonfinite_become_null_with_a_reason():
    import numpy as np
    rec = {"loss": float("nan"), "ok": 1.5, "curve": [1.0, float("inf"), 2.0],
           "nested": {"x": -math.inf, "n": 3}, "f32": np.float32("nan"), "s": "nan"}
    got = strict_loads(json_out.dumps(rec))
    assert got == {"loss": None, "loss_nonfinite": "nan", "ok": 1.5,
                   "curve": [1.0, None, 2.0], "curve_nonfinite": "[1]: inf",
                   "nested": {"x": None, "x_nonfinite": "-inf", "n": 3},
                   "f32": None, "f32_nonfinite": "nan", "s": "nan"}
    with pytest.raises(AssertionError):   # the reference parser does refuse Python's default
        strict_loads(json.dumps(rec["loss"]))


def test_bench_json_lines(tmp_path):
    from dropless.bench import harness
    out = tmp_path / "b.jsonl"
    harness.write_jsonl(str(out), [{"median_ms": float("nan"), "rows": 4}])
    assert strict_loads(out.read_text()) == {"median_ms": None, "median_ms_nonfinite": "nan",
                                             "rows": 4}


@pytest.mark.parametrize("argv", [
    ["plan", "--preset", "tiny", "--json"],
    ["plan", "--preset", "deepseek3-test", "--json", "--suggest", "--top", "3"],
    ["plan", "--json", "--sweep-gpus", "8,16", "--ep", "8"]])
def test_plan_json_is_strict_json(argv, capsys, tmp_path):
    from dropless.cli import main
    assert main(argv + ["--out", str(tmp_path / "p.json")]) == 0
    printed = strict_loads(capsys.readouterr().out)
    assert printed == strict_loads((tmp_path / "p.json").read_text())


def test_config_show_has_only_finite_numbers(capsys):
    from dropless.cli import main
    assert main(["config", "show", "--preset", "deepseek3-test"]) == 0
    doc = yaml.safe_load("\n".join(l for l in capsys.readouterr().out.splitlines()
                                   if not l.startswith("#")))

    def numbers(x):
        if isinstance(x, dict):
            for v in x.values():
                yield from numbers(v)
        elif isinstance(x, float):
            yield x
    assert all(math.isfinite(v) for v in numbers(doc))
    assert main(["config", "show", "weight_decay=inf"]) == 2   # a non-finite value is refused


def test_restore_inverts_finite_for_scalars_lists_and_nested_objects():


    obj = {"loss": math.nan, "l": [1.0, math.inf, [2.0, -math.inf]], "d": {"x": math.nan},
           "ok": 1, "none": None}
    back = json_out.restore(json.loads(json_out.dumps(obj)))
    assert set(back) == set(obj) and back["ok"] == 1 and back["none"] is None
    assert math.isnan(back["loss"]) and math.isnan(back["d"]["x"])
    assert back["l"][:1] == [1.0] and back["l"][1] == math.inf and back["l"][2] == [2.0, -math.inf]
    plain = {"a": None, "a_nonfinite": 3}      # not one `finite` wrote: left as it is
    assert json_out.restore(plain) == plain
