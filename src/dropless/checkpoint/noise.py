"""What orbax and tensorstore print around a failed save or read, held back once the failure is
reported as one message (`saver.CheckpointError`, `integrity.CheckpointDamaged`).

Only that noise is dropped: orbax's error logs inside `held()`, tensorstore's late callbacks to
a failed save's closed event loop (`_LateWriteCallbacks`), and the 'Exception ignored in
<coroutine _read_array_index_and_device_put>' reports of a failed read (`_FailedReads`).
Every other unraisable exception and log record goes through.
"""
from __future__ import annotations

import contextlib
import logging
import sys
from pathlib import Path
from typing import Iterator


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
    Those events are held, dropped once the failure is reported (`drop`, and from then on, as
    the remaining writes end), and passed on at the end when none was reported. Every other
    unraisable exception goes straight to the previous hook.
    """

    def __init__(self, previous):
        self.previous, self.held, self.reported = previous, [], False

    def __call__(self, u) -> None:
        if not _is_late_write_callback(u):
            self.previous(u)
        elif not self.reported:
            self.held.append(u)

    def drop(self) -> None:
        """The failure is reported: what is held, and what comes later, is dropped."""
        self.reported, self.held = True, []

    def release(self) -> None:
        """Give the hook back and pass on what it held (no failure explains them)."""
        if sys.unraisablehook is self:
            sys.unraisablehook = self.previous
        held, self.held = self.held, []
        for u in held:
            self.previous(u)


_ACTIVE_HOOKS: list[_LateWriteCallbacks] = []     # the hooks of the open `held()` blocks


@contextlib.contextmanager
def held() -> Iterator[_LateWriteCallbacks]:
    """Within: orbax's error logs are dropped and tensorstore's late callbacks to a failed
    save's closed event loop are held back by the hook yielded; its `drop()` (the failure was
    reported) drops them for the rest of the process, else they are passed on at the end."""
    logger, flt = logging.getLogger("absl"), _DropOrbaxErrors()
    hook = _LateWriteCallbacks(sys.unraisablehook)
    logger.addFilter(flt)
    sys.unraisablehook = hook
    _ACTIVE_HOOKS.append(hook)
    try:
        yield hook
    finally:
        _ACTIVE_HOOKS.remove(hook)
        logger.removeFilter(flt)
        if not hook.reported:
            hook.release()


def drop_late_callbacks() -> None:
    """A failed read is reported (as CheckpointDamaged): the late callbacks of its closed event
    loop are dropped, as those of a failed save are, and so (for the rest of the process) are
    the later reports of its other reads: each failed read coroutine and task of orbax's
    `_read_array_index_and_device_put` prints its own TensorStore dump when collected."""
    for hook in _ACTIVE_HOOKS:
        hook.drop()
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
