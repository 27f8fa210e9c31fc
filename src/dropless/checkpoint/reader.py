"""The one checkpoint reader every command uses (train's resume, `eval`, `generate`, `convert`
of a run, `init_from=RUN`), and the rules that let readers and the writer work at once.

Reading (`read_newest`): the step folders are tried newest first. A step is read only while
this process holds a shared `flock` on its folder (`lease`); a step that vanished meanwhile
(rotated away by the trainer) is passed over silently. A step is *complete* when orbax has
committed it: its folder carries the final name (orbax writes `<step>.orbax-checkpoint-tmp-*`
and renames it when done) and holds `commit_success.txt`. A reader that may be running beside a
live trainer (`writer_may_run=True`: eval, generate, convert, init_from) skips a step without
`commit_success.txt` as not complete, never calling it damaged and never moving it; the
trainer's own resume (it holds the run's lock, so nothing else writes) counts it as damage.
Every other problem of a step (a structural one `integrity.inspect` sees, malformed metadata
included; a file that cannot be read; an array that fails its hash) is damage: the step is
recorded and the next older one is tried. `set_aside` then moves the damaged steps to
checkpoints/damaged/ (never deleting one, never one a reader holds); `fallback_words` is the
one line announcing it.

Rotation (`rotate`): the trainer removes steps beyond `keep_checkpoints` itself (orbax is told
to keep every step), each only under an exclusive non-blocking `flock` of its folder, so a step
a reader holds is kept until a later save; a removed step is first renamed out of sight
(`.removing-<step>-<pid>`), so readers never see a half-deleted numbered folder.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator

from dropless.checkpoint import integrity
from dropless.checkpoint.format import all_steps
from dropless.runtime.files import same_file

COMMIT_FILE = "commit_success.txt"     # orbax's mark of a committed step


class NoIntactStep(ValueError):
    """No step of a checkpoints folder can be read; `damaged` says why for each."""

    def __init__(self, message: str, damaged: tuple[integrity.Damage, ...]):
        super().__init__(message)
        self.damaged = damaged


@dataclasses.dataclass(frozen=True)
class Found:
    """What `read_newest` read: `value` of step `step`; `damaged`: the newer steps found
    damaged (newest first); `incomplete`: newer steps skipped as not yet committed."""
    step: int
    value: Any
    damaged: tuple[integrity.Damage, ...] = ()
    incomplete: tuple[int, ...] = ()


def committed(directory: str | Path, step: int) -> bool:
    """True when orbax committed step folder directory/<step> (its commit_success.txt)."""
    return (Path(directory) / str(step) / COMMIT_FILE).is_file()


def _open_dir(path: Path) -> int | None:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None


@contextlib.contextmanager
def lease(directory: str | Path, step: int) -> Iterator[bool]:
    """Hold a shared lock on step folder directory/<step> within the block, so rotation and
    `set_aside` leave it in place; yields False when the step is not there (any more)."""
    path = Path(directory) / str(step)
    fd = _open_dir(path)
    if fd is None:
        yield False
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield same_file(path, fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[bool]:
    """An exclusive lock on folder `path` if no reader holds it (never waits); yields False
    when a reader holds it or it is gone."""
    fd = _open_dir(path)
    if fd is None:
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield same_file(path, fd)
    finally:
        os.close(fd)


def remove_step(directory: str | Path, step: int) -> bool:
    """Delete step folder directory/<step> unless a reader holds it; True when removed. The
    folder is renamed out of sight first, then deleted."""
    d = Path(directory)
    with _exclusive(d / str(step)) as mine:
        if not mine:
            return False
        gone = d / f".removing-{step}-{os.getpid()}"
        os.rename(d / str(step), gone)
    shutil.rmtree(gone, ignore_errors=True)
    return True


def rotate(directory: str | Path, keep: int, *, protect: tuple[int, ...] = ()) -> list[int]:
    """Remove the steps beyond the newest `keep` under `directory` (steps a reader holds stay
    until a later call; `protect`: steps never removed); returns the steps removed."""
    return [s for s in all_steps(directory)[keep:]
            if s not in protect and remove_step(directory, s)]


def set_aside(directory: str | Path, damaged: tuple[integrity.Damage, ...]
              ) -> list[tuple[integrity.Damage, Path | None]]:
    """Move each damaged step to directory/damaged/<step>-<reason> (`integrity.quarantine`),
    unless a reader holds it, it is gone, or the folder cannot be written: then it stays
    (None)."""
    out = []
    for damage in damaged:
        dest = None
        with _exclusive(Path(directory) / str(damage.step)) as mine:
            if mine:
                with contextlib.suppress(OSError):
                    dest = integrity.quarantine(directory, damage)
        out.append((damage, dest))
    return out


def fallback_words(found: Found, moved: list[tuple[integrity.Damage, Path | None]], *,
                   what: str = "reading") -> str:
    """One line: which steps were passed over and why, and the step read instead."""
    parts = []
    for damage, dest in moved:
        where = (f"moved to {dest}" if dest is not None else "left in place (held by another "
                 "reader, or the folder is not writable)")
        parts.append(f"{damage.text()} ({where})")
    for step in found.incomplete:
        parts.append(f"checkpoint {step} is not complete yet (no {COMMIT_FILE}: being written)")
    return f"{'; '.join(parts)}; {what} step {found.step}, the newest intact checkpoint"


def _no_step(directory: Path, damaged: list[integrity.Damage], incomplete: list[int]) -> str:
    if damaged:
        why = "; ".join(d.text() for d in damaged[:3])
        more = f" (and {len(damaged) - 3} more)" if len(damaged) > 3 else ""
        return f"no intact checkpoint in {directory} ({why}{more})"
    if incomplete:
        return (f"no complete checkpoint in {directory} yet (step {incomplete[0]} is being "
                "written); wait for the run's first checkpoint")
    return f"no checkpoint in {directory} (checkpoints/ is missing or empty)"


def read_newest(directory: str | Path, read: Callable[[int], Any], *,
                writer_may_run: bool, skip: dict[int, integrity.Damage] | None = None
                ) -> Found:
    """`read(step)` of the newest step under `directory` that is complete, intact and reads
    (see the module doc); `read` raises integrity.CheckpointDamaged for a damaged step (other
    exceptions pass through). `skip`: steps already known damaged. Raises NoIntactStep (a
    ValueError, with each step's damage) when no step reads; nothing is moved here
    (`set_aside`)."""
    directory = Path(directory)
    known = dict(skip or {})
    damaged: list[integrity.Damage] = []
    incomplete: list[int] = []
    for step in all_steps(directory):
        with lease(directory, step) as held:
            if not held:
                continue                  # rotated away meanwhile
            if writer_may_run and not committed(directory, step):
                incomplete.append(step)
                continue
            damage = known.get(step) or integrity.inspect(directory, step)
            if damage is None:
                try:
                    return Found(step, read(step), tuple(damaged), tuple(incomplete))
                except integrity.CheckpointDamaged as e:
                    damage = e.damage
        if not (directory / str(step)).is_dir():
            continue                      # gone while it was read: not damage
        damaged.append(damage)
    raise NoIntactStep(_no_step(directory, damaged, incomplete), tuple(damaged))
