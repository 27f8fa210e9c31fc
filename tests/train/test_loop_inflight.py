"""One step in flight: the loop dispatches step n+1 before it reads step n's
metrics, except after a step whose state the host needs (checkpoint, eval, the last step), and
what it records is what a loop that reads every step before the next one records.

The order is observed, not inferred: the compiled step is wrapped to log each dispatch, and the
loop's one metrics read (`loop._read_metrics`) to log each read, naming the step of the metrics.
"""
import json
import time

import pytest

from dropless.train import loop

from tests._support.train_mini import mini, shared_compilation_cache


@pytest.fixture(scope="module", autouse=True)
def compilation_cache(tmp_path_factory):
    """Both runs compile the same step: once, through the persistent cache."""
    yield from shared_compilation_cache(tmp_path_factory)


def _instrumented(monkeypatch, events: list, read_at: dict) -> None:
    """Log ("dispatch", n) when step n is dispatched and ("read", n) when its metrics are read;
    read_at[n]: the perf_counter time when step n's metrics reached the host."""
    compile_ = loop._compile
    read = loop._read_metrics
    step_of = {}

    def compile_logged(*args, **kw):
        step_fn, *rest = compile_(*args, **kw)   # rest: what the gmm ran, seconds, ...

        def logged(state, batch):
            state, m = step_fn(state, batch)
            n = sum(e[0] == "dispatch" for e in events) + 1
            step_of[id(m)] = n
            events.append(("dispatch", n))
            return state, m

        return logged, *rest

    def read_logged(m):
        n = step_of[id(m)]
        events.append(("read", n))
        out = read(m)
        read_at[n] = time.perf_counter()
        return out

    monkeypatch.setattr(loop, "_compile", compile_logged)
    monkeypatch.setattr(loop, "_read_metrics", read_logged)


def _steps(run_dir):
    """The step records without their timings (which differ from run to run)."""
    recs = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = ("step_time_s", "tokens_per_s", "padded_tokens_per_s", "tflops_per_device", "mfu",
             "executed_tflops_per_device", "tokens_per_s_per_device", "input_wait_s")
    return [{k: v for k, v in r.items() if k not in timed} for r in recs
            if r["event"] in ("step", "eval", "end")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same 7-step run twice (checkpoint and eval every 3 steps): with one step in flight,
    and with the loop made to read every step before dispatching the next (drained)."""
    out = {}
    for name in ("inflight", "drained"):
        mp = pytest.MonkeyPatch()
        events: list = []
        read_at: dict = {}
        _instrumented(mp, events, read_at)
        if name == "drained":
            mp.setattr(loop, "_needs_state", lambda *a, **k: True)
        tmp = tmp_path_factory.mktemp(name)
        cfg = mini(tmp, steps=7, checkpoint_every=3, eval_every=3, run_name=name)
        try:
            res = loop.train(cfg, echo=lambda s: None)
        finally:
            mp.undo()
        out[name] = (res, events, read_at)
    return out


def test_next_step_is_dispatched_before_the_previous_one_is_read(runs):
    _, events, _ = runs["inflight"]
    # steps 3 and 6 checkpoint and evaluate, 7 is the last: each is read before the next
    # dispatch; every other step n is read only once step n+1 is on its way
    assert events == [("dispatch", 1), ("dispatch", 2), ("read", 1), ("dispatch", 3),
                      ("read", 2), ("read", 3),
                      ("dispatch", 4), ("dispatch", 5), ("read", 4), ("dispatch", 6),
                      ("read", 5), ("read", 6),
                      ("dispatch", 7), ("read", 7)]
    _, drained, _ = runs["drained"]   # the instrument can tell the two orders apart
    assert drained == [e for n in range(1, 8) for e in (("dispatch", n), ("read", n))]


def test_in_flight_records_what_the_step_by_step_loop_records(runs):
    (fast, _, _), (slow, _, _) = runs["inflight"], runs["drained"]
    assert _steps(fast.run_dir) == _steps(slow.run_dir)
    assert fast.losses == slow.losses and len(fast.losses) == 7
    assert fast.eval_losses == slow.eval_losses and set(fast.eval_losses) == {3, 6, 7}
    saved = lambda r: sorted(int(p.name) for p in (r.run_dir / "checkpoints").iterdir()
                             if p.name.isdigit())
    assert saved(fast) == saved(slow) == [3, 6, 7]


def test_step_time_is_between_completed_steps(runs):
    res, _, read_at = runs["inflight"]
    recs = [json.loads(ln) for ln in (res.run_dir / "metrics.jsonl").read_text().splitlines()]
    dt = {r["step"]: r["step_time_s"] for r in recs if r["event"] == "step"}
    # steps 2 and 5 follow steps that neither evaluate nor checkpoint: their time is the time
    # from the previous step's completion (its metrics on the host) to their own
    for n in (2, 5):
        assert dt[n] == pytest.approx(read_at[n] - read_at[n - 1], abs=5e-3)
    assert all(t > 0 for t in dt.values()) and len(dt) == 7
