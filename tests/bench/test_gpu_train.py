"""The device check's planner calibration (bench/gpu_train.py): beside a measured step the
record holds what `dropless plan` predicts for the same config on the detected GPU (checked
against the command itself, run with the record's own flags), the error, and the schema of
benchmarks/results/plan_calibration.jsonl; a dry run's record says its device is a stand-in and
never goes into that file. The measured step here is synthetic: the test trains nothing (the
section's dry run is tests/bench/test_gpu.py's).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dropless.bench import gpu_train
from dropless.cli import main
from dropless.config_file import build_config
from dropless.presets import RUN_SETTINGS

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / gpu_train.CALIBRATION_FILE
MEASURED = {"median_step_time_s": 0.5, "min_step_time_s": 0.45, "max_step_time_s": 0.61,
            "compile_s": 31.0}
H100 = "NVIDIA H100 80GB HBM3"


@pytest.fixture(scope="module")
def cfg():
    """The section's training config on the device (its items, not the dry run's)."""
    return build_config(gpu_train._items({"train_steps": 20, "dry_run": False}, Path("unused")))


def test_the_section_writes_no_checkpoint(cfg):
    """The preset's float32 weights and Adam moments (~20 GB) are not saved inside the section's
    time cap, periodically or at the end; a --train-set cannot turn them back on."""
    assert cfg.checkpoint_every == 0 and cfg.save_last_step is False
    with pytest.raises(ValueError, match="the train section sets save_last_step itself"):
        gpu_train.check_train_set([("save_last_step", "true")])


def _plan_json(flags: str, capsys) -> dict:
    assert main(["plan", *flags.split(), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("kind,profile,ran,impl", [
    (H100, "h100", "cudnn", "flash"), ("NVIDIA H200", "h200", "cudnn", "flash"),
    (H100, "h100", "cudnn_thd", "flash"), (H100, "h100", "xla", "naive")])   # the attention the run ran, as the planner names it
def test_the_prediction_is_dropless_plans_for_the_trained_config(cfg, capsys, kind, profile,
                                                                 ran, impl):
    assert (cfg.preset, cfg.seq_len, cfg.per_device_batch_size, cfg.remat) == (
        "deepseek3-1gpu", *RUN_SETTINGS["deepseek3-1gpu"].values())
    rec = gpu_train.plan_calibration(cfg, {**MEASURED, "attention_kernel": ran}, kind,
                                     dry_run=False)
    assert rec["hardware"] == profile and rec["hardware_stand_in"] is False
    assert rec["plan_flags"] == (f"--preset deepseek3-1gpu --hardware {profile} --seq 4096 "
                                 f"--per-device-batch 4 --remat minimal --attention-impl {impl}")
    ref = _plan_json(rec["plan_flags"], capsys)          # the command, run with those flags
    assert rec["predicted_s"] == pytest.approx(ref["time"]["step_s"], rel=1e-12)
    assert rec["parts_s"] == pytest.approx(
        {k: v for k, v in ref["time"]["exposed_s"].items() if v}, rel=1e-12)
    assert rec["predicted_memory_bytes"] == pytest.approx(ref["memory"]["total"], rel=1e-12)
    assert rec["measured_s"] == 0.5 and rec["error"] == pytest.approx(
        ref["time"]["step_s"] / 0.5 - 1.0, rel=1e-12)
    assert (rec["measured_min_s"], rec["measured_max_s"], rec["compile_s"]) == (0.45, 0.61, 31.0)
    assert rec["device_kind"] == kind and rec["devices"] == 1


def test_the_record_has_the_committed_files_schema(cfg):
    rec = gpu_train.plan_calibration(cfg, MEASURED, H100, dry_run=False)
    committed = [json.loads(ln) for ln in COMMITTED.read_text().splitlines() if ln.strip()]
    train = [r for r in committed if r.get("workload") == "train_step"]
    # every key of the CPU calibration's records, less the micro-benchmarks' rates and their
    # contention-robust `_min` variants, which a GPU run does not measure
    shared = set.intersection(*(set(r) for r in train)) - {
        "rates", "rates_min", "error_min", "parts_min_s", "predicted_min_s", "kernel_shapes",
        "busy_fraction_before", "busy_fraction_after"}
    assert shared <= set(rec), shared - set(rec)
    assert rec["workload"] == "train_step"


def test_a_dry_run_predicts_on_a_stand_in_and_says_so(tmp_path):
    dry = build_config(gpu_train._items({"train_steps": 2, "dry_run": True}, tmp_path))
    rec = gpu_train.plan_calibration(dry, MEASURED, "cpu", dry_run=True)
    assert rec["hardware"] == gpu_train.STAND_IN_PROFILE and rec["hardware_stand_in"] is True
    assert rec["platform"] == "cpu" and rec["predicted_s"] > 0
    assert "dry run" in gpu_train.committable(rec)


def test_a_gpu_without_a_profile_is_skipped_not_guessed(cfg):
    rec = gpu_train.plan_calibration(cfg, MEASURED, "NVIDIA A10G", dry_run=False)
    assert list(rec) == ["skipped"]
    assert rec["skipped"].startswith("the planner has no profile for 'NVIDIA A10G'")


@pytest.mark.parametrize("measured", [None, 0.0])
def test_without_a_measured_step_nothing_is_predicted(cfg, measured):
    with pytest.raises(ValueError, match="no measured step to calibrate against"):
        gpu_train.plan_calibration(cfg, {"median_step_time_s": measured}, H100, dry_run=False)


def _bench_file(tmp_path: Path, *recs: dict) -> Path:
    """A gpu_bench.jsonl as the runner writes it (its keys on every record)."""
    path = tmp_path / "gpu_bench.jsonl"
    path.write_text("".join(json.dumps({"section": "train", **r, "dry_run": False, "t_s": 1.0})
                            + "\n" for r in recs))
    return path


def test_the_devices_record_is_appended_and_the_file_kept(cfg, tmp_path):
    # as the device check on an H100 writes it: the platform is the GPU's, no dry run
    rec = {**gpu_train.plan_calibration(cfg, MEASURED, H100, dry_run=False), "platform": "gpu"}
    bench = _bench_file(tmp_path, {"event": "summary", "median_step_time_s": 0.5},
                        {"event": "plan_calibration", "skipped": "a record with nothing"},
                        {"event": "plan_calibration", "record": rec})
    out = tmp_path / "plan_calibration.jsonl"
    shutil.copy(COMMITTED, out)
    before = out.read_text()
    assert gpu_train.append_calibration(bench, out) == 1
    after = out.read_text()
    assert after.startswith(before)
    assert json.loads(after[len(before):]) == json.loads(json.dumps(rec))   # as it was made


def test_a_dry_runs_record_never_goes_into_the_file(tmp_path):
    dry = build_config(gpu_train._items({"train_steps": 2, "dry_run": True},
                                        tmp_path / "run"))
    rec = gpu_train.plan_calibration(dry, MEASURED, "cpu", dry_run=True)
    bench = _bench_file(tmp_path, {"event": "plan_calibration", "record": rec})
    out = tmp_path / "plan_calibration.jsonl"
    out.write_text('{"workload": "train_step"}\n')
    with pytest.raises(ValueError, match=r"gpu_bench.jsonl: a plan_calibration record cannot go "
                                         r"into .*: it is a dry run's \(platform 'cpu'"):
        gpu_train.append_calibration(bench, out)
    assert out.read_text() == '{"workload": "train_step"}\n'       # untouched
    with pytest.raises(ValueError, match="no plan_calibration record"):
        gpu_train.append_calibration(_bench_file(tmp_path, {"event": "summary"}), out)


@pytest.mark.parametrize("error,falls_back,kernel", [
    (RuntimeError("INTERNAL: cuDNN graph failed to build: __cudnn$fmhaScaleBiasSoftmax"), True,
     "cudnn"),
    (RuntimeError("INTERNAL: cuDNN graph failed to build: __cudnn$fmhaSoftmax"), True,
     "cudnn_thd"),
    (RuntimeError("RESOURCE_EXHAUSTED: out of memory allocating 2.1G"), False, "cudnn")])
def test_a_cudnn_attention_failure_is_recorded_and_the_model_trained_with_xla(
        cfg, monkeypatch, error, falls_back, kernel):
    import dropless.train.loop as loop
    import dropless.train.step as step
    ran: list = []

    def fake_train(c, progress=None):
        ran.append(c)
        if len(ran) == 1:
            raise error
        return "result"
    monkeypatch.setattr(loop, "train", fake_train)
    monkeypatch.setattr(step, "attention_kernel",
                        lambda c: kernel if c.model.attention_kernel == "auto" else "xla")
    emitted: list = []
    emit = lambda rec, line=None: emitted.append(rec)  # noqa: E731
    if not falls_back:   # anything else is the section's error, as before
        with pytest.raises(RuntimeError, match="out of memory"):
            gpu_train._train_or_fall_back(emit, cfg, None)
        assert emitted == [] and len(ran) == 1
        return
    result, used = gpu_train._train_or_fall_back(emit, cfg, None)
    assert result == "result" and used.model.attention_kernel == "xla"
    assert used.run_name == "train-xla" and used.model.replace(attention_kernel="auto") == cfg.model
    (rec,) = emitted
    assert rec["event"] == "attention_fallback" and (rec["from"], rec["to"]) == (kernel, "xla")
    assert "cuDNN graph failed to build" in rec["reason"]


def test_a_variant_sets_keys_over_the_run_settings_and_the_section_keeps_its_own(tmp_path):
    """--train-set: a key given wins over the preset's run settings (the batch here) and is
    planned with the run (its flags name it where `dropless plan` has no flag of its own);
    the section's own keys stay the section's."""
    spec = {"train_steps": 20, "dry_run": False,
            "train_set": [["per_device_batch_size", 2], ["model.scan_layers", True]]}
    var = build_config(gpu_train._items(spec, tmp_path))
    assert var.per_device_batch_size == 2 and var.model.scan_layers is True
    assert var.steps == 20 and var.run_name == "train"
    rec = gpu_train.plan_calibration(var, MEASURED, H100, dry_run=False,
                                     train_set=spec["train_set"])
    assert "--per-device-batch 2 " in rec["plan_flags"]
    assert rec["plan_flags"].endswith(" model.scan_layers=true")
    with pytest.raises(ValueError, match="the train section sets run_name itself"):
        gpu_train.check_train_set([("run_name", "x")])
    gpu_train.check_train_set([("model.scan_layers", False)])      # taken
