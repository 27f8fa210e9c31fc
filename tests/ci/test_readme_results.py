"""The README's performance section is what benchmarks/readme_results.py prints from the
committed result files: no number in it is typed by hand."""
import importlib.util

import pytest

from tests._support.paths import ROOT


def _script():
    spec = importlib.util.spec_from_file_location("readme_results",
                                                  ROOT / "benchmarks/readme_results.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_readme_results_block_is_the_scripts_output():
    script = _script()
    block = script.readme_block((ROOT / "README.md").read_text())
    assert block == script.section(), (
        "README.md's results block is stale: run python benchmarks/readme_results.py --write")


@pytest.mark.parametrize("index", [0, 1])
def test_the_tables_come_from_the_records(index):
    script = _script()
    name = script.CPU_FILES[index]
    recs = script._load(name)
    r = next(x for x in recs if x.get("variant") == "dropless/auto" and x["mode"] == "fwd+bwd"
             and x["experts"] == 8 and x.get("dtype", "float32") == "float32")
    t = next(x for x in recs if x.get("variant") == "torch/hf_mixtral"
             and x["mode"] == "fwd+bwd" and x["experts"] == 8
             and x.get("dtype", "float32") == "float32")
    row = (f"| 4096:8:2 (F=1024) | float32 | fwd+bwd | {r['median_ms']:.1f} | "
           f"{t['median_ms']:.1f} | ")
    assert row in script.cpu_section(recs, name)
    edited = [dict(x, median_ms=x["median_ms"] * 2) if x is r else x for x in recs]
    assert row not in script.cpu_section(edited, name)


def test_the_results_readme_tables_are_summarize_output():
    spec = importlib.util.spec_from_file_location("summarize", ROOT / "benchmarks/summarize.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    results = ROOT / "benchmarks/results"
    assert mod.tables(results).strip() in (results / "README.md").read_text(), (
        "benchmarks/results/README.md's tables are stale: paste python benchmarks/summarize.py")
