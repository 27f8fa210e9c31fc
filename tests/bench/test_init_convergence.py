"""bench/init_convergence.py: a finished run directory of the config asked for is read back
(not trained again), one of another config is not, and lines already written are skipped."""
import json

from dropless.bench import init_convergence as ic
from dropless.model_dir import to_dict


def _fake_run(opts, scheme, seed, *, eval_300=1.5):
    cfg = ic.run_config(opts, scheme, seed)
    folder = ic.Path(cfg.run_dir) / cfg.run_name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(to_dict(cfg)))
    events = [{"event": "start", "compile_s": 3.0, "busy_fraction": 0.0, "params": {"total": 9},
               "machine": {"git_commit": "abc"}}]
    events += [{"event": "step", "step": s, "step_time_s": 0.5, "loss": 6.0 - s / 100}
               for s in range(1, opts.steps + 1)]
    events += [{"event": "eval", "step": 2, "eval_loss": 3.0},
               {"event": "eval", "step": opts.steps, "eval_loss": eval_300},
               {"event": "end", "step": opts.steps, "final_loss": 5.9}]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return cfg, folder


def test_a_finished_run_is_read_back_and_its_line_is_not_written_twice(tmp_path, capsys):
    opts = ic.InitOptions(steps=4, seeds=(0,), schemes=("fan_in",), runs_dir=str(tmp_path),
                          out=str(tmp_path / "out.jsonl"))
    _fake_run(opts, "fan_in", 0, eval_300=1.25)
    assert ic.run(opts) == 0
    lines = (tmp_path / "out.jsonl").read_text().splitlines()
    r = json.loads(lines[0])
    assert (r["scheme"], r["seed"], r["eval_loss"], r["trained_here"]) == ("fan_in", 0, 1.25,
                                                                           False)
    assert r["eval_losses"] == {"2": 3.0, "4": 1.25} and r["wall_s"] == 3.0 + 4 * 0.5
    assert r["init"]["init"] == "fan_in" and r["git_commit"] == "abc"
    assert ic.run(opts) == 0                       # in the file already: nothing runs
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 1
    assert "in " + str(tmp_path / "out.jsonl") in capsys.readouterr().out


def test_a_run_of_another_config_is_not_taken_for_the_one_asked(tmp_path):
    opts = ic.InitOptions(steps=4, runs_dir=str(tmp_path), out=None)
    cfg, folder = _fake_run(opts, "maxtext", 1)
    other = ic.run_config(ic.InitOptions(steps=5, runs_dir=str(tmp_path)), "maxtext", 1)
    assert ic._same_run(cfg, folder) and not ic._same_run(other, folder)
    assert ic.read_run(folder)[-1]["event"] == "end"
    (folder / "metrics.jsonl").write_text('{"event": "start"}\n')   # stopped half way
    assert ic.read_run(folder) is None
