"""Ending a command that has nothing to save (`eval`, `generate`) on SIGINT or SIGTERM: one line,
then exit at once, 130 for SIGINT (Ctrl-C, 128 + 2) and 75 for SIGTERM (sysexits EX_TEMPFAIL,
what `dropless train` exits with when preempted: run it again later).

Why not Python's KeyboardInterrupt: it unwinds the main thread and the interpreter then shuts
down (modules torn down, objects freed) while XLA's own threads may still be running a
computation or a compile that was dispatched asynchronously; they then touch freed memory and
the process dies with SIGSEGV after printing "interrupted". And the main thread may sit in one
C++ call (a compile) for a minute, where no Python handler runs. So the signal is delivered
through `signal.set_wakeup_fd` to a watcher thread, which writes the line and leaves with
`os._exit`: no interpreter teardown, nothing left half-done on disk (these commands write
nothing but their output at the end).

The other commands stop on Ctrl-C by unwinding (KeyboardInterrupt: their `finally` blocks
remove what they staged). Within `interrupt_quietly()`, an interrupt that lands in a finalizer
or a callback instead (a JAX, orbax or tensorstore object's, where Python can only print
"Exception ignored in ... KeyboardInterrupt" and go on) ends the process at once with the same
one line and exit 130: what the command staged is left as a kill leaves it (every writer's next
run clears or resumes it).
"""
from __future__ import annotations

import _thread
import contextlib
import os
import signal
import socket
import sys
import threading
from typing import Callable, Iterator

EXIT_SIGINT = 130   # 128 + SIGINT
EXIT_SIGTERM = 75   # sysexits EX_TEMPFAIL, as `dropless train` when preempted
CODES = {signal.SIGINT: EXIT_SIGINT, signal.SIGTERM: EXIT_SIGTERM}


def _watch(sock: socket.socket, on_signal: Callable[[int], None]) -> None:
    """The watcher thread: each byte read is a signal number the C-level handler wrote."""
    while True:
        try:
            data = sock.recv(16)
        except OSError:
            return
        if not data:
            return
        for signum in data:
            on_signal(signum)


@contextlib.contextmanager
def signal_watcher(on_signal: Callable[[int], None], name: str) -> Iterator[None]:
    """Within the block, every signal Python's C-level handler sees reaches `on_signal(signum)`
    on a watcher thread (`name`), through `signal.set_wakeup_fd`: also while the main thread sits
    in one C++ call (a compile), where no Python handler runs. Installs no handler itself; the
    previous wakeup fd is restored after the block. Main thread only (as set_wakeup_fd)."""
    r, w = socket.socketpair()
    w.setblocking(False)
    old_fd = signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)
    thread = threading.Thread(target=_watch, args=(r, on_signal), name=name, daemon=True)
    thread.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(old_fd)
        r.shutdown(socket.SHUT_RDWR)
        thread.join(timeout=1.0)
        r.close()
        w.close()


def _exit_now(signum: int, what: str) -> None:
    if signum in CODES:
        try:
            os.write(2, f"dropless: {signal.Signals(signum).name}: {what} stopped, nothing "
                        "written\n".encode())
        finally:
            os._exit(CODES[signum])


@contextlib.contextmanager
def exit_on_signals(what: str) -> Iterator[None]:
    """Within the block, SIGINT / SIGTERM print 'dropless: SIGINT: <what> stopped, nothing
    written' and end the process at once (exit 130 / 75; see the module). Main thread only;
    elsewhere (a test's worker thread) the block changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    with signal_watcher(lambda signum: _exit_now(signum, what), "dropless-exit-on-signal"):
        # a Python-level handler that does nothing: the C-level one still writes the signal
        # number to the wakeup fd, and no KeyboardInterrupt unwinds the main thread
        old = {s: signal.signal(s, lambda *_: None) for s in CODES}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)


@contextlib.contextmanager
def interrupt_quietly(line: str) -> Iterator[None]:
    """Within the block, a KeyboardInterrupt reported as unraisable (raised inside a finalizer or
    a callback) writes `line` and ends the process at once with exit 130, instead of being
    printed and lost (see the module); every other unraisable exception goes to the previous
    hook. Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = sys.unraisablehook

    def hook(u) -> None:
        if not isinstance(u.exc_value, KeyboardInterrupt):
            previous(u)
            return
        try:
            sys.stdout.flush()
            os.write(2, (line + "\n").encode())
        finally:
            os._exit(EXIT_SIGINT)
    sys.unraisablehook = hook
    try:
        yield
    finally:
        if sys.unraisablehook is hook:
            sys.unraisablehook = previous
