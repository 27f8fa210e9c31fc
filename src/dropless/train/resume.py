"""Resume is transactional: everything a resume could refuse is checked before anything in the
run directory changes.

`plan_resume` reads the run's newest complete checkpoint (names and its small JSON record only)
and its config.json, and decides: start fresh (no checkpoint), "nothing to do" (the checkpoint is
already at or past the last step asked for), refuse (other data), or continue. It also settles
the learning-rate schedule when `steps` changes: the cosine keeps the horizon the run started
with (`lr_decay_steps` is pinned to it), unless `lr_decay_steps` is given explicitly, in which
case the change is announced with the LR before and after at the resume step. Shapes and dtypes
are compared with the checkpoint by `checkpoint.check_compatible`, also before any write.

Damaged checkpoints (integrity.py; malformed metadata counts) are skipped: the plan continues
from the newest step whose folder is intact and lists the damaged newer ones (`damaged`);
`restore_newest` restores through the one checkpoint reader (`checkpoint.read_newest`), which
falls back further when a step's files fail to read or verify, and the loop moves the damaged
steps aside (`checkpoint.set_aside`) once the older step has been restored and verified; with
`strict` a damaged newest step refuses the resume instead. A resume asked for (`--resume`) over a directory with no intact checkpoint is
refused: it would otherwise start again from step 1 inside the old run.

The data position is decided here alone (`data_position`). A checkpoint records the batch index
and the sample number the run continues at, the global batch it was trained with and the data
order (`ORDER_KEYS`: seq_len, packing, seed; `position` writes them). A resume with another
global batch (per_device_batch_size, gradient_accumulation_steps, mesh) continues at that sample
number, so no sample is trained twice or skipped, and says so in one line; one with another
data order is refused in one line: the same sample number names other rows there, and the
run's weights can start a new run instead (init_from=RUN_DIR). A checkpoint written before the
record held the sample number gets it from the run's config.json (next_batch x its global
batch).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

from dropless.config import TrainConfig
from dropless.model_dir import saved_run_config
from dropless import checkpoint as ckpt
from dropless.checkpoint import format as ckpt_format, integrity


ORDER_KEYS = ("seq_len", "packing", "seed")   # what decides which rows a sample number names


@dataclasses.dataclass(frozen=True)
class ResumePlan:
    cfg: TrainConfig                 # the config to run (lr_decay_steps possibly pinned)
    latest: int | None               # the checkpoint to restore, None = fresh start
    start: int                       # the next batch index
    first_sample: int                # the sample number batch `start` begins at
    nothing_to_do: bool
    saved: dict | None               # the run's config.json as saved, None if absent
    notes: tuple[str, ...] = ()      # to print once every check has passed
    damaged: tuple[integrity.Damage, ...] = ()   # newer steps skipped, newest first


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


def strict_refusal(damage: integrity.Damage, run_dir: Path, older: int | None) -> ValueError:
    """The one-line refusal of --strict-resume over damaged checkpoint `damage.step`."""
    then = (f"drop --strict-resume to resume from step {older}, the newest intact one (the "
            f"damaged step is moved to checkpoints/{integrity.DAMAGED}/, not deleted)"
            if older is not None else "no older intact checkpoint is left; start a new run")
    return ValueError(f"--strict-resume: {run_dir}: {damage.text()}; nothing was changed. "
                      f"To continue, {then}")


def newest_intact(directory: Path, skip: dict[int, integrity.Damage]
                   ) -> tuple[int | None, list[integrity.Damage]]:
    """(newest structurally intact step, the damaged steps newer than it, newest first);
    `skip`: steps already found damaged by a failed restore."""
    damaged = []
    for step in ckpt.all_steps(directory):
        damage = skip.get(step) or integrity.inspect(directory, step)
        if damage is None:
            return step, damaged
        damaged.append(damage)
    return None, damaged


def _no_checkpoint(run_dir: Path, damaged: list[integrity.Damage]) -> ValueError:
    if damaged:
        why = "; ".join(d.text() for d in damaged[:3])
        return ValueError(f"--resume {run_dir}: no intact checkpoint to resume from ({why}); "
                          "nothing was changed. Start a new run (another run_name, without "
                          "--resume), or use init_from=DIR to start from a model's weights")
    return ValueError(f"--resume {run_dir}: the run has no checkpoint (checkpoints/ is missing "
                      "or empty); nothing was changed. Drop --resume to start a new run, or use "
                      "init_from=DIR to start from a model's weights")


def _tokens(fingerprint: dict) -> str:
    n = fingerprint.get("train_tokens")
    return f"{n:,}" if type(n) is int else repr(n)[:40]


def same_data(was: dict, now: dict) -> bool:
    """Whether checkpoint corpus fingerprint `was` names the data `now` (data.corpus: both
    dicts). A checkpoint written before the whole-data `sha256` has none: the rest decides."""
    if isinstance(was, dict) and "sha256" not in was:
        now = {k: v for k, v in now.items() if k != "sha256"}
    return was == now


def _digest(fp: dict) -> str:
    if isinstance(fp, dict) and "sha256" in fp:
        return f"sha256 {str(fp['sha256'])[:12]}"
    return f"crc32 {fp.get('crc32') if isinstance(fp, dict) else None}"


def plan_resume(cfg: TrainConfig, run_dir: Path, corpus_fingerprint: dict, *,
                stop_at: int | None, echo: Callable[[str], Any], resume: bool = False,
                strict: bool = False, skip: dict[int, integrity.Damage] | None = None
                ) -> ResumePlan:
    """Decide how `cfg` continues in `run_dir` without writing anything. Raises ValueError
    when the checkpoint was made on other data, when `resume` (asked for with --resume) finds
    no intact checkpoint, and with `strict` when the newest step is damaged. `skip`: steps a
    failed restore found damaged, with why."""
    saved = saved_run_config(run_dir)
    latest, damaged = newest_intact(run_dir / "checkpoints", skip or {})
    if damaged and strict:
        raise strict_refusal(damaged[0], run_dir, latest)
    if latest is None:
        if resume or damaged:
            raise _no_checkpoint(run_dir, damaged)
        return ResumePlan(cfg, None, 0, 0, False, saved)
    end = cfg.steps if stop_at is None else min(cfg.steps, stop_at)
    if latest >= end:
        also = "".join(f" ({d.text()}; it is left in place)" for d in damaged)
        echo(f"nothing to do: {run_dir} has a checkpoint at step {latest} and the run stops at "
             f"step {end}; pass steps=N with N > {latest} to train further.{also} "
             "Nothing was changed.")
        return ResumePlan(cfg, latest, latest, 0, True, saved, damaged=tuple(damaged))
    meta = ckpt.read_meta(run_dir / "checkpoints", latest)   # its types checked by inspect
    if not same_data(meta["corpus"], corpus_fingerprint):
        was, now = meta["corpus"], corpus_fingerprint
        raise ValueError(f"data={cfg.data!r}: checkpoint {latest} in {run_dir} was made on "
                         f"different data ({_tokens(was)} train tokens, {_digest(was)}; this "
                         f"data: {_tokens(now)}, {_digest(now)}); resume with the run's own "
                         "data, unchanged (drop the data= override, restore the files) or "
                         "start a new run")
    start = int(meta["next_batch"])
    notes: list[str] = []
    first = data_position(cfg, meta, saved, step=latest, run_dir=run_dir, echo=notes.append)
    if saved is not None:
        cfg = _schedule(cfg, saved, start, notes.append)
        notes += model_changes(saved, cfg)
    return ResumePlan(cfg, latest, start, first, False, saved, tuple(notes), tuple(damaged))


_INIT_KEYS = {f"model.{k}" for k in ("init", "init_std", "head_init_std", "embed_init_std",
                                     "init_residual_scaling")}


def model_changes(saved: dict, cfg: TrainConfig) -> list[str]:
    """The line (none, or one) naming the `model.*` keys `cfg` sets otherwise than the run's
    config.json `saved`: parameters of the same shapes fit another top_k, score function or
    scaling (checkpoint.check_compatible passes), so the resume goes on, and says under which
    keys it now trains them. A config.json this version cannot read is left to the checks that
    read it."""
    from dropless.model_dir import from_dict, to_dict
    try:
        was = to_dict(from_dict(saved))["model"]   # in the current form: no key missing
    except (ValueError, TypeError, KeyError):
        return []
    keys = [k for k in ckpt_format.config_diff(was, to_dict(cfg)["model"], "model.")
            if k.split(" ")[0] not in _INIT_KEYS]   # how fresh weights are drawn: not read here
    if not keys:
        return []
    return [f"  model keys that differ from the run's config.json: {', '.join(keys)}; the "
            "checkpoint's parameters fit them and are trained under the new values (resume "
            "without those overrides to keep the run's model)"]


def position(cfg: TrainConfig, next_batch: int, next_sample: int) -> dict:
    """A checkpoint's record of where the data stands (read back by `data_position`)."""
    return {"next_batch": next_batch, "next_sample": next_sample,
            "global_batch_size": cfg.global_batch_size,
            "data_order": {k: getattr(cfg, k) for k in ORDER_KEYS}}


def data_position(cfg: TrainConfig, meta: dict, saved: dict | None, *, step: int,
                  run_dir: Path, echo: Callable[[str], Any]) -> int:
    """The sample number the resume of checkpoint `step` (its record `meta`; `saved`: the run's
    config.json) continues at under `cfg`. Raises ValueError when `cfg` orders the data
    otherwise than the checkpoint; says in one line to `echo` when the global batch changed."""
    old_cfg = None
    if saved is not None and not ("next_sample" in meta and "data_order" in meta):
        from dropless.model_dir.run_config import from_dict
        old_cfg = from_dict(saved)
    order = meta.get("data_order") or (
        {k: getattr(old_cfg, k) for k in ORDER_KEYS} if old_cfg is not None else {})
    for k in ORDER_KEYS:
        if k in order and order[k] != getattr(cfg, k):
            raise ValueError(
                f"{k}={getattr(cfg, k)!r}: the run's checkpoint {step} was trained with "
                f"{k}={order[k]!r}, and under another {k} its data position names other rows "
                "(some data would be trained twice, some skipped); nothing was changed. "
                f"Resume with {k}={order[k]!r}, or start a new run from its weights: "
                f"init_from={run_dir}")
    batch = meta.get("global_batch_size")
    if batch is None:
        batch = old_cfg.global_batch_size if old_cfg is not None else cfg.global_batch_size
    first = meta.get("next_sample")
    if first is None:
        first = int(meta["next_batch"]) * batch
    if batch != cfg.global_batch_size:
        echo(f"  global batch {cfg.global_batch_size} rows (was {batch}): the data continues "
             f"at sample {first:,}, the first the run has not trained on")
    return int(first)


def restore_newest(plan: ResumePlan, replan: Callable[..., ResumePlan],
                   read: Callable[[int], Any], *, run_dir: Path, strict: bool
                   ) -> tuple[Any, ResumePlan]:
    """(the state `read(step)` restores, the plan for it) from the newest step that restores
    and verifies, through `checkpoint.read_newest` (the one reader): a step whose files fail to
    read or whose arrays fail their hashes is recorded in the returned plan's `damaged` and the
    next older one is tried; with `strict` the first such step refuses the resume
    (ValueError). `replan(resume=True, skip=...)` makes the plan for an older step (and refuses
    when none is left). Damaged data is never returned."""
    directory = run_dir / "checkpoints"

    def guarded(step: int):
        try:
            return read(step)
        except integrity.CheckpointDamaged as e:
            if strict:
                older, _ = newest_intact(directory, {e.damage.step: e.damage})
                raise strict_refusal(e.damage, run_dir, older) from None
            raise
    try:
        found = ckpt.read_newest(directory, guarded, writer_may_run=False,
                                 skip={d.step: d for d in plan.damaged})
    except ckpt.NoIntactStep as e:
        replan(resume=True, skip={d.step: d for d in e.damaged})   # raises: none is left
        raise
    if found.step != plan.latest:
        plan = replan(resume=True, skip={d.step: d for d in found.damaged})
    return found.value, plan
