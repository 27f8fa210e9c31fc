"""`dropless plan --compile-for h100`: the planned step compiled for a compile-only H100 (the jax
CUDA plugin; train/compile_only.py) prints the bytes the trainer's pre-flight finds
(`train.preflight.check(run, target="h100")` on the run the test builds itself, the reference),
under the planner's own estimate; a config that cannot fit is refused in one line naming the
model, the sizes and what to change (exit 2); a plan over several nodes (mesh.dcn_* > 1) is
refused before any compile (a mesh on one host: tests/train/test_preflight_mesh_gpu_compile.py).
deepseek3-test at sequence 256 keeps the two compiles to seconds each (the deepseek3-1gpu
preset's fit on both devices is tests/train/test_preflight_gpu_compile.py).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json

import pytest

from dropless.cli import main
from dropless.cli.plan import add_arguments, settings
from dropless.plan.from_train import build_plan
from dropless.train import preflight
from tests._support import cuda_compile

cuda_compile.require_plugin()

ARGV = ["--preset", "deepseek3-test", "--hardware", "h100", "--seq", "256"]


def _gib(b: float) -> str:
    return f"{b / 2 ** 30:.2f} GiB"


@pytest.fixture(scope="module", autouse=True)
def shared_compiles():
    """The CLI's compile and the reference's, of the same run: once (a CLI that built another
    run than `build_plan` gives the reference compiles anew, and the figures differ)."""
    with cuda_compile.compiled_once() as done:
        yield done


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> tuple[int, str, dict]:
    """One `dropless plan ... --compile-for h100`: its status, its text and its --out JSON."""
    out = tmp_path_factory.mktemp("plan") / "plan.json"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["plan", *ARGV, "--compile-for", "h100", "--out", str(out)])
    return rc, buf.getvalue(), json.loads(out.read_text())


def test_plan_prints_the_preflight_compiled_bytes(planned, shared_compiles):
    rc, text, result = planned
    assert rc == 0
    p = argparse.ArgumentParser()
    add_arguments(p)
    run = build_plan(settings(p.parse_args(ARGV))).plan.run
    assert run.seq_len == 256 and run.mesh.num_devices == 1
    ref = preflight.check(run, target="h100")          # the reference
    # the CLI compiled the very run the test built (one compile for both: an equal config)
    assert [cfg for cfg, _ in shared_compiles] == [run]
    got = result["compiled_memory"]
    assert got["method"] == ref["method"] == "compiled" and got["target"] == "h100"
    for key in ("arguments", "outputs", "aliased", "temp", "code", "total"):
        assert got["compiled"][key] == ref["compiled"][key], key
    assert got["total"] == ref["total"] and got["limit"] == ref["limit"]
    lines = text.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith("  verdict:"))
    planner = result["memory"]["total"]                 # the planner's own figure, above it
    assert f"{planner / 2 ** 30:.1f} GiB" in lines[at]
    line = lines[at + 1]
    assert line.startswith(f"  compiled for h100 (jax {got['jax']}): {_gib(ref['total'])} per "
                           f"device of {_gib(ref['limit'])} ({ref['source']})")
    assert line.endswith("by the compiled step's memory analysis")


def test_a_config_that_cannot_fit_is_refused_in_one_line(capsys):
    # sequence 32768, batch 16, no remat: the trainer's attention holds B x H x S x S float32
    # scores, 16 x 4 x 32768^2 x 4 bytes = 256 GiB, past the H200's 129.2 usable (the larger
    # device; the H100 refuses a mesh's shard of it in test_preflight_mesh_gpu_compile.py)
    argv = ["--preset", "deepseek3-test", "--hardware", "h200", "--seq", "32768",
            "--per-device-batch", "16", "--remat", "none", "--compile-for", "h200"]
    assert main(["plan", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith("dropless: error: --compile-for h200: deepseek3-test: "
                          "per_device_batch_size=16 x seq_len=32768 (remat=none) does not fit: ")
    assert "by the compiled step" in err and "GiB available" in err
    assert "Lower seq_len or per_device_batch_size" in err


def test_a_plan_over_several_nodes_is_refused_before_compiling(capsys):
    # the compile-only devices are one host's (topology 1x1xN): a mesh with dcn_* > 1 is not
    assert main(["plan", "--preset", "deepseek3-test", "--gpus", "16", "--data", "2", "--fsdp",
                 "8", "mesh.dcn_data=2", "--compile-for", "h200"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (
        "dropless: error: --compile-for h200: deepseek3-test: the compile-only pre-flight "
        "compiles a mesh on one host; this one spans 2 nodes (mesh.dcn_data x mesh.dcn_fsdp x "
        "mesh.dcn_expert = 2 x 1 x 1): set the dcn_* sizes to 1 to check one node's layout\n")


def test_a_plan_over_more_gpus_than_a_host_has_is_refused_before_compiling(capsys):
    # 16 H100s planned as 2 nodes of 8 (the planner's node size) with no dcn_* axis: not
    # compiled as one host of 16 (nor a cluster as one host of thousands)
    assert main(["plan", "--preset", "deepseek3-test", "--hardware", "h100", "--gpus", "16",
                 "--compile-for", "h100"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (
        "dropless: error: --compile-for h100: deepseek3-test: the compile-only pre-flight "
        "compiles a mesh on one host of at most 8 GPUs; this one has 16 (mesh.data x mesh.fsdp "
        "x mesh.expert = 16 x 1 x 1): check one node's layout (--gpus 8 or fewer)\n")


def test_with_the_preflight_switched_off_the_line_says_nothing_was_compiled(capsys,
                                                                           monkeypatch):
    monkeypatch.setenv("DROPLESS_NO_PREFLIGHT", "1")
    assert main(["plan", *ARGV, "--compile-for", "h200"]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith("  verdict:"))
    assert lines[at + 1] == ("  not compiled for h200: DROPLESS_NO_PREFLIGHT=1 skips the "
                             "check")
