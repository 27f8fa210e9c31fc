"""Checkpoints with orbax: periodic, asynchronous, keep-N, atomic, with errors that say what to do.

A checkpoint holds the whole train state (parameters including router biases, optimizer state,
step, RNG) and a JSON record with the data position (the next batch index) and the corpus
fingerprint. Orbax writes each step into a temporary directory and renames it when complete, so
a run killed during a save leaves only an unfinished temporary directory, which restore ignores:
the run resumes from the last complete step.

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


def save(mngr: ocp.CheckpointManager, step: int, state: Any, meta: dict) -> None:
    """Start saving (returns before the write finishes when asynchronous)."""
    mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                            meta=ocp.args.JsonSave(meta)), force=True)


def latest_step(directory: str | Path) -> int | None:
    """The newest complete step under `directory` (None when there is none or no directory);
    reads names only, creates nothing."""
    d = Path(directory)
    if not d.is_dir():
        return None
    steps = [int(p.name) for p in d.iterdir() if p.name.isdigit() and p.is_dir()]
    return max(steps) if steps else None


def read_meta(directory: str | Path, step: int) -> dict:
    """The JSON record saved with `step` (data position, corpus fingerprint), read directly."""
    import json
    return json.loads((Path(directory) / str(step) / "meta" / "metadata").read_text())


def _saved_tree(mngr: ocp.CheckpointManager, step: int) -> Any:
    """The stored state's tree metadata (its dict keys tell the expert layout)."""
    md = mngr.item_metadata(step)["state"]
    return getattr(md, "tree", md)


def restore(mngr: ocp.CheckpointManager, step: int, like: Any) -> tuple[Any, dict]:
    """(state, meta) of `step`; `like` is a state (or its jax.eval_shape) giving structure,
    dtypes and shardings. A checkpoint written in another parameter layout (decoder layers
    scanned or not, `scan_layers`; expert gate/up fused or not, `prefuse_moe_weights`) is read
    as stored and converted to `like`'s layout (both conversions are exact)."""
    to_stored, to_mine = _layout_conversions(mngr, step, like)
    abstract = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        jax.eval_shape(to_stored, like) if to_stored else like)
    out = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                     meta=ocp.args.JsonRestore()))
    state = out["state"]
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


def _path_str(path) -> str:
    """'params/layers/1/moe/w_up_EDF' (the metadata tree spells optax's namedtuple fields as
    dict keys, the live state as attributes: both become plain names)."""
    def name(k):
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                return str(getattr(k, attr))
        return str(k)
    return "/".join(name(k) for k in path)


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


@contextlib.contextmanager
def quiet_orbax_errors() -> Iterator[None]:
    """Within: orbax's error logs of a failed save are dropped (Saver reports the failure once)
    and tensorstore's late callbacks to the save's closed event loop are held back; a
    CheckpointError leaving the block drops them for the rest of the process."""
    logger, flt = logging.getLogger("absl"), _DropOrbaxErrors()
    hook = _LateWriteCallbacks(sys.unraisablehook)
    logger.addFilter(flt)
    sys.unraisablehook = hook
    try:
        yield
    except CheckpointError:
        hook.reported, hook.held = True, []
        raise
    finally:
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
