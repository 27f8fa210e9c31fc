"""`train --profile-steps` (train/profile.py): which steps are traced for any run length, and the
per-kernel table written from the trace, checked on a CPU trace against the trace reader
(`runtime.kernel_table`) and on hand-made rows."""
from __future__ import annotations

import json

import pytest

from dropless.cli import main as cli_main
from dropless.runtime.kernel_table import GROUPS, kernel_table
from dropless.train import profile
from tests._support.train_mini import MINI, corpus


@pytest.mark.parametrize("start,end,steps,want", [
    (0, 10, 3, range(2, 5)),     # steps 3-5: after the compile's step and the one after it
    (0, 10, 20, range(2, 10)),   # more than the run has: to the end
    (0, 3, 2, range(2, 3)),
    (0, 2, 2, range(1, 2)),      # two steps: the second (this once raised "No profile started")
    (0, 1, 5, range(0, 1)),      # one step: that one
    (5, 6, 1, range(5, 6)),      # a resumed run's one step
    (5, 9, 2, range(7, 9)),
    (0, 10, 0, range(0)),        # off
    (4, 4, 2, range(0)),         # nothing to run
])
def test_window(start, end, steps, want):
    got = profile.window(start, end, steps)
    assert got == want
    assert not got or (start <= got.start and got.stop <= end and len(got) <= steps)


def test_table_records_sum_kernels_into_every_group():
    rows = [{"name": "gemm_a", "count": 4, "total_us": 60.0, "share": 0.6, "group": "moe_gmm"},
            {"name": "sdpa", "count": 2, "total_us": 30.0, "share": 0.3, "group": "attention"},
            {"name": "gemm_b", "count": 2, "total_us": 10.0, "share": 0.1, "group": "moe_gmm"}]
    recs = profile.table_records(rows, steps=2)
    kernels = [r for r in recs if r["event"] == "kernel"]
    groups = [r for r in recs if r["event"] == "group"]
    assert [k["name"] for k in kernels] == ["gemm_a", "sdpa", "gemm_b"]
    assert kernels[0]["us_per_step"] == 30.0
    assert [(g["group"], g["total_us"]) for g in groups[:2]] == [("moe_gmm", 70.0),
                                                               ("attention", 30.0)]
    assert {g["group"] for g in groups} == set(GROUPS)       # the empty ones at 0
    assert [g["share"] for g in groups[:2]] == pytest.approx([0.7, 0.3])
    assert profile.group_line(groups) == "moe_gmm 70.0%, attention 30.0%"


@pytest.fixture(scope="module")
def profiled_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("profiled")
    items = dict(MINI, data=str(corpus(tmp)), run_dir=str(tmp / "runs"), run_name="p",
                 steps=2, checkpoint_every=0, eval_every=10)
    status = cli_main(["train", "--profile-steps", "2",
                       *(f"{k}={v}" for k, v in items.items())])
    return status, tmp / "runs" / "p"


def test_two_steps_profile_two_gives_a_trace_and_its_table(profiled_run):
    status, run = profiled_run
    assert status == 0
    recs = [json.loads(ln) for ln in (run / profile.TABLE).read_text().splitlines()]
    kernels = [r for r in recs if r["event"] == "kernel"]
    groups = [r for r in recs if r["event"] == "group"]
    # the table is the trace reader's rows of the run's trace, one traced step (step 2)
    rows = kernel_table(run / "profile")
    assert [(k["name"], k["count"], k["group"]) for k in kernels] == [
        (r["name"], r["count"], r["group"]) for r in rows]
    assert [k["total_us"] for k in kernels] == pytest.approx([r["total_us"] for r in rows])
    assert kernels and sum(k["share"] for k in kernels) == pytest.approx(1.0)
    assert [g["group"] for g in groups] == sorted(GROUPS, key=lambda g: -sum(
        k["total_us"] for k in kernels if k["group"] == g))
    assert sum(g["share"] for g in groups) == pytest.approx(1.0)
    assert {k["group"] for k in kernels} <= set(GROUPS)
    # the per-step records keep their throughput and MFU
    steps = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()
             if '"event": "step"' in ln]
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["tflops_per_device"] > 0 and "mfu" in s for s in steps)
