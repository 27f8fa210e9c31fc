"""Preemption: SIGTERM (how SLURM and Kubernetes stop a job) and SIGINT (Ctrl-C) ask the training
loop to stop after the step in flight; the loop then saves a checkpoint, flushes its metrics,
prints the resume command and exits with EXIT_PREEMPTED. A second signal exits at once with
128 + signal number, saving nothing more (the last complete checkpoint stays valid: orbax only
renames a checkpoint into place once it is complete).

Before the first step (start-up: reading data, restoring a checkpoint, the first compile, kernel
timing) there is nothing to save, and the main thread may sit in one C++ call (XLA's compile)
for a minute, where Python signal handlers cannot run. So during start-up a watcher thread,
woken through `signal.set_wakeup_fd` the moment a signal arrives, runs the request's
`on_startup` clean-up (a new run's directory is removed), prints one line saying no step was
done and exits with EXIT_PREEMPTED within milliseconds. `StopRequest.begin_steps()` ends
start-up; from then on the first signal finishes the step in flight, as above.
"""
from __future__ import annotations

import contextlib
import functools
import os
import signal
import threading
from typing import Callable, Iterator, TypeVar

from dropless.runtime.interrupt import signal_watcher

EXIT_PREEMPTED = 75          # sysexits EX_TEMPFAIL: stopped cleanly, run the resume command later
SIGNALS = (signal.SIGTERM, signal.SIGINT)
T = TypeVar("T")


class StopRequest:
    """Set by the first SIGTERM/SIGINT; the loop polls `requested` at each step boundary."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.starting = True         # before the first step: a signal exits at once
        # called (from the watcher thread) on a signal during start-up; returns words to add
        self.on_startup: Callable[[str], str] | None = None
        self._lock = threading.Lock()

    def open_undoable(self, make: Callable[[], T], undo: Callable[[T, str], str]) -> T:
        """`make()` (something a start-up signal must undo: a new run directory) with its
        `undo(made, signal name)` (returning words for the one line) installed as `on_startup`
        before any start-up signal is acted on: a signal arriving while `make` runs waits
        until the undo is in place, so nothing made is left behind."""
        with self._lock:
            made = make()
            self.on_startup = functools.partial(undo, made)
        return made

    def begin_steps(self) -> None:
        """Start-up is over: from now on a signal stops after the step in flight. Waits for a
        start-up exit already under way (it ends the process)."""
        with self._lock:
            self.starting = False

    def _startup_exit(self, signum: int) -> None:
        with self._lock:
            if not self.starting:
                return
            name = signal.Signals(signum).name
            more = ""
            try:
                more = self.on_startup(name) if self.on_startup else ""
            except Exception as e:  # noqa: BLE001 - the exit must happen whatever clean-up did
                more = f"; clean-up failed: {type(e).__name__}: {e}"
            _say(f"dropless: {name} during start-up: stopped before the first step, no step "
                 f"was done (nothing to save){more}")
            os._exit(EXIT_PREEMPTED)

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""


def _say(text: str) -> None:
    # os.write, not print: a handler may run while the main thread is inside print().
    try:
        os.write(2, (text + "\n").encode())
    except OSError:
        pass


def _startup_watcher(req: StopRequest):
    """While `req` is starting, a stop signal ends start-up through `req._startup_exit`, also
    while the main thread is inside one C++ call (`runtime.interrupt.signal_watcher`)."""
    def on_signal(signum: int) -> None:
        if signum in SIGNALS and req.starting:
            req._startup_exit(signum)        # noqa: SLF001 - the request's own watcher
    return signal_watcher(on_signal, "dropless-signals")


@contextlib.contextmanager
def stop_on_signals(req: StopRequest | None = None) -> Iterator[StopRequest]:
    """Install SIGTERM/SIGINT handlers and the start-up watcher for the block (main thread only;
    elsewhere the returned request never fires) and restore the previous handlers after it.
    `req`: a request made earlier (by the command line, whose start-up begins before the
    trainer's); within a block already holding the handlers nothing more is installed."""
    req = req or StopRequest()
    if threading.current_thread() is not threading.main_thread() or \
            getattr(req, "_installed", False):
        yield req
        return

    def handler(signum, frame):
        if req.starting:
            # the watcher thread exits (it saw the same signal); should start-up end before
            # it looks, the loop still finds the request at its first step boundary
            if req.signum is None:
                req.signum = signum
            return
        name = signal.Signals(signum).name
        if req.signum is not None:
            _say(f"dropless: second {name}: exiting now without saving; the last complete "
                 "checkpoint is kept")
            os._exit(128 + signum)
        req.signum = signum
        _say(f"dropless: {name} received: finishing this step and saving a checkpoint "
             "(send it again to exit at once)")

    old = {s: signal.signal(s, handler) for s in SIGNALS}
    req._installed = True
    try:
        with _startup_watcher(req):
            yield req
    finally:
        req._installed = False
        for s, h in old.items():
            signal.signal(s, h)
