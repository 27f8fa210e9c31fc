"""The peak FLOPS MFU divides by: one GPU table (the planner's profiles), and a CPU peak that is
measured once per machine and cached, so two runs never divide by different numbers. A step's
tokens/s counts its real tokens (not padding); its FLOPs, TFLOPS and MFU every position it
computed."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from dropless import machine
from dropless.machine import PROFILES
from dropless.train import metrics as met


def test_gpu_peaks_come_from_the_planner_profiles():
    peak = machine.device_peak_flops
    assert peak("NVIDIA H100 80GB HBM3", "bfloat16") == PROFILES["h100"].peak_bf16
    assert peak("NVIDIA H200", "float32") == PROFILES["h200"].peak_tf32
    assert peak("NVIDIA GB200", "fp8") == PROFILES["gb200"].peak_fp8  # not b200
    assert peak("NVIDIA B200", "mxfp8") == PROFILES["b200"].peak_fp8
    assert peak("NVIDIA A100-SXM4-80GB", "bfloat16") is None
    assert peak("NVIDIA H100", "int4") is None
    assert not hasattr(met, "PEAK_FLOPS")   # one table, in machine.py
    assert not hasattr(met, "device_peak_flops") and not hasattr(met, "cpu_model")


def test_cpu_peak_is_measured_once_then_read(tmp_path, monkeypatch):
    monkeypatch.delenv(machine.CPU_PEAK_ENV, raising=False)
    calls = []

    def noisy(dtype):   # what start-up measurements did: a different figure every run
        calls.append(dtype)
        return [1.7e11, 5.2e11][len(calls) - 1]

    p1, src1 = machine.cpu_peak_flops("float32", cache_dir=tmp_path, measure=noisy)
    p2, src2 = machine.cpu_peak_flops("float32", cache_dir=tmp_path, measure=noisy)
    assert p1 == p2 == 1.7e11 and calls == ["float32"] and src1 == src2
    (file,) = tmp_path.glob("*.json")
    entry = json.loads(file.read_text())
    assert entry["flops"] == 1.7e11 and machine.cpu_model() in entry["key"]
    assert str(file) in src1
    # another dtype is another key, measured separately
    p3, _ = machine.cpu_peak_flops("bfloat16", cache_dir=tmp_path, measure=noisy)
    assert p3 == 5.2e11 and calls == ["float32", "bfloat16"]


def test_cpu_peak_replaces_an_unreadable_cache_file(tmp_path, monkeypatch):
    monkeypatch.delenv(machine.CPU_PEAK_ENV, raising=False)
    machine.cpu_peak_flops("float32", cache_dir=tmp_path, measure=lambda d: 1e11)
    (file,) = tmp_path.glob("*.json")
    file.write_text("{not json")
    assert machine.cpu_peak_flops("float32", cache_dir=tmp_path, measure=lambda d: 2e11)[0] == 2e11
    assert machine.cpu_peak_flops("float32", cache_dir=tmp_path, measure=lambda d: 3e11)[0] == 2e11


def test_cpu_peak_override_and_its_errors(tmp_path, monkeypatch):
    monkeypatch.setenv(machine.CPU_PEAK_ENV, "3e11")
    assert machine.cpu_peak_flops(cache_dir=tmp_path, measure=lambda d: 1.0) == (3e11, "$" +
                                                                            machine.CPU_PEAK_ENV)
    for bad in ("fast", "-1"):
        monkeypatch.setenv(machine.CPU_PEAK_ENV, bad)
        with pytest.raises(ValueError, match=machine.CPU_PEAK_ENV):
            machine.cpu_peak_flops(cache_dir=tmp_path)


def test_two_processes_divide_by_the_same_cpu_peak(tmp_path):
    """Two real runs (separate processes, real measurement) report the same peak."""
    code = ("from dropless.machine import peak_flops_per_device; "
            "print(repr(peak_flops_per_device('float32')[0]))")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    env.pop(machine.CPU_PEAK_ENV, None)
    out = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True, timeout=120).stdout.strip() for _ in range(2)]
    assert out[0] == out[1] and float(out[0]) > 0
    assert len(list((tmp_path / "dropless" / "cpu_peak").glob("*.json"))) == 1


def test_tokens_per_s_counts_real_tokens_and_the_flops_every_computed_one():
    """A "pad" batch from the loader: documents of 5, 3 and 10 tokens at S = 8 give pieces of
    4, 2, 8 and 1 inputs (the 10-token one in two pieces that overlap by one token), each row
    then padding: 15 real tokens of 32 positions. Two micro-batches of 2 rows: the step
    computed all 4 rows."""
    from dropless.config import TrainConfig
    from dropless.data import loader
    from dropless.presets import get_preset
    from dropless.train import step
    from dropless.train.step_metrics import step_metrics
    addr = loader.Addressing(loader.as_stream(np.arange(1, 19), [5, 8, 18]), seq_len=8,
                             packing="pad", seed=0, shuffle=False)
    batch = addr.rows(range(4))
    np.testing.assert_array_equal((batch.segment_ids_BS > 0).sum(axis=1), [4, 2, 8, 1])
    cfg = TrainConfig(model=get_preset("deepseek3-test"), packing="pad", seq_len=8,
                      per_device_batch_size=2, gradient_accumulation_steps=2)
    real = step.real_tokens(batch, cfg)
    assert int(real) == 15
    assert int(step.real_tokens(batch, cfg.replace(packing="stream"))) == 32   # no segments
    m = {"loss": 1.0, "dropped_tokens": 0, "real_tokens": real}
    rec = step_metrics(m, step=1, dt=0.5, cfg=cfg, fpt={"model": 1e9, "executed": 2e9},
                       peak=1e12)
    assert rec["real_tokens"] == 15 and rec["tokens_per_s"] == 30.0
    assert rec["padded_tokens_per_s"] == 64.0
    assert rec["tflops_per_device"] == pytest.approx(32 * 1e9 / 0.5 / 1e12)   # one device
    assert rec["mfu"] == pytest.approx(rec["tflops_per_device"])                # 1 TFLOPS peak
    assert rec["executed_tflops_per_device"] == pytest.approx(2 * rec["tflops_per_device"])
