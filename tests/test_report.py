"""`dropless.report` on a resumed run: metrics.jsonl read as the run's checkpoints have it (an
earlier session's steps after the resume point are not the run's), and each session's first
steps left out of the medians. The command itself is tests/cli/test_report.py."""
import json

from dropless import report
from tests._support.run_metrics import step_record


def _write(run, recs):
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return run


def test_a_resume_drops_what_no_checkpoint_kept(tmp_path):
    """Session 1 trained steps 1-7 (an eval at 6) and was killed with checkpoint 4; session 2
    resumed at 4, trained step 5 and was stopped. Steps 6 and 7 and the eval at 6 are not in
    the run any more (the next resume trains them again): the run ends at session 2's step 5."""
    recs = ([{"event": "start", "resumed_from": 0}] + [step_record(s) for s in range(1, 8)]
            + [{"event": "eval", "step": 6, "eval_loss": 4.0}]
            + [{"event": "start", "resumed_from": 4}, step_record(5, loss=9.0),
               {"event": "stopped", "step": 5, "signal": "SIGTERM"}])
    m = report.read_metrics(_write(tmp_path / "run", recs))
    assert [r["step"] for r in m["step"]] == [1, 2, 3, 4, 5]
    assert m["step"][-1]["loss"] == 9.0 and m["eval"] == []
    s = report.summary(m)
    assert (s["steps"], s["last_loss"], s["last_eval_loss"]) == (5, 9.0, None)


def test_each_sessions_first_steps_are_left_out_of_the_medians(tmp_path):
    """Both sessions' first two steps are slow (compiling, warming up): steps 1-2 and, after
    the resume at 2, steps 3-4; the medians are those of steps 5-6."""
    slow, fast = {"tokens_per_s": 10.0, "padded_tokens_per_s": 20.0}, {
        "tokens_per_s": 1000.0, "padded_tokens_per_s": 2000.0}
    recs = ([{"event": "start", "resumed_from": 0}]
            + [step_record(s, **(slow if s <= 2 else fast)) for s in range(1, 5)]
            + [{"event": "start", "resumed_from": 2}]
            + [step_record(s, **(slow if s <= 4 else fast)) for s in range(3, 7)])
    s = report.summary(report.read_metrics(_write(tmp_path / "run", recs)))
    assert s["steps"] == 6
    assert (s["median_tokens_per_s"], s["median_padded_tokens_per_s"]) == (1000.0, 2000.0)
