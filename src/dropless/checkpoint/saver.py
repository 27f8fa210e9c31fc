"""Periodic saves during a run, and the words for a save that failed.

An asynchronous save that fails (disk full, permission, read-only file system) is noticed by
`Saver.poll()` at the first step boundary after it failed, not at the next save, and becomes one
`CheckpointError` naming the cause, the directory and what to do; within
`quiet_orbax_errors()`, orbax's own error logs and the tracebacks tensorstore prints for that
failure's late writes are dropped (only those: see `checkpoint.noise`).
"""
from __future__ import annotations

import contextlib
import errno
from pathlib import Path
from typing import Any, Iterator

import orbax.checkpoint as ocp

from dropless.checkpoint import noise
from dropless.checkpoint import reader
from dropless.checkpoint.format import keep_of, save


class CheckpointError(RuntimeError):
    """A checkpoint could not be written; the message says why and what to do."""


def explain(exc: BaseException, *, step: int, directory: Path) -> CheckpointError:
    """A one-line CheckpointError for a failed save of `step` into `directory`."""
    text = f"{type(exc).__name__}: {exc}"
    code = getattr(exc, "errno", None)
    if code == errno.ENOSPC or "RESOURCE_EXHAUSTED" in text or "No space left" in text:
        why, todo = "no space left on the device", "free space (or set run_dir to a larger disk)"
    elif code == errno.EROFS or "Read-only file system" in text:
        why, todo = "the file system is read-only", "make it writable (or move the run directory)"
    elif code == errno.EACCES or "PERMISSION_DENIED" in text or "Permission denied" in text:
        why, todo = "permission denied", "fix the permissions (or move the run directory)"
    else:
        why, todo = text.splitlines()[0][:300], "fix the cause"
    run = directory.parent
    return CheckpointError(
        f"checkpoint of step {step} could not be written to {directory}: {why}. The run "
        f"stopped; {todo}, then resume with: dropless train --resume {run}")


@contextlib.contextmanager
def quiet_orbax_errors() -> Iterator[None]:
    """Within: orbax's error logs of a failed save are dropped (Saver reports the failure once)
    and tensorstore's late callbacks to the save's closed event loop are held back; a
    CheckpointError leaving the block drops them for the rest of the process."""
    with noise.held() as hook:
        try:
            yield
        except CheckpointError:
            hook.drop()
            raise


class Saver:
    """Periodic saves through one manager, with failures surfaced at step boundaries. After
    each completed save the steps beyond the manager's `keep` are removed (`reader.rotate`:
    never one a reader holds, never the one just saved)."""

    def __init__(self, mngr: ocp.CheckpointManager):
        self.mngr, self.pending, self.last_saved = mngr, None, None
        self.directory = Path(mngr.directory)
        self.keep = keep_of(mngr)

    def _rotate(self) -> None:
        if self.keep is None or self.last_saved is None:
            return
        if reader.rotate(self.directory, self.keep, protect=(self.last_saved,)):
            self.mngr.reload()          # orbax lists the steps left in place

    def _wait(self) -> None:
        try:
            self.mngr.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - anything orbax raises becomes one message
            step, self.pending = self.pending, None
            raise explain(e, step=step, directory=self.directory) from e
        if self.pending is not None:
            self.last_saved, self.pending = self.pending, None
            self._rotate()

    def poll(self) -> None:
        """Raise CheckpointError if a finished asynchronous save failed (never blocks)."""
        if self.pending is not None and not self.mngr.is_saving_in_progress():
            self._wait()

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Start saving `step` (waits for the previous save first); raises CheckpointError."""
        if self.pending is not None:
            self._wait()
        self.pending = step
        try:
            save(self.mngr, step, state, meta)
        except Exception as e:  # noqa: BLE001
            self.pending = None
            raise explain(e, step=step, directory=self.directory) from e

    def save_last_good(self, step: int, state: Any, meta: dict) -> None:
        """Checkpoint `step` (a guard's last good one) unless it is a checkpoint already or
        being written, then wait for the save and close the manager (the run stops next);
        raises CheckpointError."""
        if step != self.pending and step not in self.mngr.all_steps():
            self.save(step, state, meta)
        self.finish()

    def finish(self) -> None:
        """Wait for the save in flight (raises CheckpointError) and close the manager."""
        try:
            self._wait()
        finally:
            self.close()

    def close(self) -> None:
        try:
            self.mngr.close()
        except Exception:  # noqa: BLE001 - the failure was reported by _wait already
            pass
