"""The maxtext section of the device check (bench/gpu_maxtext.py): its reading of MaxText's
own output (tests/fixtures/maxtext/: a real CPU run of the fetched MaxText, see its README)
checked against figures worked out by hand from those files; dropless's FLOP count of the
config MaxText runs against MaxText's own count of it; the skip record where .maxtext/ is
absent (never a number); maxtext.sh's refusal of a folder without MaxText; the tables beside
the train section's; and, where .maxtext/ and a Python with MaxText's packages are here, the
section's dry run for real (tiny MaxText on CPU, 2 steps).
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import time
from pathlib import Path

import pytest

from dropless.bench import gpu_maxtext as gm
from dropless.bench import gpu_plan as plan
from dropless.bench import gpu_train
from dropless.config_file import build_config
from dropless.presets import RUN_SETTINGS
from tests._support.paths import ROOT
from tests.bench import gpu_records as gr

FIXTURE = ROOT / "tests/fixtures/maxtext"
spec = importlib.util.spec_from_file_location("gpu_tables", ROOT / "benchmarks/gpu/tables.py")
tables = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tables)


def _fixture():
    metrics = [json.loads(ln) for ln in (FIXTURE / "maxtext_metrics.jsonl").open()]
    return metrics, gm.parse_log((FIXTURE / "maxtext_train.log").read_text().splitlines())


def test_the_log_is_read_as_maxtext_wrote_it():
    _, log = _fixture()
    # "Per train step:\n Total TFLOPs: 0.00" (the tiny model), "Total estimated memory size:
    # 0.0 GB"; no "Using (GB)" line on a CPU ("Memstats unavailable")
    assert log["total_tflops"] == 0.0 and log["compiled_estimate_gb"] == 0.0
    assert log["memory_in_use_gb"] is None
    # the first glog line I1207 23:02:17.413540 to "completed step: 0" at 23:02:26.723756
    assert log["first_step_s"] == pytest.approx(26.723756 - 17.413540)
    assert sorted(log["step_log_s"]) == [0, 1, 2, 3, 4, 5]
    # MaxText's print_mem_stats line on a GPU (max_utils.py: f"\tUsing (GB) {used} / {limit}
    # ({used/limit:%}) on {d}"), which the CPU run could not write
    gpu = gm.parse_log(["I1207 23:02:17.413540 1 max_utils.py:786] \tUsing (GB) 20.5 / 139.8 "
                        "(14.663805%) on cuda:0"])
    assert (gpu["memory_in_use_gb"], gpu["memory_limit_gb"]) == (20.5, 139.8)


def test_the_summary_of_real_maxtext_output_by_hand():
    metrics, log = _fixture()
    cfg = gm.dropless_config(gm.run_flags(dry_run=True, steps=6))
    tokens, flops = gm.dropless_flops_per_step(cfg)
    # the tiny model: batch 1 x 128 positions, 930,816 FLOPs a token (dropless's count), the
    # same as MaxText's own perf/per_device_tflops (0.000119144448 TFLOP a step)
    assert (tokens, flops) == (128, 128 * 930816)
    assert all(m["perf/per_device_tflops"] * 1e12 == pytest.approx(flops) for m in metrics)
    train = {"median_tokens_per_s": 10000.0, "median_step_time_s": 0.0128}
    s = gm.summarize(metrics, log, tokens=tokens, flops=flops, peak=2e12, train=train)
    # steps 0-5; 0-2 dropped; 3, 4, 5 took 0.014124, 0.015253, 0.010879 s: the median 0.014124
    assert (s["steps"], s["timed_steps"], s["skipped_first_steps"]) == (6, 3, 3)
    assert s["median_step_time_s"] == 0.014124
    assert (s["min_step_time_s"], s["max_step_time_s"]) == (0.010879, 0.015253)
    assert s["median_tokens_per_s"] == pytest.approx(128 / 0.014124)            # 9062.59
    assert s["median_tflops_per_device"] == pytest.approx(119144448 / 0.014124 / 1e12)
    assert s["median_mfu"] == pytest.approx(119144448 / 0.014124 / 2e12)
    # MaxText's own TFLOP/s of steps 3-5: 0.008436, 0.007811, 0.010952 -> 0.008436
    assert s["median_maxtext_tflops_per_device"] == pytest.approx(0.008435602378929482)
    # the log's clock: 26.764703 - 26.754003, 26.775784 - 26.764703, 26.786736 - 26.775784
    assert s["median_logged_step_interval_s"] == pytest.approx(0.010952)
    assert s["first_step_s"] == pytest.approx(9.310216)
    assert s["final_loss"] == pytest.approx(4.8428544998168945)
    assert s["tokens_per_s_ratio"] == pytest.approx(10000.0 / (128 / 0.014124))
    # without a peak no MFU; without the train summary no ratio; two steps: step 1 is timed
    s = gm.summarize(metrics[:2], log, tokens=tokens, flops=flops, peak=None)
    assert s["median_mfu"] is None and "tokens_per_s_ratio" not in s
    assert (s["timed_steps"], s["median_step_time_s"]) == (1, 0.109658)
    assert gm.summarize([], log, tokens=tokens, flops=flops, peak=None) == {
        "steps": 0, "timed_steps": 0, "skipped_first_steps": 0}


def test_the_device_run_is_the_train_sections_model_with_maxtexts_gpu_kernel():
    flags = gm.run_flags(dry_run=False, steps=plan.MAXTEXT_STEPS)
    assert flags["use_tokamax_gmm"] is True and flags["steps"] == plan.MAXTEXT_STEPS
    assert "tokamax" in gm.moe_kernel(flags)
    assert "ragged_dot" in gm.moe_kernel(gm.run_flags(dry_run=True, steps=2))
    cfg = gm.dropless_config(flags)
    train = build_config([("preset", gpu_train.PRESET), *RUN_SETTINGS[gpu_train.PRESET].items()])
    # the same model; the grouped matmul dropless would run for MaxText's flag aside
    assert cfg.model.moe.gmm_backend == "tokamax"
    assert cfg.model.replace(moe=cfg.model.moe.replace(gmm_backend="auto")) == train.model
    assert (cfg.seq_len, cfg.global_batch_size) == (train.seq_len, train.global_batch_size)
    tokens, flops = gm.dropless_flops_per_step(cfg)
    # MaxText prints "Per train step: Total TFLOPs: 40.56" for this config
    assert tokens == 4 * 4096 and flops / 1e12 == pytest.approx(40.56, abs=0.005)


def test_without_maxtext_the_section_records_a_skip_and_no_number(tmp_path):
    recs = []
    spec = {"dry_run": False, "maxtext_dir": str(tmp_path), "maxtext_steps": 10,
            "bench_dir": str(tmp_path), "results": str(tmp_path / "r.jsonl"),
            "deadline_t": time.time() + 60}
    gm.maxtext_section(lambda rec, line=None: recs.append(rec), spec)
    assert [r["event"] for r in recs] == ["skipped"]
    assert f"{tmp_path}/COMMIT is missing" in recs[0]["skipped"]
    assert "benchmarks/gpu/fetch_maxtext.sh" in recs[0]["fetch"]
    assert not any("median" in k or "tokens" in k for k in recs[0])
    assert set(recs[0]) == set(gr.maxtext_skipped()) - {"section", "dry_run", "t_s"}
    assert "MaxText: not run" in tables.maxtext_table([gr.maxtext_skipped()])


def test_maxtext_sh_refuses_a_folder_without_maxtext(tmp_path):
    out = subprocess.run(["bash", str(ROOT / gm.SCRIPT), "steps=1"], capture_output=True,
                         text=True, env={"PATH": "/usr/bin:/bin", "MAXTEXT_DIR": str(tmp_path),
                                         "OUT": str(tmp_path / "out")})
    assert out.returncode == 2 and "run benchmarks/gpu/fetch_maxtext.sh" in out.stdout


def test_the_tables_put_maxtext_beside_the_train_section():
    recs = [gr.train_summary(0.5),
            gr.maxtext_summary(0.8, train_step_s=0.5)]
    text = tables.maxtext_table(recs)
    assert "| tokens/s | 32768 | 20480 |" in text            # 16384 tokens / 0.5 s, / 0.8 s
    assert "| median step (ms) | 500.0 | 800.0 |" in text
    assert "| MoE grouped matmul | tokamax | tokamax.ragged_dot (implementation='mosaic') |" in text
    assert "dropless / MaxText tokens/s: 1.60" in text
    alone = tables.maxtext_table([gr.maxtext_summary(0.8)])
    assert "| tokens/s | - | 20480 |" in alone and "no train summary" in alone


def _maxtext_here() -> str | None:
    why = gm.missing(ROOT / ".maxtext")
    if why:
        return f"{why}: run benchmarks/gpu/fetch_maxtext.sh"
    py, why = gm._python(dry_run=True)
    return why or None


@pytest.mark.skipif(_maxtext_here() is not None, reason=f"no MaxText here: {_maxtext_here()}")
def test_the_dry_run_trains_tiny_maxtext_on_cpu(tmp_path):
    results = tmp_path / "gpu_bench.jsonl"
    results.write_text(json.dumps(gr.train_summary(0.01, tokens=128)) + "\n")
    recs = []
    spec = {"dry_run": True, "maxtext_dir": None, "maxtext_steps": 10,
            "bench_dir": str(tmp_path), "results": str(results),
            "deadline_t": time.time() + 300}
    gm.maxtext_section(lambda rec, line=None: recs.append(rec), spec)
    steps = [r for r in recs if r["event"] == "step"]
    (s,) = [r for r in recs if r["event"] == "summary"]
    assert [r["step"] for r in steps] == [0, 1] and s["returncode"] == 0
    assert s["tokens_per_step"] == s["maxtext_tokens_per_step"] == 128
    assert s["timed_steps"] == 1 and s["median_step_time_s"] == steps[1]["step_time_s"]
    assert s["tokens_per_s_ratio"] == pytest.approx(12800 / s["median_tokens_per_s"])
    # the synthetic records (tables' tests) have the real summary's keys
    assert set(gr.maxtext_summary(1.0, train_step_s=1.0)) == set(s) | {"section", "t_s",
                                                                       "dry_run"}
    assert (tmp_path / "maxtext/maxtext_metrics.jsonl").exists()


def test_the_peak_is_the_devices_bfloat16_from_this_runs_records():
    from dropless.machine import device_peak_flops
    info = {"section": "info", "device_kind": "NVIDIA H200"}
    assert gm._device_peak([info], False) == (
        "NVIDIA H200", device_peak_flops("NVIDIA H200", "bfloat16"), "table: NVIDIA H200")
    train = gr.train_summary(0.5, device_kind="NVIDIA H100 80GB HBM3")
    assert gm._device_peak([train], False)[0] == "NVIDIA H100 80GB HBM3"
    assert gm._device_peak([info], True)[1] is None       # the dry run's CPU: no MFU
