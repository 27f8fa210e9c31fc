"""Checkpoints with orbax: periodic, asynchronous, keep-N, atomic, with errors that say what to do.

A checkpoint holds the whole train state (parameters including router biases, optimizer state,
step, RNG) and a JSON record with the data position (the next batch index) and the corpus
fingerprint. Orbax writes each step into a temporary directory and renames it when complete, so
a run killed during a save leaves only an unfinished temporary directory, which restore ignores:
the run resumes from the last complete step. Every array's content hash is stored with the step
and compared at restore (integrity.py): a step damaged later raises integrity.CheckpointDamaged
naming the step, the file or array and why, never returning damaged data.

An asynchronous save that fails (disk full, permission, read-only file system) is noticed by
`Saver.poll()` at the first step boundary after it failed, not at the next save, and becomes one
`CheckpointError` naming the cause, the directory and what to do; orbax's own error logs and
the tracebacks tensorstore prints for that failure's late writes are filtered out (only those:
see `_LateWriteCallbacks`). `check_compatible` compares a checkpoint's stored
shapes and dtypes with the state the config builds before anything is restored, and names the
parameter path and the config keys that differ.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import sys
from pathlib import Path
from typing import Any, Iterator

import jax
import orbax.checkpoint as ocp

from dropless.checkpoint import integrity


class CheckpointError(RuntimeError):
    """A checkpoint could not be written; the message says why and what to do."""


def manager(directory: str | Path, *, keep: int, async_save: bool = True
            ) -> ocp.CheckpointManager:
    """A CheckpointManager keeping the newest `keep` complete steps under `directory`."""
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                           enable_async_checkpointing=async_save)
    return ocp.CheckpointManager(
        Path(directory).absolute(), options=options,
        item_handlers={"state": ocp.StandardCheckpointHandler(),
                       "meta": ocp.JsonCheckpointHandler()})


def save(mngr: ocp.CheckpointManager, step: int, state: Any, meta: dict, *,
         hashes: bool = True) -> None:
    """Start saving (returns before the write finishes when asynchronous). `meta` is stored
    with the content hash of every array of `state` (integrity.py; `hashes=False` only for the
    cost measurement), which `restore` checks."""
    if hashes:
        meta = {**meta, "hash": integrity.ALGORITHM, "hashes": integrity.tree_hashes(state)}
    mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                            meta=ocp.args.JsonSave(meta)), force=True)


def all_steps(directory: str | Path) -> list[int]:
    """Every step folder under `directory`, newest first (complete or not: orbax renames a step
    into place only when complete, so a numbered folder that is incomplete was damaged later);
    reads names only, creates nothing."""
    d = Path(directory)
    if not d.is_dir():
        return []
    return sorted((int(p.name) for p in d.iterdir() if p.name.isdigit() and p.is_dir()),
                  reverse=True)


def latest_step(directory: str | Path) -> int | None:
    """The newest step folder under `directory` (None when there is none or no directory)."""
    steps = all_steps(directory)
    return steps[0] if steps else None


def read_meta(directory: str | Path, step: int) -> dict:
    """The JSON record saved with `step` (data position, corpus fingerprint), read directly."""
    import json
    return json.loads((Path(directory) / str(step) / "meta" / "metadata").read_text())


def _saved_tree(mngr: ocp.CheckpointManager, step: int) -> Any:
    """The stored state's tree metadata (its dict keys tell the expert layout)."""
    md = mngr.item_metadata(step)["state"]
    return getattr(md, "tree", md)


def restore(mngr: ocp.CheckpointManager, step: int, like: Any, *, verify: bool = True
            ) -> tuple[Any, dict]:
    """(state, meta) of `step`; `like` is a state (or its jax.eval_shape) giving structure,
    dtypes and shardings. A checkpoint written in another parameter layout (decoder layers
    scanned or not, `scan_layers`; expert gate/up fused or not, `prefuse_moe_weights`) is read
    as stored and converted to `like`'s layout (both conversions are exact). Raises
    integrity.CheckpointDamaged when a file cannot be read or an array's bytes differ from the
    hash recorded at save time (`verify=False` skips the hashes, for the cost measurement)."""
    directory = Path(mngr.directory)
    damage = integrity.inspect(directory, step)
    if damage is not None:
        raise integrity.CheckpointDamaged(damage)
    try:
        to_stored, to_mine = _layout_conversions(mngr, step, like)
        abstract = jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                           sharding=getattr(x, "sharding", None)),
            jax.eval_shape(to_stored, like) if to_stored else like)
        out = mngr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
    except Exception as e:  # noqa: BLE001 - tensorstore's errors: which file, in one line
        _drop_late_callbacks()
        raise integrity.CheckpointDamaged(integrity.read_failure(e, step, directory)) from e
    state = out["state"]
    if verify:
        integrity.verify(state, dict(out["meta"]).get("hashes"), step)
    if to_mine:
        state = jax.tree.map(lambda x, ref: jax.device_put(x, getattr(ref, "sharding", None)),
                             to_mine(state), like)
    return state, dict(out["meta"])


def _layout_conversions(mngr: ocp.CheckpointManager, step: int, like: Any):
    """(to_stored, to_mine): functions converting a state between `like`'s parameter layout
    and the one checkpoint `step` was written in; (None, None) when they agree."""
    from dropless.models import scan
    from dropless.moe import convert_expert_weights, expert_layout
    try:
        tree = _saved_tree(mngr, step)
    except (KeyError, TypeError, ValueError, FileNotFoundError):   # no readable tree metadata
        return None, None
    steps = []
    stored, mine = scan.is_scanned(tree), scan.is_scanned(like)
    if None not in (stored, mine) and stored != mine:
        steps.append((lambda t, v=stored: scan.to_layout(t, v),
                      lambda t, v=mine: scan.to_layout(t, v)))
    stored, mine = expert_layout(tree), expert_layout(like)
    if None not in (stored, mine) and stored != mine:
        steps.append((lambda t, v=stored: convert_expert_weights(t, prefuse=v),
                      lambda t, v=mine: convert_expert_weights(t, prefuse=v)))
    if not steps:
        return None, None

    def to_stored(t):
        for f, _ in steps:
            t = f(t)
        return t

    def to_mine(t):
        for _, g in reversed(steps):
            t = g(t)
        return t
    return to_stored, to_mine


_path_str = integrity.path_str   # the metadata tree and the live state name paths alike


def _config_diff(saved: dict, now: dict, prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(saved) | set(now)):
        a, b = saved.get(k), now.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _config_diff(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k} ({a!r} in the run's config.json, {b!r} now)")
    return out


def check_compatible(mngr: ocp.CheckpointManager, step: int, like: Any, *,
                     saved_model: dict | None, model: dict, run_dir: Path) -> None:
    """Raise ValueError if checkpoint `step` cannot be restored into `like` (a state or its
    eval_shape): names the first parameter whose shape or dtype differs (parameters before
    optimizer state) and the `model.*` config keys that differ from the run's config.json."""
    to_stored, _ = _layout_conversions(mngr, step, like)
    if to_stored:                    # another layout of the same parameters restores exactly
        like = jax.eval_shape(to_stored, like)
    stored = {_path_str(p): m for p, m in
              jax.tree_util.tree_leaves_with_path(mngr.item_metadata(step)["state"])}
    wanted = {_path_str(p): x for p, x in jax.tree_util.tree_leaves_with_path(like)}
    problems = []
    for name in sorted(wanted, key=lambda n: (not n.startswith("params/"), n)):
        x, m = wanted[name], stored.get(name)
        if m is None:
            problems.append(f"{name} is not in the checkpoint")
        elif tuple(m.shape) != tuple(x.shape) or jax.numpy.dtype(m.dtype) != x.dtype:
            problems.append(f"{name} is {tuple(m.shape)} {jax.numpy.dtype(m.dtype)} in the "
                            f"checkpoint, {tuple(x.shape)} {x.dtype} with this config")
    problems += [f"{n} is in the checkpoint but not in this model" for n in stored
                 if n not in wanted]
    if not problems:
        return
    keys = _config_diff(saved_model or {}, model, "model.")
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    raise ValueError(
        f"checkpoint {step} in {run_dir} does not fit this config: "
        f"{problems[0]}{more}; config keys that differ: "
        f"{', '.join(keys) if keys else 'none found in model.*'}. Resume without those "
        "overrides, or start a new run (another run_name)")


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


class _DropOrbaxErrors(logging.Filter):
    """Orbax logs a failed background save with several tracebacks; Saver reports it once."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and "orbax" in record.pathname)


def _is_late_write_callback(u) -> bool:
    """True for tensorstore's wake-up call to the closed event loop of a failed save: a bare
    RuntimeError('Event loop is closed') raised by `loop.call_soon_threadsafe` called from C
    (no Python caller frame), with no object or message attached."""
    tb = u.exc_traceback
    return (u.object is None and u.err_msg is None and type(u.exc_value) is RuntimeError
            and str(u.exc_value) == "Event loop is closed" and tb is not None
            and tb.tb_frame.f_code.co_name == "call_soon_threadsafe"
            and Path(tb.tb_frame.f_code.co_filename).parent.name == "asyncio")


class _LateWriteCallbacks:
    """A sys.unraisablehook that holds back the late callbacks of a failed save.

    When one tensorstore write of a save fails (ENOSPC), orbax (asyncio_utils.run_sync) closes
    that save's event loop at once while the save's other writes are still running. Each of
    them, when it ends, asks the closed loop to wake its awaiting task; the RuntimeError goes to
    sys.unraisablehook (tensorstore's PyErr_WriteUnraisable), whose default prints a bare
    traceback: none or dozens, depending on how many writes were late (more on a busy machine).
    Those events are held, dropped once the failure is reported as a CheckpointError (and from
    then on, as the remaining writes end), and passed on at the end when none was reported.
    Every other unraisable exception goes straight to the previous hook.
    """

    def __init__(self, previous):
        self.previous, self.held, self.reported = previous, [], False

    def __call__(self, u) -> None:
        if not _is_late_write_callback(u):
            self.previous(u)
        elif not self.reported:
            self.held.append(u)

    def release(self) -> None:
        """Give the hook back and pass on what it held (no failure explains them)."""
        if sys.unraisablehook is self:
            sys.unraisablehook = self.previous
        held, self.held = self.held, []
        for u in held:
            self.previous(u)


_ACTIVE_HOOKS: list[_LateWriteCallbacks] = []     # the hooks of the open quiet_orbax_errors


def _drop_late_callbacks() -> None:
    """A failed read is reported (as CheckpointDamaged): the late callbacks of its closed event
    loop are dropped, as those of a failed save are, and so (for the rest of the process) are
    the later reports of its other reads: each failed read coroutine and task of orbax's
    `_read_array_index_and_device_put` prints its own TensorStore dump when collected."""
    for hook in _ACTIVE_HOOKS:
        hook.reported, hook.held = True, []
    if not isinstance(sys.unraisablehook, _FailedReads):
        sys.unraisablehook = _FailedReads(sys.unraisablehook)
        logging.getLogger("asyncio").addFilter(_FailedReads.log_filter)


_READ_ERROR = "Encountered error while reading array index"


class _FailedReads:
    """sys.unraisablehook dropping the 'Exception ignored in <coroutine
    _read_array_index_and_device_put>' reports of a failed restore (and nothing else)."""

    def __init__(self, previous):
        self.previous = previous

    def __call__(self, u) -> None:
        if not str(u.exc_value).startswith(_READ_ERROR):
            self.previous(u)

    @staticmethod
    def log_filter(record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (str(exc).startswith(_READ_ERROR) or _READ_ERROR in str(record.msg))


@contextlib.contextmanager
def quiet_orbax_errors() -> Iterator[None]:
    """Within: orbax's error logs of a failed save are dropped (Saver reports the failure once)
    and tensorstore's late callbacks to the save's closed event loop are held back; a
    CheckpointError leaving the block drops them for the rest of the process."""
    logger, flt = logging.getLogger("absl"), _DropOrbaxErrors()
    hook = _LateWriteCallbacks(sys.unraisablehook)
    logger.addFilter(flt)
    sys.unraisablehook = hook
    _ACTIVE_HOOKS.append(hook)
    try:
        yield
    except CheckpointError:
        hook.reported, hook.held = True, []
        raise
    finally:
        _ACTIVE_HOOKS.remove(hook)
        logger.removeFilter(flt)
        if not hook.reported:
            hook.release()


class Saver:
    """Periodic saves through one manager, with failures surfaced at step boundaries."""

    def __init__(self, mngr: ocp.CheckpointManager):
        self.mngr, self.pending, self.last_saved = mngr, None, None
        self.directory = Path(mngr.directory)

    def _wait(self) -> None:
        try:
            self.mngr.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - anything orbax raises becomes one message
            step, self.pending = self.pending, None
            raise explain(e, step=step, directory=self.directory) from e
        if self.pending is not None:
            self.last_saved, self.pending = self.pending, None

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
