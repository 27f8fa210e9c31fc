"""What a new user reads: `--help` names every preset and describes every generate option; the
loss plot's reference line is ln of the run's own vocabulary (the loss of a uniform guess); the
start-up prints no empty XLA_FLAGS and no cache path; with MTP the step line says what its loss
adds up."""
import json
import math

import pytest

from dropless.cli import build_parser
from dropless.presets import PRESETS
from tests._support.run_metrics import write_run


def _help(*argv) -> str:
    parser = build_parser()
    sub = parser._subparsers._group_actions[0].choices[argv[0]]
    for name in argv[1:]:
        sub = sub._subparsers._group_actions[0].choices[name]
    return " ".join(sub.format_help().split())


def test_help_names_every_preset():
    for cmd in (("train",), ("config", "show")):
        text = _help(*cmd)
        for name in PRESETS:
            assert name in text, (cmd, name)


def test_generate_help_describes_every_option():
    parser = build_parser()
    gen = parser._subparsers._group_actions[0].choices["generate"]
    bare = [a.option_strings for a in gen._actions if a.option_strings and not a.help]
    assert bare == [], bare
    assert "the text to continue" in _help("generate") and "sampling seed" in _help("generate")


@pytest.mark.parametrize("vocab", [256, 151_936, None])
def test_the_loss_plot_draws_ln_of_the_runs_vocabulary(tmp_path, monkeypatch, vocab):
    pytest.importorskip("matplotlib")
    from dropless import report
    run = write_run(tmp_path / "r", steps=3, vocab_size=vocab)
    drawn = {}

    def keep(fig, path):
        drawn[path.name] = [(ln.get_label(), list(ln.get_ydata())) for ax in fig.axes
                            for ln in ax.get_lines()]
        return path
    monkeypatch.setattr(report, "_save", keep)
    report.draw(run)
    refs = [(label, y) for label, y in drawn["loss.png"] if label.startswith("ln ")]
    if vocab is None:                 # no config.json: no reference line rather than a wrong one
        assert refs == []
    else:
        (label, y), = refs
        assert y[0] == pytest.approx(math.log(vocab)) and f"{vocab:,}" in label


def test_start_up_prints_no_empty_xla_flags(monkeypatch):
    from dropless.config_file import build_config
    from dropless.runtime.distributed import start
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
    lines: list[str] = []
    start(build_config([]), echo=lines.append)
    assert not [ln for ln in lines if ln.startswith("XLA_FLAGS=")], lines
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    lines.clear()
    start(build_config([]), echo=lines.append)
    assert lines[0] == "XLA_FLAGS='--xla_cpu_enable_fast_math=false'"


def test_the_peak_line_leaves_out_the_cache_path(tmp_path, monkeypatch):
    from dropless import machine
    from dropless.train.loop import _peak_words
    monkeypatch.delenv(machine.CPU_PEAK_ENV, raising=False)
    peak, source = machine.cpu_peak_flops("float32", cache_dir=tmp_path,
                                          measure=lambda d: 2.5e11)
    (cached,) = tmp_path.glob("*.json")
    assert str(cached) in source                      # metrics.jsonl keeps where
    words = _peak_words(peak, source)
    assert str(tmp_path) not in words and "cached" not in words
    assert words == "  peak 0.250 TFLOPS/device (CPU matmul peak measured " + \
        json.loads(cached.read_text())["measured"] + ")"


def test_the_step_line_says_what_an_mtp_loss_adds_up():
    from dropless.train.step_metrics import step_line
    rec = {"step": 3, "loss": 5.0 + 0.3 * 4.0 + 0.01, "ce_loss": 5.0, "mtp_loss": 4.0,
           "moe_loss": 0.01, "step_time_s": 0.5, "tokens_per_s": 1.0,
           "tflops_per_device": 0.0, "mfu": None, "dropped_tokens": 0}
    assert "| loss 6.2100 (ce 5.0000 + 0.3 x mtp 4.0000 + MoE aux) |" in step_line(rec, 0.3)
    plain = {k: v for k, v in rec.items() if k not in ("mtp_loss",)}
    assert "| loss 6.2100 |" in step_line(plain, 0.3)
    # a decoder of dense layers whose MTP block routes: its balance loss is in the objective
    mtp_only = {**rec, "moe_loss": 0.0, "mtp_moe_loss": 0.01}
    assert "+ 0.3 x mtp 4.0000 + MoE aux) |" in step_line(mtp_only, 0.3)
    assert "MoE aux" not in step_line({**rec, "moe_loss": 0.0, "mtp_moe_loss": 0.0}, 0.3)


def test_the_step_line_names_the_expert_load_only_where_the_decoder_has_moe_layers():
    from dropless.train.step_metrics import step_line
    rec = {"step": 3, "loss": 5.0, "step_time_s": 0.5, "tokens_per_s": 1.0,
           "tflops_per_device": 0.0, "mfu": 0.25, "dropped_tokens": 0}
    assert step_line(rec).endswith("| MFU 25.0% | dropped 0")
    moe = step_line({**rec, "expert_load_max_over_mean": 2.345})
    assert moe.endswith("| MFU 25.0% | load max/mean 2.35 | dropped 0")   # rounded, not cut
    # a dense decoder whose MTP block routes: the block's load, named as the block's
    mtp = step_line({**rec, "mtp_expert_load_max_over_mean": 1.5})
    assert mtp.endswith("| MFU 25.0% | mtp load max/mean 1.50 | dropped 0")
    both = step_line({**rec, "expert_load_max_over_mean": 2.0,
                      "mtp_expert_load_max_over_mean": 1.5})
    assert both.endswith("| load max/mean 2.00 | mtp load max/mean 1.50 | dropped 0")


def test_the_step_record_holds_the_mtp_blocks_expert_loads():
    """The MTP blocks' loads (which move their router biases) are written as a table of their
    own beside the decoder's, with their worst max/mean."""
    from dropless.config import TrainConfig
    from dropless.presets import get_preset
    from dropless.train.step_metrics import step_metrics
    cfg = TrainConfig(model=get_preset("deepseek3-test"), per_device_batch_size=1, seq_len=8)
    m = {"loss": 5.0, "dropped_tokens": 0, "tokens_per_expert_LE": [[2, 2, 2, 2]],
         "mtp_tokens_per_expert_LE": [[1, 5, 1, 1]]}
    rec = step_metrics(m, step=1, dt=0.5, cfg=cfg, fpt={"model": 1.0, "executed": 1.0},
                       peak=None)
    assert rec["tokens_per_expert"] == [[2, 2, 2, 2]] and rec["expert_load_max_over_mean"] == 1
    assert rec["mtp_tokens_per_expert"] == [[1, 5, 1, 1]]
    assert rec["mtp_expert_load_max_over_mean"] == 2.5
    assert "mtp_tokens_per_expert" not in step_metrics(
        {k: v for k, v in m.items() if not k.startswith("mtp")}, step=1, dt=0.5, cfg=cfg,
        fpt={"model": 1.0, "executed": 1.0}, peak=None)
