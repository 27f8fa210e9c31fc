"""`dropless plan` at the edges of its settings: a device count past what it plans, a node size
that cannot divide a huge one, and planner knobs of the wrong shape are one line naming the
setting (exit 2), before any work that grows with the device count; the divisor walk behind
node sizes and the layout search is that of a plain loop; MoE chunks that do not split a
device's tokens are refused as the trainer refuses them."""
from __future__ import annotations

import re
import time

import pytest

from dropless.cli import main
from dropless.machine import get_profile
from dropless.plan.from_train import build_plan
from dropless.plan.layout import MAX_DEVICES, divisors
from dropless.plan.model import predict


@pytest.mark.parametrize("n", [1, 2, 3, 12, 16, 36, 97, 720, 1024])
def test_divisors_are_those_of_a_plain_loop(n):
    assert list(divisors(n)) == [d for d in range(1, n + 1) if n % d == 0]


@pytest.mark.parametrize("argv,message", [
    # these walked every number up to the device count (minutes, or never ending)
    (["--gpus", "1000000007", "--devices-per-node", "3"],
     r"PlanConfig.run.mesh=\(1000000007, 1, 1\) has 1000000007 devices \(gpus\), more than the "
     r"planner plans \(1048576, 2\*\*20\); plan fewer GPUs"),
    (["mesh.fsdp=2000000000000", "mesh.dcn_fsdp=2"], "has 2000000000000 devices"),
    (["--sweep-gpus", "8,100000000000"],
     r"--sweep-gpus '8,100000000000': 100000000000 is more GPUs than the planner plans"),
    (["offload=3"], "planner key 'offload': 3 must be a comma-separated string or a list"),
    # a sweep of a hundred thousand sizes fits on a command line: a plan each, an hour
    (["--sweep-gpus", ",".join(["8"] * 1001)],
     r"--sweep-gpus names 1001 cluster sizes, more than a sweep plans \(1000"),
])
def test_a_bad_setting_is_one_line_at_once(argv, message, capsys):
    t0 = time.perf_counter()
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert time.perf_counter() - t0 < 5
    assert err.startswith("dropless: error: ") and err.count("\n") == 1
    assert re.search(message, err), err


def test_the_largest_planned_cluster_plans_and_a_prime_node_limit_is_named():
    assert build_plan([("gpus", MAX_DEVICES)]).plan.mesh.num_devices == MAX_DEVICES
    with pytest.raises(ValueError, match=r"the largest below 1000: 825\)"):
        build_plan([("gpus", MAX_DEVICES - 1), ("devices_per_node", 1000)])


def test_a_config_file_key_that_is_not_a_string_is_an_unknown_key(tmp_path):
    p = tmp_path / "run.yml"
    p.write_text("1: 2\n")   # was AttributeError: 'int' object has no attribute 'startswith'
    with pytest.raises(ValueError, match="unknown config key '1'"):
        build_plan(config_path=str(p))


def test_overlap_chunks_that_do_not_split_a_devices_tokens_are_refused_as_the_trainer_does():
    # more chunks than tokens was a ZeroDivisionError; 3 chunks of 4096 tokens planned silently
    # a run the trainer refuses (moe/dispatch/overlap.chunk_tokens)
    for k in (3, 10 ** 6):
        with pytest.raises(ValueError, match=rf"PlanConfig.run.model.moe.ep_comm_overlap_chunks="
                                             rf"{k} does not divide the 4096 tokens a device"):
            build_plan([("mesh.expert", 8), ("model.moe.ep_comm_overlap_chunks", k)])
    assert build_plan([("mesh.expert", 8), ("model.moe.ep_comm_overlap_chunks", 4)])
    # one device: the trainer runs no mesh, so no chunks (parallel.mesh.train_mesh)
    one = build_plan([("model.moe.ep_comm_overlap_chunks", 10 ** 6)]).plan
    assert one.ep_chunks == 1 and predict(one, get_profile("h200"))["time"]["step_s"] > 0
