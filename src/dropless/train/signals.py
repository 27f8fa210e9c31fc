"""Preemption: SIGTERM (how SLURM and Kubernetes stop a job) and SIGINT (Ctrl-C) ask the training
loop to stop after the step in flight; the loop then saves a checkpoint, flushes its metrics,
prints the resume command and exits with EXIT_PREEMPTED. A second signal exits at once with
128 + signal number, saving nothing more (the last complete checkpoint stays valid: orbax only
renames a checkpoint into place once it is complete).
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Iterator

EXIT_PREEMPTED = 75          # sysexits EX_TEMPFAIL: stopped cleanly, run the resume command later
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """Set by the first SIGTERM/SIGINT; the loop polls `requested` at each step boundary."""

    def __init__(self) -> None:
        self.signum: int | None = None

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


@contextlib.contextmanager
def stop_on_signals() -> Iterator[StopRequest]:
    """Install SIGTERM/SIGINT handlers for the block (main thread only; elsewhere the returned
    request never fires) and restore the previous handlers after it."""
    req = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield req
        return

    def handler(signum, frame):
        name = signal.Signals(signum).name
        if req.signum is not None:
            _say(f"dropless: second {name}: exiting now without saving; the last complete "
                 "checkpoint is kept")
            os._exit(128 + signum)
        req.signum = signum
        _say(f"dropless: {name} received: finishing this step and saving a checkpoint "
             "(send it again to exit at once)")

    old = {s: signal.signal(s, handler) for s in SIGNALS}
    try:
        yield req
    finally:
        for s, h in old.items():
            signal.signal(s, h)
