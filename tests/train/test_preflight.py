"""The memory pre-flight on CPU (train/preflight.py): which method it uses, the start-up line,
and a config that cannot fit refused before anything is allocated or written (the library call
and `dropless train`, one line, exit 2). The compiled-step method on H100/H200 compile-only
devices is tested in test_preflight_gpu_compile.py (the GPU leg)."""
from __future__ import annotations

import pytest

from dropless.cli import main as cli_main
from dropless.train import preflight
from dropless.train.loop import train
from tests._support.train_mini import mini

QUIET = dict(echo=lambda s: None)


def test_on_cpu_the_planner_model_is_used_and_reported(tmp_path):
    cfg = mini(tmp_path)
    fit = preflight.check(cfg, limit=24 * 2 ** 30, source="test")
    assert fit["method"] == "model" and fit["total"] == preflight.estimate(cfg)["total"]
    assert fit["limit"] == 24 * 2 ** 30 and fit["source"] == "test"
    line = preflight.summary(fit)
    assert "by the planner's memory model" in line and "24.00 GiB (test)" in line


def test_the_trainer_reports_it_at_start_up(tmp_path):
    lines = []
    result = train(mini(tmp_path, steps=1, checkpoint_every=0, eval_every=10), echo=lines.append)
    assert result.preflight["method"] == "model"
    assert any(ln.startswith("  memory: ") and "planner's memory model" in ln for ln in lines)


def test_an_oversized_config_is_refused_before_allocation(tmp_path, monkeypatch):
    # 1.7B parameters at 64 x 4096 tokens a step, no remat: terabytes by the planner's model
    from dropless.config_file import build_config
    cfg = build_config([("preset", "deepseek3-1gpu"), ("seq_len", 4096),
                        ("per_device_batch_size", 64), ("remat", "none"),
                        ("run_dir", str(tmp_path / "runs"))])
    allocated = []
    monkeypatch.setattr("dropless.train.step.init_state",
                        lambda *a, **k: allocated.append(1))   # never reached
    with pytest.raises(preflight.DoesNotFit, match=r"per_device_batch_size=64 x seq_len=4096 "
                       r"\(remat=none\) does not fit: .* by the planner's memory model"):
        train(cfg, **QUIET)
    assert not allocated and not (tmp_path / "runs").exists()


def test_the_cli_refuses_it_in_one_line_exit_2(tmp_path, capsys):
    status = cli_main(["train", "--preset", "deepseek3-1gpu", "seq_len=4096",
                       "per_device_batch_size=64", f"run_dir={tmp_path / 'runs'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1, err
    assert "does not fit" in err[0] and "DROPLESS_NO_PREFLIGHT=1" in err[0]
    assert not (tmp_path / "runs").exists()


def test_no_preflight_skips_it(tmp_path, monkeypatch):
    monkeypatch.setenv("DROPLESS_NO_PREFLIGHT", "1")
    fit = preflight.check(mini(tmp_path, seq_len=100_000), limit=1.0)
    assert fit["method"] == "skipped" and "skipped" in preflight.summary(fit)


def test_compile_only_needs_the_plugin_or_says_why():
    from dropless.train import compile_only
    why = compile_only.unavailable()
    if why:   # the main venv: no jax CUDA plugin
        with pytest.raises(ValueError, match="cannot compile for an H100 here: the jax CUDA"):
            compile_only.devices("h100")
    with pytest.raises(ValueError, match=r"hardware='a100' has no compile-only target"):
        compile_only.devices("a100")
