"""The fault matrix: `dropless train` in subprocesses hit by SIGTERM during a save,
SIGINT twice, SIGINT once, kill -9 during an asynchronous save, a full disk and a read-only
checkpoint directory. What must hold: no step lost beyond the one in flight, a run directory that
resumes, exit statuses that tell the cases apart, and one-line messages without tracebacks.

One module fixture drives everything: a first run compiles the step into a persistent compilation
cache, four more start from it, each is hit by its fault as soon as its condition holds (a save
in progress, a step count), then two runs resume the preempted and the killed ones. The tests
only read what the runs left. Disk full and read-only use real tmpfs mounts (root only, as here
and in CI); without mount rights those two tests skip with the reason.
"""
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dropless.checkpoint import latest_step
from dropless.train.signals import EXIT_PREEMPTED

from tests._support.train_mini import MINI, corpus
from tests._support.paths import SRC

STEPS = 100_000                       # "forever": every run here ends by a fault or a signal


def _argv(tmp: Path, name: str, **kw) -> list[str]:
    items = dict(MINI, data=str(corpus(tmp)), run_dir=str(tmp / "runs"), run_name=name,
                 steps=STEPS, lr_decay_steps=STEPS, eval_every=STEPS, log_every=STEPS,
                 time_kernels=False)   # one step function for every run: compiled once
    items.update(kw)
    return [sys.executable, "-m", "dropless.cli", "train"] + [f"{k}={v}" for k, v in
                                                              items.items()]


class Run:
    """One `dropless train` subprocess and what it left in its run directory."""

    def __init__(self, tmp: Path, name: str, env: dict, **kw):
        self.dir = tmp / "runs" / name
        self.proc = subprocess.Popen(_argv(tmp, name, **kw), env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.out = self.err = ""
        self.early = []                       # stderr lines read while the run was going

    def records(self, event: str = "step") -> list[dict]:
        path = self.dir / "metrics.jsonl"
        if not path.exists():
            return []
        recs = [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")]
        return [r for r in recs if r["event"] == event]

    def steps(self) -> list[int]:
        return [r["step"] for r in self.records()]

    def count(self) -> int:
        """Step records so far (cheap: polled every millisecond)."""
        try:
            return (self.dir / "metrics.jsonl").read_text().count('"event": "step"')
        except FileNotFoundError:
            return 0

    def saving(self) -> bool:
        """A checkpoint is being written right now (orbax's temporary directory exists)."""
        try:
            return any(".orbax-checkpoint-tmp" in e.name
                       for e in os.scandir(self.dir / "checkpoints"))
        except FileNotFoundError:
            return False

    def finish(self, timeout: float = 900.0) -> int:
        if not self.out and not self.err:
            out, err = self.proc.communicate(timeout=timeout)
            self.out, self.err = out, "".join(self.early) + err
        return self.proc.returncode


def _sigint_twice(r: Run) -> None:
    r.complete_before = latest_step(r.dir / "checkpoints")
    r.proc.send_signal(signal.SIGINT)
    while not r.early or "SIGINT received" not in r.early[-1]:   # the handler ran
        r.early.append(r.proc.stderr.readline())
        if not r.early[-1]:
            return
    r.proc.send_signal(signal.SIGINT)


def _drive(runs: dict[str, Run], triggers: dict, timeout: float = 900.0, *,
           finish: bool = True) -> None:
    """Fire each run's fault the moment its condition holds, then (`finish`) wait for every
    run to end."""
    pending, t0 = dict(triggers), time.monotonic()
    while pending and time.monotonic() - t0 < timeout:
        for name, (cond, act) in list(pending.items()):
            r = runs[name]
            if r.proc.poll() is not None:
                del pending[name]             # ended by itself: the test says why
            elif cond(r):
                act(r)
                del pending[name]
        time.sleep(0.001)
    for r in runs.values() if finish else ():
        if r.proc.poll() is None and time.monotonic() - t0 > timeout:
            r.proc.kill()
        r.finish()


def _mount_tmpfs(path: Path, opts: str) -> str | None:
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)],
                       capture_output=True, text=True)
    return None if r.returncode == 0 else (r.stderr.strip() or "mount failed")


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
               JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.getbasetemp() / "jaxcache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", XLA_FLAGS="",
               JAX_PLATFORMS="cpu")
    env.pop("DROPLESS_TRACEBACK", None)
    mounts, why = [], {}
    # the checkpoint directories of these two runs are small / read-only tmpfs mounts
    for name, opts in (("full", "size=256k"), ("readonly", "ro,size=1m")):
        ck = tmp / "runs" / name / "checkpoints"
        why[name] = _mount_tmpfs(ck, opts)
        if why[name] is None:
            mounts.append(ck)
    try:
        yield tmp, _run_matrix(tmp, env, why), why
    finally:
        for ck in mounts:
            subprocess.run(["umount", str(ck)], capture_output=True)


def _run_matrix(tmp: Path, env: dict, why: dict) -> dict:
    # sync saves every step: the signal lands while the main thread is inside a save
    first = Run(tmp, "sigterm", env, checkpoint_every=1, async_checkpoints=False)
    _drive({"sigterm": first}, {"sigterm": (lambda r: r.count() >= 1, lambda r: None)},
           finish=False)
    runs = {"sigterm": first,
            "sigint2": Run(tmp, "sigint2", env, checkpoint_every=2),
            "kill9": Run(tmp, "kill9", env, checkpoint_every=1)}
    for name in ("full", "readonly"):
        if why[name] is None:
            runs[name] = Run(tmp, name, env, checkpoint_every=50)
    try:
        _drive(runs, {
            "sigterm": (lambda r: r.count() >= 3 and r.saving(),
                        lambda r: r.proc.send_signal(signal.SIGTERM)),
            "sigint2": (lambda r: r.count() >= 3 and latest_step(r.dir / "checkpoints"),
                        _sigint_twice),
            "kill9": (lambda r: r.count() >= 4 and r.saving(),
                      lambda r: r.proc.send_signal(signal.SIGKILL))})
        killed = runs["kill9"].records()
        last = (first.steps() or [0])[-1]
        runs["sigterm_resumed"] = Run(tmp, "sigterm", env, checkpoint_every=1000)
        runs["kill9_resumed"] = Run(tmp, "kill9", env, checkpoint_every=1,
                                    steps=max([x["step"] for x in killed] or [0]) + 2)
        runs["kill9"].killed = killed
        runs["sigterm"].stopped_at = last
        _drive(runs, {"sigterm_resumed": (lambda r: r.count() >= last + 2,
                                          lambda r: r.proc.send_signal(signal.SIGINT))})
    finally:
        for r in runs.values():
            if r.proc.poll() is None:
                r.proc.kill()
    return runs


def _no_traceback(run: Run) -> None:
    assert "Traceback" not in run.err + run.out, run.err[-3000:]


def test_sigterm_during_a_save_checkpoints_and_resumes_with_sigint(matrix):
    _, runs, _ = matrix
    r, again = runs["sigterm"], runs["sigterm_resumed"]
    assert r.proc.returncode == EXIT_PREEMPTED, r.err
    _no_traceback(r)
    last = r.stopped_at
    resume = [x for x in (r.out + r.err).splitlines() if "resume with:" in x]
    assert resume == [f"stopped by SIGTERM at step {last}, checkpoint saved; "
                      f"resume with: dropless train --resume {r.dir}"]
    assert r.records("stopped")[0]["step"] == last and r.steps()[last - 1] == last
    # the step in flight was saved too; the save the signal interrupted finished
    assert last in [int(p.name) for p in (r.dir / "checkpoints").iterdir() if p.name.isdigit()]
    # the resume continued at last + 1 and a single SIGINT stopped it the same way
    assert again.proc.returncode == EXIT_PREEMPTED, again.err
    _no_traceback(again)
    steps = again.steps()
    assert steps == list(range(1, steps[-1] + 1)) and steps[-1] >= last + 2
    assert latest_step(r.dir / "checkpoints") == steps[-1]
    assert "SIGINT received" in again.err and "resume with:" in again.out
    assert not r.saving()


def test_second_sigint_exits_at_once(matrix):
    _, runs, _ = matrix
    r = runs["sigint2"]
    assert r.proc.returncode == 128 + signal.SIGINT, r.err
    _no_traceback(r)
    assert "second SIGINT: exiting now" in r.err and "resume with:" not in r.out
    # the checkpoints complete before the signals are intact
    assert latest_step(r.dir / "checkpoints") >= r.complete_before > 0


def test_kill9_during_a_save_resumes_from_the_last_complete_checkpoint(matrix):
    _, runs, _ = matrix
    r, again = runs["kill9"], runs["kill9_resumed"]
    assert r.proc.returncode == -signal.SIGKILL
    killed = {x["step"]: x["loss"] for x in r.killed}
    assert again.proc.returncode == 0, again.err
    _no_traceback(again)
    resumed = {x["step"]: x["loss"] for x in again.records()[len(killed):]}
    start = again.records("start")[-1]["resumed_from"]
    # async saves every step: lost at most the step being saved and the one computed meanwhile
    assert max(killed) - start <= 2, (start, sorted(killed))
    assert min(resumed) == start + 1 and max(resumed) == max(killed) + 2
    for s in set(killed) & set(resumed):      # steps run twice give the same loss bitwise
        assert resumed[s] == killed[s], s


@pytest.mark.parametrize("name, why", [("full", "no space left on the device"),
                                       ("readonly", "the file system is read-only")])
def test_checkpoint_write_failure_stops_at_the_next_step(matrix, name, why):
    _, runs, reasons = matrix
    if reasons[name] is not None:
        pytest.skip(f"cannot mount a tmpfs for the checkpoints: {reasons[name]}")
    r = runs[name]
    assert r.proc.returncode == 1, r.out + r.err
    _no_traceback(r)
    # one line from us; orbax may add its own "WARNING:absl:" notes about slow saves
    err = [x for x in r.err.strip().splitlines() if not x.startswith("WARNING:absl:")]
    assert len(err) == 1, r.err[-3000:]
    assert err[0].startswith("dropless: error: checkpoint of step 50 could not be written to ")
    assert why in err[0] and f"resume with: dropless train --resume {r.dir}" in err[0]
    assert 50 <= r.steps()[-1] < 100                  # stopped before the next save
    assert (r.dir / "config.json").exists()          # the run directory itself is intact


def _late_write_callback() -> None:
    """What a failed save's still-running tensorstore write does when it ends: it
    wakes its awaiting task on the save's event loop, which orbax already closed."""
    import asyncio
    import tensorstore as ts
    promise, fut = ts.Promise.new()

    async def wait():
        await fut
    loop = asyncio.new_event_loop()
    task = loop.create_task(wait())
    loop.call_soon(loop.stop)
    loop.run_forever()                # the task now awaits the write
    loop.close()
    promise.set_result(None)          # -> loop.call_soon_threadsafe -> 'Event loop is closed'
    task._log_destroy_pending = False  # noqa: SLF001 - this test's own task, not the point


@pytest.mark.parametrize("reported", [True, False])
def test_late_write_callbacks_are_dropped_only_after_the_failure_is_reported(monkeypatch,
                                                                             reported):
    from dropless.checkpoint import CheckpointError, quiet_orbax_errors
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(repr(u.exc_value)))
    _late_write_callback()
    assert seen == ["RuntimeError('Event loop is closed')"]   # tensorstore's default path
    seen.clear()
    with pytest.raises(CheckpointError) if reported else contextlib.nullcontext():
        with quiet_orbax_errors():
            _late_write_callback()
            assert seen == []                                  # held back
            sys.unraisablehook(type("U", (), dict(object="x", err_msg=None, exc_traceback=None,
                                                  exc_value=ValueError("other")))())
            assert seen == ["ValueError('other')"]             # anything else passes
            if reported:
                raise CheckpointError("no space left")
    if reported:
        _late_write_callback()                                 # writes still ending later
    assert seen == ["ValueError('other')"] + ([] if reported else
                                             ["RuntimeError('Event loop is closed')"])


def _signal_during_startup(tmp: Path, signum: int, when: str) -> tuple[subprocess.Popen, str,
                                                                          str, float]:
    """Start `dropless train` (the MINI model without a compilation cache: its first compile
    takes seconds) and send `signum` as soon as stdout shows `when` (a marker the program prints,
    not a delay); (process, stdout, stderr, seconds from the signal to the exit)."""
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
               XLA_FLAGS="", JAX_PLATFORMS="cpu")
    for k in ("DROPLESS_TRACEBACK", "JAX_COMPILATION_CACHE_DIR"):
        env.pop(k, None)
    items = dict(MINI, data=str(corpus(tmp)), run_dir=str(tmp / "runs"), run_name="sig",
                 steps=3, time_kernels=True)
    argv = [sys.executable, "-m", "dropless.cli", "train"] + [f"{k}={v}" for k, v in
                                                              items.items()]
    p = subprocess.Popen(argv, env=env, text=True, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    seen = []
    for line in p.stdout:             # when="": the first line (the handlers are installed)
        seen.append(line)
        if when in line:
            break
    t0 = time.monotonic()
    p.send_signal(signum)
    out, err = p.communicate(timeout=120)
    return p, "".join(seen) + out, err, time.monotonic() - t0


@pytest.mark.parametrize("signum, when", [
    pytest.param(signal.SIGTERM, "compiling (first step)", id="SIGTERM-while-compiling"),
    pytest.param(signal.SIGINT, "", id="SIGINT-during-start-up")])   # before the run dir
def test_signal_during_startup_exits_at_once_and_leaves_no_run(tmp_path, signum, when):
    p, out, err, seconds = _signal_during_startup(tmp_path, signum, when)
    name = signal.Signals(signum).name
    assert p.returncode == EXIT_PREEMPTED, (p.returncode, out, err)
    assert seconds < 5.0, f"{seconds:.1f} s from {name} to the exit"
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"dropless: {name} during start-up"), err
    assert "no step was done (nothing to save)" in lines[0], err
    if "compiling" in when:          # the run directory exists before the compile starts
        assert "the new run directory" in lines[0] and "was removed" in lines[0], lines[0]
    else:
        # the first line is printed before the run directory is made, but the process goes on
        # while the signal travels: it may arrive before the directory is made (nothing to say)
        # or after (the new directory is removed and the line says so); either way no run stays
        removed = "was removed" in lines[0]
        assert lines[0].endswith("(nothing to save)") or removed, lines[0]
    assert "resume with" not in out + err
    # nothing a later `--resume` (or a run of the same name) would trip over
    assert not (tmp_path / "runs" / "sig").exists()
