"""Fault rows: what a run directory is, and readers and writers at once.

* A folder is trained into only if dropless made it (its `.dropless-run` marker, or a run made
  before the marker existed, recognised by config.json + checkpoints/): a Hugging Face model
  folder, a `dropless convert` output or any other non-empty folder named as the run is refused
  in one line saying what it looks like, byte-identical; path mistakes (a nested run_name, a file
  where run_dir's folder belongs) are exit 2 before anything is made.
* A live run is read while it trains: `eval` of a run whose trainer saves a checkpoint every
  step and keeps only one reads the newest complete step; neither side calls a step damaged.
* `convert` to one destination is exclusive: a second writer is refused in one line and changes
  nothing (a lock left by a writer that died: tests/hf/test_destination.py).
* The one reader falls back: `eval` and `convert` of a run whose newest step is damaged read
  the older one, say so in one line and move the damaged one aside (`generate` and `init_from`
  load through the same `model_dir.load_dropless`); a `dropless convert` output with changed
  bytes is refused (its hashes), not loaded.
"""
from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests._support import ckpt_damage
from tests._support.fault import Fault, Result
from tests._support.faults_ckpt import STEPS
from tests._support.paths import HF_FIXTURES
from tests._support.train_mini import MINI

RUN = "run"
MARKER = ".dropless-run"
_LIVE: dict[str, subprocess.Popen] = {}      # case dir -> the background process of its row


def _runs_hf(case: Path, artifacts=None) -> None:
    shutil.copytree(HF_FIXTURES / "qwen3_moe", case / "runs" / "qwen")


def _runs_converted(case: Path, artifacts) -> None:
    (case / "runs").mkdir()
    artifacts.copy("model_dropless", case / "runs")          # runs/dl: config.json + params/


def _runs_other(case: Path, artifacts=None) -> None:
    (case / "runs" / "notes").mkdir(parents=True)
    (case / "runs" / "notes" / "todo.txt").write_text("buy milk\n")


def _train(case: Path, name: str, *extra: str) -> list:
    return ["train", f"run_dir={case / 'runs'}", f"run_name={name}", "steps=1", *extra]


def _nothing_made(case: Path) -> None:
    assert not (case / "runs").exists(), "run_dir was made for a refused run_name"


def _older_run(case: Path, artifacts) -> None:
    """The trained run as a version before the marker left it: no `.dropless-run`."""
    artifacts.copy("ckpt-run", case)
    (case / RUN / MARKER).unlink()


def _marked(case: Path, res: Result) -> None:
    marker = json.loads((case / RUN / MARKER).read_text())
    assert isinstance(marker["dropless"], str) and marker["created"], marker
    steps = [json.loads(x) for x in (case / RUN / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if r.get("event") == "step"][-1] == 5


# ---- a live run read while it trains ----------------------------------------------------------

def _live_run(case: Path, artifacts) -> None:
    """The trained run, resumed in the background with a checkpoint every step and only one
    kept (a save and a rotation at every step); returns once it has saved past step 4."""
    artifacts.copy("ckpt-run", case)
    proc = subprocess.Popen(
        [sys.executable, "-m", "dropless.cli", "train", "--resume", str(case / RUN),
         "steps=100000", "checkpoint_every=1", "keep_checkpoints=1"],
        env=artifacts.env, cwd=case, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, stdin=subprocess.DEVNULL)
    _LIVE[str(case)] = proc
    deadline = time.monotonic() + 300
    while not any(s > 5 for s in _steps(case / RUN / "checkpoints")):
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "the background run saved nothing past step 5"
        time.sleep(0.1)


def _steps(d: Path) -> list[int]:
    return [int(p.name) for p in d.iterdir() if p.name.isdigit()] if d.is_dir() else []


def _live_ok(case: Path, res: Result) -> None:
    proc = _LIVE.pop(str(case))
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode in (0, 75), out[-3000:]
    assert "damaged" not in out and "damaged" not in res.err, (out[-3000:], res.err)
    assert not (case / RUN / "checkpoints" / "damaged").exists()
    assert '"loss"' in res.out


def _corpus(case: Path) -> str:
    return str(case / "corpus.txt")


def _eval_run(case: Path) -> list:
    return ["eval", case / RUN, "--data", _corpus(case), "--seq-len", "16", "--batch-size", "1",
            "--max-batches", "1", "--tokenizer", "byte"]


# ---- one writer per convert destination --------------------------------------------------------

# what a running convert holds (hf.destination.claimed), taken without importing dropless
_HOLD = ("import fcntl, os, sys, time\nfd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
         "fcntl.flock(fd, fcntl.LOCK_EX)\nos.write(fd, str(os.getpid()).encode())\n"
         "print('held', flush=True)\ntime.sleep(120)\n")


def _held_destination(case: Path, artifacts) -> None:
    """Another process holds destination `out` (as a running convert does)."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(case / ".out.lock")],
                            env=artifacts.env, cwd=case, stdout=subprocess.PIPE, text=True)
    _LIVE[str(case)] = proc
    assert proc.stdout.readline().strip() == "held"


def _release(case: Path, res: Result) -> None:
    proc = _LIVE.pop(str(case))
    proc.kill()
    proc.wait()
    assert not (case / "out").exists()


# ---- every reader falls back --------------------------------------------------------------------

def _damaged_run(case: Path, artifacts) -> None:
    artifacts.copy("ckpt-run", case)
    ckpt_damage.flip_param(case / RUN, 4)


def _set_aside(case: Path, res: Result) -> None:
    assert (case / RUN / "checkpoints" / "damaged" / "4-hash-mismatch").is_dir()
    assert sorted(_steps(case / RUN / "checkpoints")) == [2]


def _flipped_model(case: Path, artifacts) -> None:
    artifacts.copy("model_dropless", case)
    ckpt_damage.flip_values(case / "dl", under="params")
    (case / "d.txt").write_text("hello world, hello there. " * 4)


FALLBACK = ("checkpoint 4 is damaged", "hash", "step 2, the newest intact checkpoint",
            "damaged/4-hash-mismatch")

ROWS = [
    Fault("rundir-hf-folder-as-run", lambda c: _train(c, "qwen"), rc=2, setup=_runs_hf,
          words=("not a dropless run", "Hugging Face model folder", "init_from=hf:",
                 "nothing was changed"), unchanged=("runs",), in_process=True),
    Fault("rundir-converted-model-as-run", lambda c: _train(c, "dl"), rc=2,
          setup=_runs_converted, unchanged=("runs",), in_process=True,
          words=("not a dropless run", "dropless model directory", "init_from=")),
    Fault("rundir-other-folder-as-run", lambda c: _train(c, "notes"), rc=2, setup=_runs_other,
          words=("not a dropless run", "something else", "todo.txt", "new run_name"),
          unchanged=("runs",), in_process=True),
    Fault("rundir-resume-an-hf-folder", lambda c: ["train", "--resume", c / "runs" / "qwen"],
          rc=2, setup=_runs_hf, unchanged=("runs",), in_process=True,
          words=("not a training run", "init_from=")),
    Fault("rundir-nested-run-name", lambda c: _train(c, "a/b"), rc=2, in_process=True,
          words=("run_name='a/b'", "one folder name", "run_dir="),
          check=lambda c, r: _nothing_made(c)),
    Fault("rundir-run-dir-is-a-file", lambda c: _train(c, "x"), rc=2, in_process=True,
          setup=lambda c, a: (c / "runs").write_text("not a folder"), unchanged=("runs",),
          words=("run_dir=", "is a file", "set run_dir")),
    Fault("rundir-run-dir-under-a-file",
          lambda c: ["train", f"run_dir={c / 'f' / 'runs'}", "steps=1"], rc=2, in_process=True,
          setup=lambda c, a: (c / "f").write_text("x"), unchanged=("f",),
          words=("run_dir=", "is a file")),
    Fault("rundir-run-from-before-the-marker-resumes",
          lambda c: ["train", "--resume", c / RUN, "steps=5"], rc=0, setup=_older_run,
          words=("resuming at step 4",), check=_marked),
    Fault("rundir-live-run-read-by-eval", _eval_run, rc=0, setup=_live_run, check=_live_ok),
    Fault("rundir-convert-destination-held", ["convert", str(HF_FIXTURES / "qwen3_moe"), "out"],
          rc=2, setup=_held_destination, unchanged=(".",), check=_release, in_process=True,
          words=("destination out", "being written by another dropless process", "pid")),
    Fault("rundir-eval-falls-back", _eval_run, rc=0, setup=_damaged_run, words=FALLBACK,
          check=_set_aside),
    Fault("rundir-convert-of-a-run-falls-back", lambda c: ["convert", c / RUN, c / "hf"], rc=0,
          setup=_damaged_run, words=FALLBACK + ("wrote hugging face folder",),
          check=_set_aside),
    Fault("rundir-converted-model-with-changed-bytes",
          ["eval", "dl", "--data", "d.txt", "--seq-len", "8", "--batch-size", "1",
           "--tokenizer", "byte"], rc=2, setup=_flipped_model, unchanged=("dl",),
          words=("dl/params is damaged", "xxh3_64", "dropless convert")),
]


# ---- a run file that is not a regular file: refused before the step is compiled --------------

def _metrics_not_a_file(kind: str):
    def setup(case: Path, artifacts) -> None:
        import os
        artifacts.copy("ckpt-run", case)
        metrics = case / RUN / "metrics.jsonl"
        metrics.unlink()
        {"folder": metrics.mkdir, "fifo": lambda: os.mkfifo(metrics)}[kind]()
    return setup


def _not_compiled(case: Path, res: Result) -> None:
    assert "compil" not in res.out + res.err, res.out + res.err


ROWS += [Fault(f"rundir-metrics-a-{kind}", ["train", "--resume", RUN, "steps=6"], rc=2,
               setup=_metrics_not_a_file(kind), words=("run/metrics.jsonl", word, "move it"),
               unchanged=(f"{RUN}/checkpoints",), check=_not_compiled)
         for kind, word in (("folder", "is a folder"), ("fifo", "special file"))]



# ---- init_from=RUN says which step it starts from ----------------------------------------------

def _run_and_text(case: Path, artifacts) -> None:
    artifacts.copy("ckpt-run", case)
    (case / "d.txt").write_text("def f(x):\n    return x + 1\n" * 400)


# the fine-tune keeps the trained run's batch and learning-rate schedule: its step is then the
# program the run compiled (read from the persistent compilation cache), not a second compile;
# which step init_from reads does not depend on them
SAME_STEP = [f"{k}={MINI[k]}" for k in ("per_device_batch_size", "learning_rate",
                                        "warmup_steps")] + [f"lr_decay_steps={STEPS}"]

ROWS += [Fault("rundir-init-from-run-names-its-step",
               ["train", f"init_from={RUN}", "run_dir=runs", "run_name=ft", "steps=1",
                "data=d.txt", "seq_len=32", "time_kernels=false", "eval_every=1", *SAME_STEP],
               rc=0,
               setup=_run_and_text, unchanged=(RUN,),
               words=(f"init_from='{RUN}': read the parameters of step 4",
                      "newest intact checkpoint"))]