"""`dropless report`: plots drawn (matplotlib is installed by `make test`), a readable throughput
plot, the numbers printed without matplotlib, and a closed pipe ending quietly."""
import argparse
import json
import os
import subprocess
import sys

import pytest

from dropless import report
from dropless.cli import report as report_cli
from tests._support.paths import SRC


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    recs = [{"event": "start"}] + [
        {"event": "step", "step": s, "loss": 5.0 - s / 10, "step_time_s": 0.5,
         "tokens_per_s": 4000.0 + 10 * s, "tflops_per_device": 0.02, "mfu": 0.1 + s / 1000,
         "dropped_tokens": 0, "expert_load_max_over_mean": 1.2,
         "tokens_per_expert": [[3, 5, 4, 4], [6, 2, 4, 4]]}
        for s in range(1, 9)] + [{"event": "eval", "step": 8, "eval_loss": 4.5}]
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs))
    return d


def args_for(d):
    p = argparse.ArgumentParser()
    report_cli.add_arguments(p)
    return p.parse_args([str(d)])


def test_report_draws_the_three_plots(run_dir, capsys):
    assert report_cli.run(args_for(run_dir)) == 0
    out = capsys.readouterr().out
    assert json.loads(out[:out.rindex("}") + 1])["steps"] == 8
    for name in ("loss.png", "throughput.png", "expert_load.png"):
        assert (run_dir / name).stat().st_size > 1000, name
        assert str(run_dir / name) in out


def test_throughput_has_one_axis_per_quantity_with_legends(run_dir):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig = report._throughput_figure(plt, report.read_metrics(run_dir)["step"])
    tokens, mfu = fig.axes  # two axes, no twin drawn over the first
    assert tokens.get_ylabel() == "tokens/s" and mfu.get_ylabel() == "MFU %"
    for ax, label in ((tokens, "tokens/s"), (mfu, "MFU %")):
        texts = [t.get_text() for t in ax.get_legend().get_texts()]
        assert texts[0] == label and texts[1].startswith("median"), texts
    assert mfu.get_lines()[0].get_ydata()[0] == pytest.approx(10.1)  # percent
    plt.close(fig)
    no_mfu = [dict(r, mfu=None) for r in report.read_metrics(run_dir)["step"]]
    fig = report._throughput_figure(plt, no_mfu)
    assert [ax.get_ylabel() for ax in fig.axes] == ["tokens/s"]
    plt.close(fig)
    # padding computed (packing=pad): the rate with it drawn too, beside the real tokens'
    padded = [dict(r, padded_tokens_per_s=2 * r["tokens_per_s"]) for r in no_mfu]
    fig = report._throughput_figure(plt, padded)
    (ax,) = fig.axes
    assert [t.get_text() for t in ax.get_legend().get_texts()][2] == "with padding"
    assert ax.get_lines()[-1].get_ydata()[0] == 2 * no_mfu[0]["tokens_per_s"]
    plt.close(fig)


def test_report_without_matplotlib_prints_numbers_and_explains(run_dir, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` -> ImportError
    assert report_cli.run(args_for(run_dir)) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["median_tokens_per_s"] == 4055.0
    assert "no plots: matplotlib is not installed" in captured.err
    assert "dropless[report]" in captured.err


def test_report_into_a_closed_pipe_ends_quietly(run_dir):
    # `dropless report DIR | head`: the reader is gone before the report writes
    proc = subprocess.Popen([sys.executable, "-m", "dropless.cli", "report", str(run_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": SRC})
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_report_reads_past_a_torn_line_and_names_its_line(tmp_path, capsys):
    good = [{"event": "step", "step": s, "loss": 5.0, "step_time_s": 0.5, "tokens_per_s": 1.0,
             "tflops_per_device": 0.0, "mfu": None, "dropped_tokens": 0} for s in (1, 2, 3)]
    lines = [json.dumps({"event": "start"}), json.dumps(good[0]), "",
             '{"event": "step", "step": 2, "lo' + json.dumps({"event": "start"}),
             json.dumps(good[1]), json.dumps(good[2])]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    skipped = []
    m = report.read_metrics(tmp_path, skipped)
    assert [r["step"] for r in m["step"]] == [1, 2, 3]
    assert len(skipped) == 1 and "metrics.jsonl line 4 is not a complete JSON record" in \
        skipped[0], skipped
    monkey_draw = report.draw
    try:
        report.draw = lambda d: []          # the plots are the other tests' business
        assert report_cli.run(args_for(tmp_path)) == 0
    finally:
        report.draw = monkey_draw
    err = capsys.readouterr().err
    assert err.startswith("dropless: warning: ") and "line 4" in err and "skipped" in err


def test_report_refuses_a_run_without_steps_and_draws_nothing(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"event": "start"}) + "\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl has no step records .*no plots drawn"):
        report_cli.run(args_for(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_a_one_step_run_draws_without_a_warning(tmp_path):
    pytest.importorskip("matplotlib")
    import warnings
    rec = {"event": "step", "step": 1, "loss": 5.0, "step_time_s": 0.5, "tokens_per_s": 4e3,
           "tflops_per_device": 0.02, "dropped_tokens": 0, "tokens_per_expert": [[3, 5, 4, 4]]}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(rec) + "\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # matplotlib's singular-limits warning included
        paths = report.draw(tmp_path)
    assert [p.name for p in paths] == ["loss.png", "throughput.png", "expert_load.png"]


def test_a_run_without_moe_layers_has_no_expert_load_not_zero(tmp_path):
    """A decoder of dense layers records no expert load: the summary says none (null), not a
    worst load of 0; with MoE layers it is the worst step's."""
    base = {"event": "step", "loss": 5.0, "step_time_s": 0.5, "tokens_per_s": 4e3,
            "tflops_per_device": 0.02, "dropped_tokens": 0}
    dense = [{**base, "step": s} for s in (1, 2, 3)]
    assert report.summary({"step": dense, "eval": []})["max_expert_load_max_over_mean"] is None
    moe = [{**r, "expert_load_max_over_mean": v} for r, v in zip(dense, (1.5, 2.5, 2.0))]
    assert report.summary({"step": moe, "eval": []})["max_expert_load_max_over_mean"] == 2.5


def test_the_mtp_blocks_expert_loads_are_summarised_checked_and_drawn(tmp_path):
    """A dense decoder whose MTP block routes: its load table is the run's only one. The summary
    names the MTP blocks' worst load apart from the decoder's (null), the heatmap draws a
    panel a block, and a table that is not [blocks][experts] numbers is refused by line."""
    pytest.importorskip("matplotlib")
    base = {"event": "step", "loss": 5.0, "step_time_s": 0.5, "tokens_per_s": 4e3,
            "tflops_per_device": 0.02, "dropped_tokens": 0}
    recs = [{**base, "step": s, "mtp_expert_load_max_over_mean": v,
             "mtp_tokens_per_expert": [[2, 6, 4, 4]]} for s, v in ((1, 1.5), (2, 3.0))]
    (tmp_path / "metrics.jsonl").write_text("\n".join(map(json.dumps, recs)) + "\n")
    m = report.read_metrics(tmp_path)
    s = report.summary(m)
    assert s["max_expert_load_max_over_mean"] is None
    assert s["max_mtp_expert_load_max_over_mean"] == 3.0
    [(label, steps, rel)] = report._load_panels(m["step"])
    assert label == "MTP block 0" and steps == [1, 2]
    assert rel.tolist() == [[0.5, 1.5, 1.0, 1.0]] * 2       # load / mean load, a step a row
    assert [p.name for p in report.draw(tmp_path)][-1] == "expert_load.png"
    # with MoE layers too: the decoder's panels first, then the block's
    both = [{**r, "tokens_per_expert": [[4, 4, 4, 4], [1, 7, 4, 4]]} for r in recs]
    assert [p[0] for p in report._load_panels(both)] == ["MoE layer 0", "MoE layer 1",
                                                         "MTP block 0"]
    bad = {**recs[0], "mtp_tokens_per_expert": [[2, 6], [4]]}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match=r"line 1: .*mtp_tokens_per_expert that is not a table"):
        report.read_metrics(tmp_path)
    other = {**recs[1], "mtp_tokens_per_expert": [[2, 6, 4, 4, 0, 0]]}
    (tmp_path / "metrics.jsonl").write_text("\n".join(map(json.dumps, (recs[0], other))) + "\n")
    with pytest.raises(ValueError, match=r"line 2: mtp_tokens_per_expert is 1 x 6 .*two runs"):
        report.read_metrics(tmp_path)


def test_a_folder_of_runs_is_refused_naming_the_newest_run(tmp_path):
    """`dropless report runs/` (the parent the trainer makes runs in): one line that names the
    run last written, by its metrics' time, not its name."""
    for name, t in (("b-old", 1_000), ("a-new", 2_000)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("{}\n")
        os.utime(tmp_path / name / "metrics.jsonl", (t, t))
    (tmp_path / "notes").mkdir()
    with pytest.raises(ValueError, match=r"has no metrics.jsonl; it holds 2 runs: name one, "
                                         r"e.g. the newest, '.*a-new'$"):
        report.read_metrics(tmp_path)
    with pytest.raises(ValueError, match=r"has no metrics.jsonl$"):
        report.read_metrics(tmp_path / "notes")
