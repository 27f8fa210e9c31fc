"""`dropless bench gpu`, the device check, run on CPU before any GPU sees it:
the dry run goes through every section end to end (the gmm section's backends against the
same-run dense matmul, the MoE layer and its per-kernel table, the autotune recording that
tokamax is absent here), with a stand-in tokamax that fails to compile (moe) and one that
fails when it runs (train): both fall back, and the records name the backend that ran; a
section that raises, crashes or hangs is recorded and the next one runs; a measurement that
fails is recorded and the next one runs; the runner, signalled, kills the hung section's process
group; every measurement is a JSON line with a progress line; the plan fits run.sh's 575 s on
one H200 with a 25% margin under each cap, the targets (DeepSeek-V3 and Qwen3 per-device shapes,
fwd+bwd) first; the maxtext section runs MaxText beside the train section where .maxtext/ is
here, and records a skip where it is not (CI).

No speed is asserted (nothing here runs on a GPU); the sections' processes are real.
"""
import argparse
import dataclasses
import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from dropless.bench import gpu as bench_gpu
from dropless.bench import gpu_plan as plan
from dropless.cli import bench as bench_cli
from tests._support.paths import ROOT


def _args(**kw) -> bench_gpu.GpuOptions:
    return bench_gpu.GpuOptions(**kw)


def _cli_options(argv: list[str]) -> bench_gpu.GpuOptions:
    """What `dropless bench gpu ARGV` hands bench/gpu.py's `run`."""
    kind = bench_cli.KINDS["gpu"]
    parser = argparse.ArgumentParser()
    kind.add_arguments(parser)
    return kind.options(parser.parse_args(argv))


def _records(out: Path) -> list[dict]:
    return [json.loads(ln) for ln in (out / "gpu_bench.jsonl").read_text().splitlines()]


def _ends(recs: list[dict]) -> dict:
    return {r["section"]: r for r in recs if r.get("event") == "section_end"}


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """One dry run of every section, with one measurement made to fail (ragged_dot in gmm), a
    stand-in tokamax that fails to compile in moe and one that fails when it runs in train."""
    out = tmp_path_factory.mktemp("gpu_dry")
    mp = pytest.MonkeyPatch()
    mp.setenv("XLA_FLAGS", "")       # the section processes on one CPU device: faster compiles
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            rc = bench_gpu.run(_args(dry_run=True, out_dir=str(out), shapes=("dry/G2",),
                                     routings=("uniform",), train_dir=str(out / "train"),
                                     # a variant of the preset, as --train-set gives one
                                     train_set=(("model.scan_layers", True),),
                                     caps={"moe": 65},   # plans moe's fwd out
                                     faults={"gmm:ragged_dot": "raise",
                                             "moe:tokamax": "compile",
                                             "train:tokamax": "run"}))
    finally:
        mp.undo()
    return rc, out, _records(out), buf.getvalue()


def test_dry_run_runs_every_section_end_to_end(dry_run):
    rc, out, recs, _ = dry_run
    ends = _ends(recs)
    assert rc == 0 and list(ends) == list(plan.SECTIONS)
    assert all(e["status"] == "ok" for e in ends.values()), ends
    by = {}
    for r in recs:
        if r.get("event") not in ("section_start", "section_end"):
            by.setdefault(r["section"], []).append(r)
    info = by["info"][0]
    assert info["auto_on_this_platform"] == "native" and info["device_kind"] == "cpu"
    assert info["attention_kernel_1gpu"] == "xla"
    assert "needs an NVIDIA GPU" in info["cudnn_attention_problem"]
    assert "needs an NVIDIA GPU" in info["cudnn_thd_problem"]
    # no CUDA here: the versions are recorded as absent, not guessed
    assert info["cudnn_jax"] is None and info["cudnn_torch"] is None
    if os.environ.get("DROPLESS_GPU_LEG") == "required":   # .ci/jax_leg installs its jax's
        assert info["jax_cuda_plugin"] == f"jax-cuda13-plugin {info['jax']}"   # CUDA 13 build
    assert "pallas_gpu" in info["gmm_usable"] and "tokamax" in info["gmm_unusable"]
    timed = {(r["mode"], r["backend"], bool(r.get("aligned"))) for r in by["gmm"]
             if "median_ms" in r}
    # pallas_gpu ran (interpret mode), against the same-run dense: both modes, dlhs and drhs
    # alone, and both modes on aligned segments
    for mode in plan.MODES + plan.DIRECTION_MODES:
        assert {(mode, "dense_xla", False), (mode, "pallas_gpu", False)} <= timed
    assert {(m, b, a) for m, b, a in timed if a} == {(m, "pallas_gpu", True)
                                                   for m in plan.MODES}
    shape = plan.DRY_SHAPES[0]
    for r in by["gmm"]:
        if "median_ms" in r:    # the useful FLOPs of the unaligned rows, aligned or not
            assert r["useful_flops"] == shape.flops() * (3 if r["mode"] == "fwd+bwd" else 1)
        if r.get("aligned"):
            assert (r["aligned_rows"], r["group_alignment"]) == (plan.aligned_m(shape), 128)
    # tokamax is planned but cannot run here: a record says so
    assert any(r.get("backend") == "tokamax" and "not usable here" in r["skipped"]
               for r in by["gmm"] if "skipped" in r)
    assert all(r["model"] == "dry" for r in by["gmm"] if "median_ms" in r)
    assert all(r["fraction_of_dense"] > 0 for r in by["gmm"] if r.get("backend") == "pallas_gpu")
    # no torch here: the peer's rows say why instead of a number
    assert all("skipped" in r or "error" in r for r in by["gmm"]
               if r.get("backend", "").startswith("torch") and "median_ms" not in r)
    assert all(r["ran"] == r["backend"] for r in by["gmm"] if r.get("backend") == "pallas_gpu")
    # one record per measurement: dense, then the layer, for the unit the plan kept
    moe = [r for r in by["moe"] if "variant" in r]
    assert [(r["mode"], r["variant"]) for r in moe] == [("fwd+bwd", "dense"),
                                                        ("fwd+bwd", "dropless/auto")]
    # the profile unit traced the compiled layer: its table is a file, its groups a record
    prof = [r for r in by["moe"] if r.get("mode") == "profile" and "table" in r]
    assert len(prof) == 1 and prof[0]["kernels"] > 0
    table = [json.loads(ln) for ln in (out / "moe_kernels.jsonl").read_text().splitlines()]
    assert table[0]["event"] == "profile_header" and table[0]["device"] == "cpu"
    kernels = [r for r in table if r["event"] == "kernel"]
    groups = {r["group"]: r["share"] for r in table if r["event"] == "group"}
    assert len(kernels) == prof[0]["kernels"] and sum(groups.values()) == pytest.approx(1.0)
    assert sum(r["share"] for r in kernels) == pytest.approx(1.0)
    # the autotune: tokamax is not installed here, and the record says so
    assert [r["skipped"] for r in by["autotune"]] == [
        "tokamax cannot run here: tokamax is not installed"]
    steps = [r for r in by["train"] if r.get("event") == "step"]
    summary = [r for r in by["train"] if r.get("event") == "summary"][0]
    assert [r["step"] for r in steps] == [1, 2] and summary["median_step_time_s"] > 0
    assert summary["attention_kernel"] == "xla"   # the run's start record says which ran
    assert summary["train_set"] == {"model.scan_layers": True}
    assert not [p for p in (out / "train").rglob("checkpoints/*") if p.name.isdigit()]
    # the planner's prediction beside the measured step: on the CPU, which has no planner
    # profile, a stand-in H200's, said so, and never committable
    (cal,) = [r for r in by["train"] if r.get("event") == "plan_calibration"]
    rec = cal["record"]
    assert rec["hardware_stand_in"] is True and rec["dry_run"] is True
    assert rec["measured_s"] == summary["median_step_time_s"]
    assert rec["error"] == pytest.approx(rec["predicted_s"] / rec["measured_s"] - 1)
    from dropless.bench import gpu_train
    assert rec["hardware"] == gpu_train.STAND_IN_PROFILE and gpu_train.committable(rec)
    assert rec["plan_flags"].endswith(" model.scan_layers=true")   # the variant, as planned
    # the tests section collects the GPU tests that exist (it cannot run them without a GPU)
    assert "tests collected" in ends["tests"]["collected"] and ends["tests"]["selected"] > 50
    # MaxText beside the train section: run (tiny, on CPU) where .maxtext/ and a Python with
    # its packages are here, else one skip record saying how to fetch it (CI)
    from dropless.bench import gpu_maxtext
    ran = gpu_maxtext.missing(ROOT / ".maxtext") is None and gpu_maxtext._python(True)[0]
    if ran:
        (mt,) = [r for r in by["maxtext"] if r.get("event") == "summary"]
        assert mt["returncode"] == 0 and mt["steps"] == gpu_maxtext.DRY_STEPS
        assert mt["tokens_per_s_ratio"] == pytest.approx(
            summary["median_tokens_per_s"] / mt["median_tokens_per_s"])
    else:
        assert [r["event"] for r in by["maxtext"]] == ["skipped"]
        assert "fetch_maxtext.sh" in by["maxtext"][0]["fetch"]
    assert {p.name for p in out.iterdir()} == {
        "gpu_bench.jsonl", "info.log", "gmm.log", "moe.log", "autotune.log", "train.log",
        "maxtext.log", "tests.log", "train", "moe_kernels.jsonl", "moe_trace"} | (
            {"maxtext"} if ran else set())


@pytest.mark.parametrize("section,stage", [("moe", "compile"), ("train", "run")])
def test_a_failing_tokamax_falls_back_and_records_say_what_ran(dry_run, section, stage):
    _, out, recs, _ = dry_run
    ran = [r for r in recs if r["section"] == section and "gmm_fallbacks" in r]
    assert ran, section
    for r in ran:   # auto asked, native ran: the stand-in tokamax failed at that stage
        assert r["ran"] == "native" and r["gmm_fallbacks"], r
        assert {(f["from"], f["to"], f["stage"]) for f in r["gmm_fallbacks"]} == {
            ("tokamax", "native", stage)}
        assert f"tokamax failed to {stage}" in r["ran_because"]
    log = (out / f"{section}.log").read_text()
    assert f"grouped_matmul auto: tokamax failed to {stage}" in log
    # the summary table counts the records that fell back
    table = [r for r in recs if r.get("event") == "summary" and r["section"] == "summary"][-1]
    row = next(x for x in table["rows"] if x["section"] == section)
    assert row["fallbacks"] == len(ran) and row["status"] == "ok"


def test_units_the_plan_drops_are_recorded_as_skipped(dry_run):
    _, _, recs, _ = dry_run
    # planned as the H200 run would be with tokamax, against moe's cap of 65 s: the fwd+bwd
    # unit (8.2 + 33.75 s, the measured compiles) and the profile (8 s) fit 65 / 1.25 = 52 s,
    # the fwd unit after them (18.45 s more) does not
    skipped = [r for r in recs if r["section"] == "moe" and "skipped" in r
               and not r.get("aligned")]   # where the aligned option exists, its units too
    assert [r["mode"] for r in skipped] == ["fwd"]
    assert "dropped to fit the cap" in skipped[0]["skipped"]


def test_a_failing_measurement_is_recorded_and_the_next_one_runs(dry_run):
    _, _, recs, _ = dry_run
    gmm = [r for r in recs if r["section"] == "gmm" and "mode" in r]
    failed = [r for r in gmm if r["backend"] == "ragged_dot"]
    # one per mode: both, and dlhs and drhs alone
    assert [r["mode"] for r in failed] == list(plan.MODES + plan.DIRECTION_MODES)
    assert all("injected fault at gmm:ragged_dot" in r["error"] for r in failed)
    order = [(r["mode"], r["backend"]) for r in gmm]
    # after fwd's ragged_dot failed, fwd+bwd started again from dense
    assert order.index(("fwd", "ragged_dot")) < order.index(("fwd+bwd", "dense_xla"))


def test_every_measurement_is_a_line_when_taken_with_a_progress_line(dry_run):
    _, _, recs, stdout = dry_run
    taken = [r for r in recs if r.get("event") not in ("section_start", "section_end")
             and r["section"] not in ("plan", "summary")]
    times = [r["t_s"] for r in recs]
    assert times == sorted(times)    # appended in the order taken, stamped as taken
    for r in taken:   # each record has its progress line, stamped with the same time
        assert re.search(rf"\[ *{r['t_s']:.1f} s\] {r['section']}: ", stdout), r
    # and the estimate of the device run comes first, section by section
    head = stdout.split("# section")[0]
    for name in plan.SECTIONS:
        assert re.search(rf"#   {name} +\d+ s  \(cap \d+ s", head), head


def test_a_section_that_hangs_or_crashes_is_recorded_and_the_next_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "")
    rc = bench_gpu.run(_cli_options(["--dry-run", "--out-dir", str(tmp_path),
                                     "--sections", "gmm,moe,info",
                                     "--inject-fault", "gmm=hang,moe=exit", "--cap", "gmm=1"]))
    recs = _records(tmp_path)
    ends = _ends(recs)
    assert rc == 1
    # --cap gmm=1: 5 s in a dry run (DRY_CAP_SCALE)
    assert ends["gmm"]["status"] == "timeout" and ends["gmm"]["seconds"] < 20
    # the hung section's process group is gone
    pid = next(r["pid"] for r in recs if r.get("event") == "section_start"
               and r["section"] == "gmm")
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)
    assert ends["moe"]["status"] == "error" and ends["moe"]["returncode"] == 3
    assert ends["info"]["status"] == "ok"


def test_a_section_that_does_not_fit_the_budget_is_skipped(tmp_path):
    # the dry run's budget is DRY_CAP_SCALE (5) times --budget-s: 2.5 s, under MIN_SECTION_S
    assert bench_gpu.run(_args(dry_run=True, out_dir=str(tmp_path), sections=("info",),
                               budget_s=0.5)) == 1
    end = _ends(_records(tmp_path))["info"]
    assert end["status"] == "skipped" and "of the 2.5 s budget" in end["reason"]


def test_the_temporary_train_folder_is_removed_and_a_given_one_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    bench_gpu.run(_args(dry_run=True, out_dir=str(tmp_path / "out"), sections=("info",)))
    assert list((tmp_path / "tmp").iterdir()) == []
    (tmp_path / "mine").mkdir()
    bench_gpu.run(_args(dry_run=True, out_dir=str(tmp_path / "out"), sections=("info",),
                        train_dir=str(tmp_path / "mine")))
    assert (tmp_path / "mine").is_dir()


@pytest.mark.parametrize("argv,msg", [
    (["--sections", "gmm,nope"], "--sections: unknown ['nope']"),
    (["--cap", "gmm"], "--cap: 'gmm' is not KEY=VALUE"),
    (["--cap", "gmm=soon"], "--cap gmm='soon' is not a number of seconds"),
    (["--cap", "gpu=3"], "--cap: unknown section 'gpu'"),
    (["--inject-fault", "gmm=boom"], "--inject-fault gmm='boom': the kind is one of"),
    (["--shapes", "small/G8"], "--shapes: unknown ['small/G8']"),   # the dry run's are tiny
    (["--train-steps", "0"], "--train-steps=0 must be >= 1"),
    (["--train-set", "model.scan_layers"], "--train-set: 'model.scan_layers' is not KEY=VALUE"),
    (["--train-set", "steps=3"], "--train-set steps=...: the train section sets steps itself"),
    (["--train-set", "model.bogus=1"], "--train-set: unknown config key 'model.bogus'"),
    (["--train-set", "model.scan_layers=maybe"],
     "--train-set: config key 'model.scan_layers': 'maybe' must be true or false"),
    (["--train-set", "per_device_batch_size=[1"], "override 'per_device_batch_size=[1': the"),
])
def test_bad_options_are_named(tmp_path, argv, msg):
    # the command line's KEY=VALUE pairs are parsed by cli/bench.py, the rest checked by run
    with pytest.raises(ValueError, match=re.escape(msg)):
        bench_gpu.run(_cli_options(["--dry-run", "--out-dir", str(tmp_path), *argv]))


def test_the_command_line_defaults_are_the_options_defaults(monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    assert _cli_options([]) == bench_gpu.GpuOptions()


def test_the_runner_signalled_kills_the_hung_section_at_the_hard_stop(tmp_path):
    # run.sh's `timeout` sends SIGTERM at the hard stop: the runner kills the section's group
    env = dict(os.environ, XLA_FLAGS="", PYTHONPATH=str(ROOT / "src"))
    runner = subprocess.Popen([sys.executable, "-m", "dropless.cli", "bench", "gpu",
                               "--dry-run", "--out-dir", str(tmp_path), "--sections", "gmm",
                               "--inject-fault", "gmm=hang"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        pid = None
        for _ in range(600):
            recs = _records(tmp_path) if (tmp_path / "gpu_bench.jsonl").exists() else []
            pid = next((r["pid"] for r in recs if r.get("event") == "section_start"), None)
            if pid is not None:
                break
            time.sleep(0.1)
        assert pid is not None
        os.killpg(pid, 0)                       # the hung section runs
        runner.send_signal(signal.SIGTERM)
        assert runner.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if runner.poll() is None:
            runner.kill()
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)
    end = _ends(_records(tmp_path))["gmm"]
    assert end["status"] == "killed" and "SIGTERM" in end["reason"]


def test_the_plan_fits_run_sh_on_one_h200_with_margin():
    assert sum(plan.CAPS_S.values()) <= plan.BUDGET_S <= 550   # run.sh: 575 s less wheels
    targets = ("qwen3_30b_a3b/gate_up", "deepseek_v3_ep8/gate_up")
    for tokamax in (False, True):
        est = plan.estimate(tokamax=tokamax)
        assert est["total"]["seconds"] <= plan.BUDGET_S
        for name in plan.SECTIONS:   # each estimate, everything counted, 25% under its cap
            if name not in plan.TIME_BOXED:
                assert est[name]["seconds"] * plan.MARGIN <= plan.CAPS_S[name], (name, est)
        # the targets are kept: every kernel and the torch peer at the DeepSeek-V3 and Qwen3
        # per-device products; the MoE layer's fwd+bwd at both, and the profile
        kept = {(u["shape"], u["backend"], u["part"]) for u in est["gmm"]["kept"]}
        assert {(t, b, "modes") for t in targets
                for b in plan.default_backends(tokamax) + ("torch",)
                if plan.skip_reason(plan_shape(t), b) is None} <= kept
        # and dlhs, drhs alone at Qwen3's gate_up (the winner table's rows per direction)
        assert {(targets[0], b, "dirs") for b in plan.default_backends(tokamax)
                if plan.skip_reason(plan_shape(targets[0]), b) is None} <= kept
        assert [(u["case"], u["mode"]) for u in est["moe"]["kept"]][:3] == [
            (0, "fwd+bwd"), (0, "profile"), (1, "fwd+bwd")]
        assert [u["shape"] for u in est["autotune"].get("kept", [])] == (
            ["qwen3_30b_a3b/gate_up"] if tokamax else [])
        # what is dropped is the tail of the priority list, each with its reason
        order = [(u["shape"], u["backend"], u["part"])
                 for u in plan.gmm_units(plan.SHAPES, plan.ROUTINGS,
                                         plan.default_backends(tokamax))
                 if "skipped" not in u]
        assert [k for k in order if k in kept] == order[:len(kept)]
        assert all(u["skipped"] for u in est["gmm"]["dropped"])


def plan_shape(label):
    return next(s for s in plan.SHAPES if s.label == label)


def test_the_gmm_units_cover_the_shapes_table_targets_first():
    units = plan.gmm_units(plan.SHAPES, plan.ROUTINGS, ("pallas_gpu", "tokamax", "new_kernel"))
    # every shape of the table is planned (measured or dropped with a reason), the per-device
    # shapes of DeepSeek-V3 and Qwen3 first, each with its dense baseline in its first unit
    assert {u["shape"] for u in units} == {s.label for s in plan.SHAPES}
    firsts = list(dict.fromkeys(u["shape"] for u in units))
    assert firsts[:4] == list(plan.GMM_SHAPE_PRIORITY[:4])
    assert {s.split("/")[0] for s in firsts[:4]} == {"qwen3_30b_a3b", "deepseek_v3_ep8"}
    at = [(u["backend"], u["part"]) for u in units if u["shape"] == firsts[0]]
    # the priority list's order, torch where it stands, a backend it does not name last: both
    # modes, then dlhs and drhs alone (no peer), then pallas_gpu on aligned segments
    assert at == [("tokamax", "modes"), ("pallas_gpu", "modes"), ("torch", "modes"),
                  ("new_kernel", "modes"), ("tokamax", "dirs"), ("pallas_gpu", "dirs"),
                  ("new_kernel", "dirs"), ("pallas_gpu", "aligned")]
    # tiers: modes and dirs at the targets, then aligned there, then the same at the rest
    targets = set(plan.GMM_SHAPE_PRIORITY[:plan.GMM_TARGETS])
    tier = [(u["shape"] in targets, u["part"] == "aligned") for u in units
            if "skipped" not in u]
    assert tier == sorted(tier, key=lambda t: (not t[0], t[1]))
    aligned = [u for u in units if u["part"] == "aligned"]
    assert {u["backend"] for u in aligned} == set(plan.ALIGNED_BACKENDS)
    assert len(aligned) == len(plan.SHAPES)
    first = [u for u in units if u["shape"] == firsts[0]]
    s = plan_shape(firsts[0])
    own = {b: plan._unit_s(s, b, plan.ROUTINGS, True) for b in ("dense_xla", "tokamax",
                                                                  "pallas_gpu")}
    assert first[0]["seconds"] == pytest.approx(own["tokamax"] + own["dense_xla"]
                                                + plan.H200_COSTS["operands_s"])
    assert first[1]["seconds"] == pytest.approx(own["pallas_gpu"])
    # the directions' first unit carries their dense baseline; an aligned unit computes the
    # aligned layout's rows (Qwen3 gate_up: 262,144 rows + 128 groups x 127 = 278,400)
    dirs = [u for u in units if u["shape"] == firsts[0] and u["part"] == "dirs"]
    assert dirs[0]["seconds"] == pytest.approx(
        plan._unit_s(s, "tokamax", plan.ROUTINGS, True, "dirs") + plan.H200_COSTS["operands_s"]
        + plan._unit_s(s, "dense_xla", plan.ROUTINGS, True, "dirs"))
    assert plan.aligned_m(s) == 278400
    al = plan._unit_s(s, "pallas_gpu", plan.ROUTINGS, True, "aligned")
    assert own["pallas_gpu"] < al < own["pallas_gpu"] * 278400 / 262144 + 1e-9


def test_the_measured_backends_are_the_usable_ones_in_priority_order():
    usable = ["reference", "ragged_dot", "tiled", "native", "pallas_gpu", "tokamax",
              "mosaic_gpu", "padded", "loop", "cudnn_gemm", "auto"]
    assert plan.measured_backends(usable) == ["mosaic_gpu", "tokamax", "pallas_gpu",
                                              "ragged_dot", "cudnn_gemm"]
    assert plan.measured_backends(["pallas_gpu"]) == ["pallas_gpu"]


def test_the_moe_cases_are_the_shapes_tables_per_device_layers():
    by = {c["model"]: c for c in plan.MOE_CASES}
    qwen, dsv3 = by["qwen3_30b_a3b"], by["deepseek_v3_ep8"]
    # Qwen3-30B-A3B on one GPU: 128 experts, top-8, D 2048, F 768, 8 x 4096 tokens
    assert (qwen["experts"], qwen["top_k"], qwen["d_model"], qwen["d_ff"], qwen["tokens"]) == (
        128, 8, 2048, 768, 32768)
    # DeepSeek-V3 at EP 8: 32 experts a device, top-8, D 7168, F 2048; a third of its tokens
    assert (dsv3["experts"], dsv3["top_k"], dsv3["d_model"], dsv3["d_ff"]) == (32, 8, 7168, 2048)
    assert dsv3["tokens"] * 8 * 3 == plan_shape("deepseek_v3_ep8/gate_up").m


def test_the_estimate_is_printed_for_every_section():
    text = plan.format_estimate(plan.estimate(tokamax=True))
    for name in plan.SECTIONS + ("total",):
        assert re.search(rf"^#   {name} +\d+ s  \(cap \d+ s", text, re.M), name


def test_autotune_picks_a_handful_of_configs_heuristic_first():
    from dropless.bench import gpu_autotune
    configs = {("c", i) for i in range(40)}
    got = gpu_autotune.pick_configs(configs, ("c", 7), 5)
    assert got[0] == ("c", 7) and len(got) == len(set(got)) == 5 and set(got) <= configs
    assert got == gpu_autotune.pick_configs(set(configs), ("c", 7), 5)     # deterministic
    # fewer configs than asked: all of them, the heuristic one (not in the space) first
    assert gpu_autotune.pick_configs({1, 2}, 0, 5) == [0, 1, 2]
    assert gpu_autotune.file_name("NVIDIA H200") == "tokamax_nvidia_h200.json"
    assert (gpu_autotune.file_name("NVIDIA H100 80GB HBM3")
            == "tokamax_nvidia_h100_80gb_hbm3.json")   # tokamax's own folder name for it


def test_padded_ragged_dot_only_where_it_is_cheap():
    assert plan.skip_reason(plan_shape("small/G8"), "ragged_dot") is None
    assert plan.skip_reason(plan_shape("small/G64"), "ragged_dot") is None
    # DeepSeek-V3's gate_up product at EP 8: [32, 196608, 7168] bf16 operands, three of them
    assert "252.0 GiB" in plan.skip_reason(plan_shape("deepseek_v3_ep8/gate_up"), "ragged_dot")
    assert "12.0 GiB" in plan.skip_reason(plan_shape("small/G256"), "ragged_dot")
    assert plan.skip_reason(plan_shape("small/G256"), "pallas_gpu") is None


def test_run_sh_is_one_bounded_command():
    text = (ROOT / "benchmarks/gpu/run.sh").read_text()
    subprocess.run(["bash", "-n", str(ROOT / "benchmarks/gpu/run.sh")], check=True)
    hard = int(re.search(r"^HARD_S=(\d+)", text, re.M).group(1))
    # the device tool runs a command for at most 600 s; run.sh's wheels and nvidia-smi get 25 s
    assert hard <= 580 and hard - plan.BUDGET_S >= 25
    assert "timeout -k 5" in text and "--budget-s" in text
    # every wheel it carries is pinned, pydantic and pydantic-core together
    wheels = (ROOT / "benchmarks/gpu/fetch_wheels.sh").read_text()
    names = re.findall(r"([a-z][a-z0-9_.-]*)==([0-9][^\s)]*)", wheels)
    pinned = {n for n, _ in names}
    assert {"tokamax", "pydantic", "pydantic-core", "typing-extensions"} <= pinned


def test_the_time_boxed_tests_section_cut_at_its_cap_is_ok(tmp_path):
    results = tmp_path / "gpu_bench.jsonl"
    rec = bench_gpu.run_section(_args(faults={"tests": "hang"}), "tests", timeout_s=1,
                                t0=time.time(), out_dir=tmp_path, results=results,
                                train_dir=str(tmp_path), est={})
    assert rec["status"] == "ok" and rec["returncode"] == "timeout"
    lines = ["collected 5 items / 1 deselected / 4 selected",
             "tests/a.py::test_x PASSED", "tests/a.py::test_y FAILED"]
    got = bench_gpu._tests_record(lines)
    assert (got["passed"], got["failed_count"], got["not_reached"]) == (1, 1, 2)


def test_the_cost_model_is_not_below_the_first_device_run():
    # benchmarks/results/gpu_h200.jsonl (2026-12-04, one H200): what each section took there,
    # against today's estimate of what it ran
    recs = [json.loads(ln) for ln in (ROOT / "benchmarks/results/gpu_h200.jsonl").open()]
    ends, starts = _ends(recs), {r["section"]: r["t_s"] for r in recs
                                 if r.get("event") == "section_start"}
    timed = [r for r in recs if r["section"] == "gmm" and "median_ms" in r]
    assert sorted({r["shape"] for r in timed}) == ["G64", "G8"]   # small/G8, small/G64 now
    ran = tuple(b for b in plan.BACKEND_PRIORITY if b in {r["backend"] for r in timed})
    shapes = (plan_shape("small/G8"), plan_shape("small/G64"))
    gmm = plan.section_plan("gmm", tokamax=True, backends=ran, shapes=shapes, cap_s=10**6)
    assert not gmm["dropped"] and gmm["seconds"] >= ends["gmm"]["seconds"] == 32.43
    # moe: cut at its cap after its first unit (E 8, top-2 fwd+bwd over 16,384 routed rows),
    # whose record came 38.8 s in
    case = {"model": "first run", "experts": 8, "top_k": 2, "d_model": 2048, "d_ff": 1024,
            "tokens": 8192, "routing": "uniform"}
    moe = plan.section_plan("moe", tokamax=True, moe_cases=(case,), cap_s=10**6)
    assert moe["kept"][0]["mode"] == "fwd+bwd"
    first = plan.H200_COSTS["process_start_s"] + moe["kept"][0]["seconds"]
    layer = next(r for r in recs if r["section"] == "moe" and r.get("variant") == "dropless/auto")
    assert first >= layer["t_s"] - starts["moe"] > 38
    for name in ("info", "train"):
        assert plan.section_plan(name, tokamax=True)["seconds"] >= ends[name]["seconds"], name


def test_units_dropped_to_fit_run_while_time_is_left():
    # the plan's estimates are the slowest seen: a unit it dropped to fit the cap runs when its
    # estimate, with the margin, still fits before the cap; one dropped for its own reason never
    from dropless.bench import gpu_sections
    recs = []
    shape = plan.DRY_SHAPES[0]
    to_fit = "dropped to fit the cap: the section's estimate up to this unit is 99 s of 92 s"
    spec = {"gmm_units": [], "shapes": [dataclasses.asdict(shape)], "routings": ["uniform"],
            "est": 1.0, "deadline_t": time.time() + 600, "timing": plan.DRY_TIMING,
            "fault": {}, "gmm_dropped": [
                {"shape": shape.label, "backend": "ragged_dot", "seconds": 1.0,
                 "skipped": to_fit},
                {"shape": shape.label, "backend": "torch", "seconds": 10**6, "skipped": to_fit},
                {"shape": shape.label, "backend": "pallas_gpu", "seconds": 0.0,
                 "skipped": "its own reason"}]}
    gpu_sections.gmm_section(lambda rec, line=None: recs.append(rec), spec)
    timed = {(r["backend"], r["mode"]) for r in recs if "median_ms" in r}
    assert timed == {(b, m) for b in ("dense_xla", "ragged_dot") for m in plan.MODES}
    skipped = {r["backend"]: r["skipped"] for r in recs if "skipped" in r}
    assert skipped["pallas_gpu"] == "its own reason"
    assert skipped["torch"].startswith(to_fit + "; at run time ")


def test_the_aligned_option_is_found_when_moeconfig_has_one(monkeypatch):
    import dropless.config as config

    @dataclasses.dataclass(frozen=True)
    class WithBool:
        num_experts: int = 8
        aligned_segments: bool = False

    @dataclasses.dataclass(frozen=True)
    class WithRows:
        segment_alignment: int = 0

    @dataclasses.dataclass(frozen=True)
    class Without:
        num_experts: int = 8

    for cls, want in ((WithBool, ("aligned_segments", True)),
                      (WithRows, ("segment_alignment", 128)), (Without, None)):
        monkeypatch.setattr(config, "MoEConfig", cls)
        assert plan.align_option() == want
    # with the option, both layers are measured aligned too, after the unaligned ones
    units = [(u["case"], u["mode"], u["aligned"]) for u in plan.moe_units(False, aligned=True)]
    assert units[:5] == [(0, "fwd+bwd", False), (0, "profile", False), (1, "fwd+bwd", False),
                         (0, "fwd+bwd", True), (1, "fwd+bwd", True)]
    assert not any(u["aligned"] for u in plan.moe_units(False, aligned=False))


def test_every_test_pattern_names_existing_files():
    # the tests section runs these on the device: one that matches nothing would silently run less
    assert bench_gpu.stale_patterns(ROOT) == []
    for pat in bench_gpu.TEST_PATTERNS:
        assert list(ROOT.glob(pat)), pat
    assert bench_gpu.stale_patterns(ROOT, ("tests/ops/gmm/test_pallas_gpu.py",)) == [
        "tests/ops/gmm/test_pallas_gpu.py"]


def test_a_stale_test_pattern_is_refused_by_the_dry_run_and_reported_by_the_section(
        tmp_path, monkeypatch):
    gone = "tests/ops/gmm/test_no_such_file*.py"
    monkeypatch.setattr(bench_gpu, "TEST_PATTERNS", ("tests/ops/gmm/test_registry.py", gone))
    with pytest.raises(ValueError, match=re.escape(f"TEST_PATTERNS: {[gone]} match no file")):
        bench_gpu.run(_args(dry_run=True, out_dir=str(tmp_path), sections=("tests",)))
    assert not (tmp_path / "gpu_bench.jsonl").exists()
    # the section itself (as a device run runs it): the files that exist still run, the stale
    # pattern is named and the section is not "ok"
    with contextlib.redirect_stdout(io.StringIO()):
        rec = bench_gpu.run_section(_args(dry_run=True, out_dir=str(tmp_path)), "tests",
                                    timeout_s=300, t0=time.time(), out_dir=tmp_path,
                                    results=tmp_path / "r.jsonl", train_dir=str(tmp_path),
                                    est={})
    assert rec["status"] == "error" and rec["stale_patterns"] == [gone]
    assert gone in rec["reason"] and rec["selected"] > 0
