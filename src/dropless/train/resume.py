"""Resume is transactional: everything a resume could refuse is checked before anything in the
run directory changes.

`plan_resume` reads the run's newest complete checkpoint (names and its small JSON record only)
and its config.json, and decides: start fresh (no checkpoint), "nothing to do" (the checkpoint is
already at or past the last step asked for), refuse (other data), or continue. It also settles
the learning-rate schedule when `steps` changes: the cosine keeps the horizon the run started
with (`lr_decay_steps` is pinned to it), unless `lr_decay_steps` is given explicitly, in which
case the change is announced with the LR before and after at the resume step. Shapes and dtypes
are compared with the checkpoint by `checkpoint.check_compatible`, also before any write.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable

from dropless.config import TrainConfig
from dropless.train import checkpoint as ckpt


@dataclasses.dataclass(frozen=True)
class ResumePlan:
    cfg: TrainConfig                 # the config to run (lr_decay_steps possibly pinned)
    latest: int | None               # the checkpoint to restore, None = fresh start
    start: int                       # the next batch index
    nothing_to_do: bool
    saved: dict | None               # the run's config.json as saved, None if absent
    notes: tuple[str, ...] = ()      # to print once every check has passed


def _lr(cfg: TrainConfig, step: int) -> float:
    from dropless.train.step import lr_schedule
    return float(lr_schedule(cfg)(step))


def _schedule(cfg: TrainConfig, saved: dict, at: int, echo: Callable[[str], Any]
              ) -> TrainConfig:
    """Keep the saved cosine horizon unless lr_decay_steps says otherwise (announced)."""
    old = int(saved.get("lr_decay_steps") or saved.get("steps") or cfg.steps)
    new = cfg.lr_decay_steps or cfg.steps
    if new == old:
        return cfg.replace(lr_decay_steps=old) if cfg.steps != old else cfg
    if cfg.lr_decay_steps == 0:
        pinned = cfg.replace(lr_decay_steps=old)
        echo(f"  steps={cfg.steps} (was {saved.get('steps')}): the learning-rate schedule keeps "
             f"its horizon, lr_decay_steps={old} (LR {_lr(pinned, at):.3g} at step {at}, "
             f"{_lr(pinned, cfg.steps):.3g} at the end); pass lr_decay_steps={cfg.steps} to "
             "stretch it instead")
        return pinned
    before = cfg.replace(lr_decay_steps=old)
    echo(f"  lr_decay_steps={new} (was {old}) changes the learning-rate schedule: LR at step "
         f"{at} goes from {_lr(before, at):.3g} to {_lr(cfg, at):.3g}")
    return cfg


def plan_resume(cfg: TrainConfig, run_dir: Path, corpus_fingerprint: dict, *,
                stop_at: int | None, echo: Callable[[str], Any]) -> ResumePlan:
    """Decide how `cfg` continues in `run_dir` without writing anything. Raises ValueError
    when the checkpoint was made on other data."""
    cfg_path = run_dir / "config.json"
    saved = json.loads(cfg_path.read_text()) if cfg_path.exists() else None
    latest = ckpt.latest_step(run_dir / "checkpoints")
    if latest is None:
        return ResumePlan(cfg, None, 0, False, saved)
    end = cfg.steps if stop_at is None else min(cfg.steps, stop_at)
    if latest >= end:
        echo(f"nothing to do: {run_dir} has a checkpoint at step {latest} and the run stops at "
             f"step {end}; pass steps=N with N > {latest} to train further. Nothing was changed.")
        return ResumePlan(cfg, latest, latest, True, saved)
    meta = ckpt.read_meta(run_dir / "checkpoints", latest)
    if meta["corpus"] != corpus_fingerprint:
        was, now = meta["corpus"], corpus_fingerprint
        raise ValueError(f"data={cfg.data!r}: checkpoint {latest} in {run_dir} was made on "
                         f"different data ({was['train_tokens']:,} train tokens, crc32 "
                         f"{was['crc32']}; this data: {now['train_tokens']:,}, crc32 "
                         f"{now['crc32']}); resume with the run's own data (drop the data= "
                         "override) or start a new run")
    start = int(meta["next_batch"])
    notes: list[str] = []
    if saved is not None:
        cfg = _schedule(cfg, saved, start, notes.append)
    return ResumePlan(cfg, latest, start, False, saved, tuple(notes))
