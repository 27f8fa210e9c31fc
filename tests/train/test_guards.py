"""The guard protocol (train/guards.py) both step guards follow: attach a record to the state
and strip it before a checkpoint, check only when due or
forced, save the last good step through the loop's `save` (never step 0 unless the guard says
the initial state is worth keeping), raise the guard's GuardStop with one line; and the
Saver's side of it: a last good step already checkpointed is not written twice."""
from pathlib import Path

import jax.numpy as jnp
import pytest

from dropless.config_file import build_config
from dropless import checkpoint as ckpt
from dropless.train.guards import (AFTER_RECORD, BEFORE_RECORD, Guard, GuardStop, Tripped,
                                   attach_all, check_all, strip_all, wrap_all)
from dropless.train.nonfinite import NonFiniteError, NonFiniteGuard
from dropless.train.overflow import BufferOverflowError, OverflowGuard


class Stop(GuardStop):
    pass


class EveryOther(Guard):
    """Refuses step `bad`; read on even steps."""
    error = Stop

    def __init__(self, bad: int, *, save_initial: bool = False):
        self.active, self.bad, self.save_initial = True, bad, save_initial

    def due(self, step):
        return step % 2 == 0

    def tripped(self, state, step, metrics):
        return Tripped(bad=self.bad) if step >= self.bad else None

    def describe(self, found, *, state, metrics, batch):
        return f"step {found.bad} refused (loss {metrics.get('loss')})"

    def saved_words(self, good, run_dir):
        return f"; step {good} is in {run_dir}"


def test_check_reads_only_when_due_or_forced_and_saves_the_last_good_step():
    saved = []

    def save(good, state):
        saved.append((good, state))
        return Path("/runs/r")

    g = EveryOther(bad=3)
    g.check({"x": 1}, 3, save=save)                      # not due, not forced: no read
    assert saved == []
    with pytest.raises(Stop, match=r"^step 3 refused \(loss 2.5\); step 2 is in /runs/r$"):
        g.check({"x": 1}, 3, metrics={"loss": 2.5}, force=True, save=save)
    assert saved == [(2, {"x": 1})]
    with pytest.raises(Stop, match=r"^step 3 refused \(loss None\)$"):   # no save: no words
        g.check({}, 4)


def test_step_zero_is_saved_only_when_the_guard_keeps_the_initial_state():
    saved = []
    save = lambda good, state: saved.append(good) or Path("/r")   # noqa: E731
    with pytest.raises(Stop, match="no step had completed, nothing is checkpointed"):
        EveryOther(bad=1).check({}, 2, save=save)
    assert saved == []
    with pytest.raises(Stop, match="step 0 is in /r"):
        EveryOther(bad=1, save_initial=True).check({}, 2, save=save)
    assert saved == [0]


def test_an_inactive_guard_never_reads():
    g = EveryOther(bad=1)
    g.active = False
    g.check({}, 2, force=True)
    assert g.wrap(len) is len


def test_check_all_runs_the_guards_of_one_stage(monkeypatch):
    from dropless.train import nonfinite
    monkeypatch.setattr(nonfinite, "locate", lambda *a, **k: "located")   # (tested on its own)
    cfg = build_config([("check_nan", True), ("model.moe.overflow", "error")])
    nan, overflow = NonFiniteGuard(cfg), OverflowGuard(cfg)
    assert (nan.stage, overflow.stage) == (BEFORE_RECORD, AFTER_RECORD)
    assert issubclass(NonFiniteError, GuardStop) and issubclass(BufferOverflowError, GuardStop)
    state = overflow.attach({"params": jnp.zeros(()), "step": jnp.zeros((), jnp.int32)})
    # a step the overflow guard has no record against: the after-record stage passes
    check_all((nan, overflow), AFTER_RECORD, state, 1, metrics={"nonfinite": 1}, batch=None,
              force=True, save=None)
    # the before-record stage reads check_nan's flag from the step's metrics
    with pytest.raises(NonFiniteError, match=r"^step 1: loss nan, grad_norm 1; located; the step "
                       r"was not applied; no step had completed, nothing is checkpointed$"):
        check_all((nan, overflow), BEFORE_RECORD, {"params": {}, "opt_state": None}, 1,
                  metrics={"nonfinite": 1, "loss": float("nan"), "grad_norm": 1.0},
                  batch=None, force=False, save=lambda good, state: Path("/r"))


class Keeps(Guard):
    """Keeps `key` in the state and wraps the step to log its name."""

    def __init__(self, key: str, log: list):
        self.active, self.key, self.log = True, key, log

    def attach(self, state):
        self.log.append(f"attach {self.key}")
        return {**state, self.key: len(self.log)}

    def strip(self, state):
        self.log.append(f"strip {self.key}")
        return {k: v for k, v in state.items() if k != self.key}

    def wrap(self, step_fn):
        def wrapped(state, batch):
            self.log.append(f"enter {self.key}")
            return step_fn(state, batch)
        return wrapped


def test_attach_wrap_strip_all_go_through_every_guard_in_order():
    log: list = []
    guards = (Keeps("a", log), Keeps("b", log))
    state = attach_all(guards, {"params": 0})
    assert state == {"params": 0, "a": 1, "b": 2}
    assert wrap_all(guards, lambda state, batch: (state, {}))(state, None) == (state, {})
    assert strip_all(guards, state) == {"params": 0}
    # b wraps a's wrapper, so b's is entered first; b, attached last, is stripped first
    assert log == ["attach a", "attach b", "enter b", "enter a", "strip b", "strip a"]


def test_guards_without_a_record_attach_and_strip_nothing():
    cfg = build_config([("check_nan", True), ("model.moe.overflow", "error")])
    state = {"params": jnp.zeros(()), "step": jnp.zeros((), jnp.int32)}
    nan, overflow = NonFiniteGuard(cfg), OverflowGuard(cfg)
    assert nan.attach(state) is state and nan.strip(state) is state
    assert EveryOther(bad=1).attach(state) is state
    both = attach_all((nan, overflow), state)
    assert set(both) == {"params", "step", "overflow"}
    assert strip_all((nan, overflow), both) == state
    quiet = OverflowGuard(build_config([]))            # overflow="rounds": nothing kept
    assert attach_all((nan, quiet), state) is state and strip_all((nan, quiet), state) == state


def test_tripped_names_field_and_value():
    with pytest.raises(ValueError, match=r"Tripped.bad=0 must be a step number >= 1"):
        Tripped(bad=0)
    assert Tripped(bad=5).good == 4


class _FakeManager:
    def __init__(self, steps):
        self.directory, self.steps, self.saves, self.closed = "/nowhere", list(steps), [], False

    def all_steps(self):
        return self.steps

    def save(self, step, args=None, force=False):
        self.saves.append(step)
        self.steps.append(step)

    def wait_until_finished(self):
        pass

    def is_saving_in_progress(self):
        return False

    def close(self):
        self.closed = True


def test_saver_writes_a_last_good_step_once():
    mngr = _FakeManager([0, 2])
    ckpt.Saver(mngr).save_last_good(2, {"w": jnp.ones(2)}, {"next_batch": 2})
    assert mngr.saves == [] and mngr.closed        # step 2 is a checkpoint already
    mngr = _FakeManager([2])
    saver = ckpt.Saver(mngr)
    saver.save_last_good(3, {"w": jnp.ones(2)}, {"next_batch": 3})
    assert mngr.saves == [3] and saver.last_saved == 3 and mngr.closed
