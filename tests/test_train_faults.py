"""The fault matrix (issue 11): `dropless train` in subprocesses hit by SIGTERM during a save,
SIGINT twice, SIGINT once, kill -9 during an asynchronous save, a full disk and a read-only
checkpoint directory. What must hold: no step lost beyond the one in flight, a run directory that
resumes, exit statuses that tell the cases apart, and one-line messages without tracebacks.

The five first runs start together (they mostly wait), then the two resumes; all share one small
config and one persistent compilation cache. Disk full and read-only use real tmpfs mounts
(root only, as here and in CI); without mount rights those two tests skip with the reason.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dropless.train.checkpoint import latest_step
from dropless.train.signals import EXIT_PREEMPTED

from _train_mini import MINI, corpus

SRC = str(Path(__file__).resolve().parents[1] / "src")
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

    def records(self, event: str = "step") -> list[dict]:
        path = self.dir / "metrics.jsonl"
        if not path.exists():
            return []
        recs = [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")]
        return [r for r in recs if r["event"] == event]

    def steps(self) -> list[int]:
        return [r["step"] for r in self.records()]

    def wait_for(self, cond, what: str, timeout: float = 600.0, poll: float = 0.001) -> None:
        t0 = time.monotonic()
        while not cond():
            if self.proc.poll() is not None:
                self.finish()
                pytest.fail(f"{self.dir.name} exited ({self.proc.returncode}) before {what}:\n"
                            f"{self.out}\n{self.err}")
            if time.monotonic() - t0 > timeout:
                self.proc.kill()
                pytest.fail(f"{self.dir.name}: timed out waiting for {what} (steps done: "
                            f"{len(self.steps())})")
            time.sleep(poll)

    def saving(self) -> bool:
        """A checkpoint is being written right now (orbax's temporary directory exists)."""
        try:
            return any(".orbax-checkpoint-tmp" in e.name
                       for e in os.scandir(self.dir / "checkpoints"))
        except FileNotFoundError:
            return False

    def finish(self, timeout: float = 600.0) -> int:
        self.out, self.err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode


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
    # sync saves every step: the signal lands while the main thread is inside a save
    first = Run(tmp, "sigterm", env, checkpoint_every=1, async_checkpoints=False)
    first.wait_for(lambda: first.steps(), "its first step (compiling into the shared cache)")
    runs = {
        "sigterm": first,
        "sigint2": Run(tmp, "sigint2", env, checkpoint_every=2),
        "kill9": Run(tmp, "kill9", env, checkpoint_every=1),
    }
    for name in ("full", "readonly"):
        if why[name] is None:
            runs[name] = Run(tmp, name, env, checkpoint_every=50)
    yield tmp, env, runs, why
    for r in runs.values():
        if r.proc.poll() is None:
            r.proc.kill()
    for ck in mounts:
        subprocess.run(["umount", str(ck)], capture_output=True)


def _no_traceback(run: Run) -> None:
    assert "Traceback" not in run.err + run.out, run.err[-3000:]


def test_sigterm_during_a_save_checkpoints_and_resumes_with_sigint(matrix):
    tmp, env, runs, _ = matrix
    r = runs["sigterm"]
    r.wait_for(lambda: len(r.steps()) >= 3 and r.saving(), "a save after step 3")
    r.proc.send_signal(signal.SIGTERM)
    assert r.finish() == EXIT_PREEMPTED, r.err
    _no_traceback(r)
    resume = [x for x in (r.out + r.err).splitlines() if "resume with:" in x]
    assert resume == [f"stopped by SIGTERM at step {r.steps()[-1]}, checkpoint saved; "
                      f"resume with: dropless train --resume {r.dir}"]
    last = r.steps()[-1]
    assert r.records("stopped")[-1]["step"] == last
    assert latest_step(r.dir / "checkpoints") == last       # the step in flight was saved too
    assert not r.saving()                                    # the save it interrupted finished
    # resume it, and stop that with a single SIGINT
    again = Run(tmp, "sigterm", env, checkpoint_every=1000)
    again.wait_for(lambda: len(again.steps()) >= last + 2, "two resumed steps")
    again.proc.send_signal(signal.SIGINT)
    assert again.finish() == EXIT_PREEMPTED, again.err
    _no_traceback(again)
    steps = again.steps()
    assert steps[:last + 1] == list(range(1, last + 2))     # continued at last + 1
    assert latest_step(r.dir / "checkpoints") == steps[-1]
    assert "SIGINT received" in again.err and "resume with:" in again.out


def test_second_sigint_exits_at_once(matrix):
    _, _, runs, _ = matrix
    r = runs["sigint2"]
    r.wait_for(lambda: len(r.steps()) >= 3, "step 3")
    r.proc.send_signal(signal.SIGINT)
    before = []
    while not before or "SIGINT received" not in before[-1]:   # the handler ran
        before.append(r.proc.stderr.readline())
        assert before[-1], "".join(before)
    r.proc.send_signal(signal.SIGINT)
    assert r.finish() == 128 + signal.SIGINT, r.err
    _no_traceback(r)
    assert "second SIGINT: exiting now" in r.err and "resume with:" not in r.out
    assert latest_step(r.dir / "checkpoints") is not None   # the complete ones are intact


def test_kill9_during_a_save_resumes_from_the_last_complete_checkpoint(matrix):
    tmp, env, runs, _ = matrix
    r = runs["kill9"]
    r.wait_for(lambda: len(r.steps()) >= 4 and r.saving(), "a save after step 4")
    r.proc.send_signal(signal.SIGKILL)
    r.finish()
    killed = {x["step"]: x["loss"] for x in r.records()}
    latest = latest_step(r.dir / "checkpoints")
    # async saves every step: at most the step being saved and the one computed meanwhile
    assert latest is not None and max(killed) - latest <= 2, (latest, sorted(killed))
    again = Run(tmp, "kill9", env, checkpoint_every=1, steps=max(killed) + 2)
    assert again.finish() == 0, again.err
    _no_traceback(again)
    resumed = {x["step"]: x["loss"] for x in again.records()[len(killed):]}
    assert min(resumed) == latest + 1 and max(resumed) == max(killed) + 2
    for s in set(killed) & set(resumed):      # steps run twice give the same loss bitwise
        assert resumed[s] == killed[s], s


@pytest.mark.parametrize("name, why", [("full", "no space left on the device"),
                                       ("readonly", "the file system is read-only")])
def test_checkpoint_write_failure_stops_at_the_next_step(matrix, name, why):
    _, _, runs, reasons = matrix
    if reasons[name] is not None:
        pytest.skip(f"cannot mount a tmpfs for the checkpoints: {reasons[name]}")
    r = runs[name]
    assert r.finish() == 1, r.out + r.err
    _no_traceback(r)
    # one line from us; orbax may add its own "WARNING:absl:" notes about slow saves
    err = [x for x in r.err.strip().splitlines() if not x.startswith("WARNING:absl:")]
    assert len(err) == 1, r.err[-3000:]
    assert err[0].startswith("dropless: error: checkpoint of step 50 could not be written to ")
    assert why in err[0] and f"resume with: dropless train --resume {r.dir}" in err[0]
    assert 50 <= r.steps()[-1] < 100                  # stopped before the next save
    assert (r.dir / "config.json").exists()          # the run directory itself is intact
