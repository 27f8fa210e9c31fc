"""Fault rows: damaged checkpoints, refused resumes, torn metrics.jsonl, `report` on broken runs.

One trained run (BUILDERS["ckpt-run"]: the MINI model, 4 steps, checkpoints at 2 and 4) is
copied into each case directory as `run/` and damaged there the way users and crashes damage
runs: step 4's largest data file with three bits flipped, cut in half, deleted or replaced by a
directory; its `_METADATA` or `meta/metadata` emptied or garbled; its manifests or `state/`
removed; an empty newer step folder. A resume over each falls back to step 2, says why in one
line, moves the damaged step to checkpoints/damaged/ (never deletes it), records a "fallback"
event, and trains steps 3.. bitwise as the uninterrupted run did; with --strict-resume it is
refused in one line and the run directory is byte-identical.

A refusal read from the run's files before anything is computed (a damaged step's metadata, no
checkpoint, a folder that is not a run, a `report`) runs in-process; a resume that trains, and a
refusal that needs the arrays' hashes (it reads them), run `dropless` in a subprocess.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests._support import ckpt_damage
from tests._support.fault import Fault, Result, snapshot
from tests._support.train_mini import MINI, TEXT

RUN = "run"
STEPS = 4   # the steps of the trained run (its learning-rate schedule's horizon)


def build_run(dest: Path, env: dict) -> None:
    """`dropless train` of the MINI model for 4 steps into dest/run (checkpoints 2 and 4)."""
    import subprocess
    import sys
    (dest / "corpus.txt").write_text(TEXT)
    items = dict(MINI, data=str(dest / "corpus.txt"), run_dir=str(dest), run_name=RUN,
                 steps=STEPS, checkpoint_every=2, keep_checkpoints=5, time_kernels=False)
    subprocess.run([sys.executable, "-m", "dropless.cli", "train"]
                   + [f"{k}={v}" for k, v in items.items()],
                   env=env, check=True, capture_output=True, timeout=600)


BUILDERS = {"ckpt-run": build_run}
_DAMAGED_BEFORE: dict[str, dict] = {}   # case dir -> the damaged step's files after setup


def _biggest_chunk(step: Path) -> Path:
    return max((p for p in (step / "state").glob("**/d/*") if p.is_file()),
               key=lambda p: p.stat().st_size)


def _flip(step: Path) -> None:
    """A byte of an array chunk changed where it still decodes, to other values (see
    ckpt_damage: placed from the zstd framing, never at a fixed offset)."""
    ckpt_damage.flip_values(step)


def _truncate(step: Path) -> None:
    p = _biggest_chunk(step)
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _delete(step: Path) -> None:
    _biggest_chunk(step).unlink()


def _unreadable(step: Path) -> None:        # root reads a chmod 000 file: a directory instead
    p = _biggest_chunk(step)
    p.unlink()
    p.mkdir()


def _manifests(step: Path) -> None:
    for m in (step / "state").glob("**/manifest.ocdbt"):
        m.unlink()


DAMAGE = {
    "flipped-bits": _flip,
    "truncated-data": _truncate,
    "deleted-data": _delete,
    "unreadable-data": _unreadable,
    "broken-framing": ckpt_damage.break_framing,
    "empty-state-metadata": lambda s: (s / "state" / "_METADATA").write_text(""),
    "corrupt-meta": lambda s: (s / "meta" / "metadata").write_text("{not json"),
    "removed-manifests": _manifests,
    "removed-state": lambda s: shutil.rmtree(s / "state"),
    # metadata that parses but holds the wrong types is damage too
    "corpus-a-list": lambda s: _meta(s, corpus=[1, 2]),
    "checkpoint-metadata-a-list": lambda s: (s / "_CHECKPOINT_METADATA").write_text("[]"),
}


def _meta(step: Path, **values) -> None:
    path = step / "meta" / "metadata"
    path.write_text(json.dumps({**json.loads(path.read_text()), **values}))


def _setup(damage, steps=(4,)):
    def setup(case: Path, artifacts) -> None:
        artifacts.copy("ckpt-run", case)
        for s in steps:
            damage(case / RUN / "checkpoints" / str(s))
        _DAMAGED_BEFORE[str(case)] = {s: snapshot(case / RUN / "checkpoints" / str(s))
                                      for s in steps}
    return setup


def _records(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _recovered(step: int, end: int):
    """The resume fell back to step 2: the damaged `step` moved aside byte-identical, a
    "fallback" record, steps 3..end trained, bitwise as the uninterrupted run (steps 3, 4)."""
    def check(case: Path, res: Result) -> None:
        run = case / RUN
        moved = sorted((run / "checkpoints" / "damaged").glob(f"{step}-*"))
        assert len(moved) == 1, moved
        assert snapshot(moved[0]) == _DAMAGED_BEFORE[str(case)][step], "damaged step changed"
        recs = _records(run)
        fb = [r for r in recs if r["event"] == "fallback"]
        assert len(fb) == 1 and fb[0]["resumed_from"] == 2, fb
        assert fb[0]["damaged"][0]["step"] == step
        assert fb[0]["damaged"][0]["moved_to"] == str(moved[0].relative_to(run))
        start = recs.index(fb[0])
        before = {r["step"]: r["loss"] for r in recs[:start] if r["event"] == "step"}
        after = {r["step"]: r["loss"] for r in recs[start:] if r["event"] == "step"}
        assert sorted(after) == list(range(3, end + 1)), sorted(after)
        for s in (3, 4):
            assert after[s] == before[s], (s, after[s], before[s])   # bitwise
        assert sorted(int(p.name) for p in (run / "checkpoints").iterdir()
                      if p.name.isdigit())[-1] == end
    return check


def _resume(*extra: str, steps: int = 5):
    return lambda case: ["train", "--resume", case / RUN, *extra, f"steps={steps}"]


ROWS = [
    Fault(f"ckpt-fallback-{name}", _resume(), rc=0, setup=_setup(fn),
          words=("checkpoint 4 is damaged", "resuming from step 2", "checkpoints/damaged/4-"),
          check=_recovered(4, 5))
    for name, fn in DAMAGE.items()
] + [
    Fault("ckpt-fallback-empty-newer-step", _resume(steps=6), rc=0,
          setup=lambda case, a: (a.copy("ckpt-run", case),
                                 (case / RUN / "checkpoints" / "6").mkdir()),
          words=("checkpoint 6 is damaged", "empty"),
          check=lambda case, res: _empty_newer(case)),
    Fault("ckpt-strict-flipped-bits", _resume("--strict-resume"), rc=2, setup=_setup(_flip),
          words=("--strict-resume", "checkpoint 4 is damaged", "hash", "step 2"),
          unchanged=(RUN,)),
    Fault("ckpt-strict-corrupt-meta", _resume("--strict-resume"), rc=2,
          setup=_setup(DAMAGE["corrupt-meta"]),
          words=("--strict-resume", "checkpoint 4", "checkpoints/4/meta/metadata"),
          unchanged=(RUN,), in_process=True),
    Fault("ckpt-strict-next-batch-not-an-int", _resume("--strict-resume"), rc=2,
          setup=_setup(lambda s: _meta(s, next_batch="4")), in_process=True,
          words=("--strict-resume", "checkpoint 4", "next_batch='4'", "not an int"),
          unchanged=(RUN,)),
    Fault("ckpt-strict-empty-checkpoint-metadata", _resume("--strict-resume"), rc=2,
          setup=_setup(lambda s: (s / "_CHECKPOINT_METADATA").write_text("{}")),
          in_process=True, unchanged=(RUN,),
          words=("--strict-resume", "checkpoints/4/_CHECKPOINT_METADATA", "not a non-empty")),
    Fault("ckpt-every-step-damaged", _resume(), rc=2,
          setup=_setup(DAMAGE["corrupt-meta"], steps=(4, 2)),
          words=("no intact checkpoint", "checkpoint 4", "checkpoint 2", "init_from="),
          unchanged=(RUN,), in_process=True),
    Fault("ckpt-resume-without-checkpoints", _resume(), rc=2,
          setup=lambda case, a: (a.copy("ckpt-run", case),
                                 shutil.rmtree(case / RUN / "checkpoints")),
          words=("has no checkpoint", "drop --resume", "init_from="), unchanged=(RUN,),
          in_process=True),
    Fault("ckpt-resume-a-model-directory", lambda case: ["train", "--resume", case / "model"],
          rc=2, setup=lambda case, a: _model_dir(case / "model"),
          words=("not a training run", "init_from=", "drop --resume"), unchanged=("model",),
          in_process=True),
    Fault("ckpt-torn-metrics-healed", _resume(), rc=0,
          setup=lambda case, a: _tear(a.copy("ckpt-run", case) / RUN),
          words=("cut a torn last line", "last complete record"),
          check=lambda case, res: _healed(case / RUN)),
    Fault("ckpt-report-reads-past-a-torn-line", lambda case: ["report", case / "r"], rc=0,
          setup=lambda case, a: _torn_report(case / "r"), words=("line 3", "skipped"),
          in_process=True),
    Fault("ckpt-report-run-without-steps", lambda case: ["report", case / "r"], rc=2,
          setup=lambda case, a: _no_steps(case / "r"),
          words=("no step records", "metrics.jsonl", "no plots"), unchanged=("r",),
          in_process=True),
]


def _empty_newer(case: Path) -> None:
    run = case / RUN
    assert (run / "checkpoints" / "damaged" / "6-empty").is_dir()
    recs = _records(run)
    assert [r["resumed_from"] for r in recs if r["event"] == "fallback"] == [4]
    assert [r["step"] for r in recs if r["event"] == "step"][-2:] == [5, 6]


def _model_dir(path: Path) -> None:
    """What `dropless convert` writes: config.json (a model's) and params/."""
    (path / "params").mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"d_model": 32, "vocab_size": 256}))


def _tear(run: Path) -> None:
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write('{"event": "step", "step": 5, "loss": 4.2')      # killed mid-write


def _healed(run: Path) -> None:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    recs = [json.loads(x) for x in lines]                       # every line whole again
    assert [r["step"] for r in recs if r["event"] == "step"] == [1, 2, 3, 4, 5]


def _step(s: int) -> dict:
    return {"event": "step", "step": s, "loss": 5.0 - s / 10, "step_time_s": 0.5,
            "tokens_per_s": 4000.0, "tflops_per_device": 0.02, "mfu": 0.1,
            "dropped_tokens": 0}


def _torn_report(d: Path) -> None:
    d.mkdir()
    lines = [json.dumps({"event": "start"}), json.dumps(_step(1)),
             '{"event": "step", "step": 2, "lo' + json.dumps({"event": "start"}),   # appended on
             json.dumps(_step(2)), json.dumps(_step(3))]
    (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def _no_steps(d: Path) -> None:
    d.mkdir()
    (d / "metrics.jsonl").write_text(json.dumps({"event": "start"}) + "\n")
