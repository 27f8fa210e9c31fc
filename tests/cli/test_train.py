"""CLI layer of training: argument -> config, `config show`, and the report's arithmetic."""
import argparse
import json

import pytest

from dropless.cli import config as config_cli
from dropless.cli import train as train_cli
from dropless import report


def parse(argv):
    p = argparse.ArgumentParser()
    train_cli.add_arguments(p)
    return p.parse_args(argv)


def test_no_arguments_is_the_tiny_default():
    cfg = train_cli.config_from_args(parse([]))
    assert cfg.preset == "tiny" and cfg.data == "stdlib" and cfg.run_dir == "runs"


def test_preset_flag_and_overrides():
    cfg = train_cli.config_from_args(parse(["--preset", "deepseek3-test", "--profile-steps", "3",
                                            "steps=7", "num_experts_per_tok=3"]))
    assert (cfg.preset, cfg.steps, cfg.model.moe.top_k, cfg.profile_steps) == \
        ("deepseek3-test", 7, 3, 3)


def test_resume_reads_the_saved_config(tmp_path):
    from dropless.config_file import build_config
    from dropless.model_dir import to_dict
    saved = build_config([("preset", "deepseek3-test"), ("steps", 11), ("seq_len", 48)])
    run = tmp_path / "r1"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(to_dict(saved)))
    cfg = train_cli.config_from_args(parse(["--resume", str(run), "steps=20"]))
    assert cfg.model == saved.model and cfg.seq_len == 48 and cfg.steps == 20
    assert (cfg.run_dir, cfg.run_name) == (str(tmp_path), "r1")


def _saved_run(tmp_path, *items):
    from dropless.config_file import build_config
    from dropless.model_dir import to_dict
    saved = build_config([("preset", "deepseek3-test"), ("steps", 11), *items])
    run = tmp_path / "r1"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(to_dict(saved)))
    return run, saved


def test_resume_applies_the_config_file_over_the_saved_config(tmp_path):
    # the run's config.json, then --config, then the overrides: a --config file given with
    # --resume was once read before config.json, so config.json undid every key it set
    run, saved = _saved_run(tmp_path, ("learning_rate", 0.01))
    (tmp_path / "more.yaml").write_text("steps: 30\nlearning_rate: 0.002\n")
    cfg = train_cli.config_from_args(parse(["--config", str(tmp_path / "more.yaml"),
                                            "--resume", str(run), "learning_rate=0.003"]))
    assert (cfg.steps, cfg.learning_rate, cfg.model) == (30, 0.003, saved.model)


@pytest.mark.parametrize("how", [["--preset", "tiny"], ["--config", "p.yaml"]])
def test_resume_under_another_preset_is_refused(tmp_path, how):
    # the saved model wins over a preset's, so another preset only relabelled the run
    run, _ = _saved_run(tmp_path)
    (tmp_path / "p.yaml").write_text("preset: tiny\n")
    how = [str(tmp_path / w) if w.endswith(".yaml") else w for w in how]
    with pytest.raises(ValueError, match=r"^preset 'tiny': .*r1 was trained as preset "
                                         r"'deepseek3-test'.*drop"):
        train_cli.config_from_args(parse([*how, "--resume", str(run), "steps=20"]))
    same = train_cli.config_from_args(parse(["--preset", "deepseek3-test", "--resume", str(run),
                                             "steps=20"]))
    assert same.preset == "deepseek3-test" and same.steps == 20


def test_config_show_prints_yaml_and_counts(capsys):
    p = argparse.ArgumentParser()
    config_cli.add_arguments(p)
    assert config_cli.run(p.parse_args(["show", "--preset", "deepseek3-671b"])) == 0
    out = capsys.readouterr().out
    assert "num_experts: 256" in out and "total 671.03B, active 37.55B" in out


def test_report_summary(tmp_path):
    recs = [{"event": "start"}] + [
        {"event": "step", "step": s, "loss": 5.0 - s, "step_time_s": 1.0 + s % 2,
         "tokens_per_s": 100.0, "tflops_per_device": 0.5, "mfu": 0.1, "dropped_tokens": 0,
         "expert_load_max_over_mean": 1.0 + s / 10, "tokens_per_expert": [[1, 3]]}
        for s in range(1, 6)] + [{"event": "eval", "step": 5, "eval_loss": 0.5}]
    # a resumed run rewrites step 5; the later record wins
    recs.append(dict(recs[5], loss=-1.0))
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs))
    s = report.summary(report.read_metrics(tmp_path))
    assert s["steps"] == 5 and s["first_loss"] == 4.0 and s["last_loss"] == -1.0
    assert s["median_step_time_s"] == 2.0        # steps 3, 4, 5 -> 2, 1, 2
    assert s["max_expert_load_max_over_mean"] == 1.5 and s["last_eval_loss"] == 0.5
    with pytest.raises(ValueError, match="has no metrics.jsonl"):
        report.read_metrics(tmp_path / "nothing")
    names = sorted(p.name for p in report.draw(tmp_path))
    assert names == ["expert_load.png", "loss.png", "throughput.png"]
