"""The memory pre-flight on CPU (train/preflight.py): which method it uses, the start-up line,
a compiled step's figure and refusal, and a config that cannot fit refused before anything is
allocated or written (the library call and `dropless train`, one line, exit 2). The trainer's
one compile read by the pre-flight is tested in test_loop_compile.py; the compiled-step method
on H100/H200 compile-only devices in test_preflight_gpu_compile.py (the GPU leg)."""
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


def test_the_trainer_reads_a_compiled_step_on_a_gpu_only(tmp_path, monkeypatch):
    one, eight = mini(tmp_path), mini(tmp_path, **{"mesh.data": 8})
    assert preflight.COMPILED_PLATFORMS == ("gpu",)
    assert not preflight.reads_compiled(one) and not preflight.reads_compiled(eight)  # a CPU
    monkeypatch.setattr(preflight, "COMPILED_PLATFORMS", ("gpu", "cpu"))
    assert preflight.reads_compiled(one) and preflight.reads_compiled(eight)


def test_a_compiled_step_is_measured_by_its_memory_analysis(tmp_path):
    import jax
    import jax.numpy as jnp
    cfg = mini(tmp_path)
    # a donated 1 MiB state: the output (1 MiB) reuses it, the 4 KiB argument is not donated
    f = jax.jit(lambda s, x: s * 2 + jnp.sum(x), donate_argnums=0)
    exe = f.lower(jax.ShapeDtypeStruct((2 ** 18,), jnp.float32),
                  jax.ShapeDtypeStruct((1024,), jnp.float32)).compile()
    ma = exe.memory_analysis()
    want = (ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
            + ma.temp_size_in_bytes + ma.generated_code_size_in_bytes)
    assert ma.alias_size_in_bytes == 2 ** 20 and want >= 2 ** 20 + 4096
    fit = preflight.check(cfg, executable=exe, compile_s=1.5, limit=2 ** 30, source="test")
    assert fit["method"] == "compiled" and fit["total"] == want
    assert fit["compiled"] == {**preflight.analysis(exe), "compile_s": 1.5}
    assert fit["model_total"] == preflight.estimate(cfg)["total"]
    assert "by the compiled step's memory analysis" in preflight.summary(fit)
    with pytest.raises(preflight.DoesNotFit, match=r"does not fit: 0\.00 GiB per device by "
                       r"the compiled step, 0\.00 GiB available \(a 1 MiB test device\)"):
        preflight.check(cfg, executable=exe, limit=2 ** 20, source="a 1 MiB test device")


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
