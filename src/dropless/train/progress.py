"""What the user sees while a run trains: a progress bar with ETA on a terminal, plain lines
elsewhere.

On a terminal (`stdout.isatty()`) the bar every command shows (`runtime.progress`) shows step
n/N, elapsed time, ETA, the last loss and tokens/s; other lines (start-up summary, "compiling ...", evals, the resume command) are
printed above it, and the per-step lines are left to RUN_DIR/metrics.jsonl. Anywhere else (a log
file, a pipe, tests) there is no bar and the per-step lines are printed every `log_every` steps.
"""
from __future__ import annotations

import sys
import time
from typing import Any, Callable

from dropless.runtime.progress import on_terminal, terminal_bar


class Progress:
    """`line(text)` prints a line; `step(n, loss, tokens_per_s, text)` advances the display."""

    def __init__(self, echo: Callable[[str], Any] = print, *, bar: bool | None = None):
        if bar is None:
            bar = echo is print and on_terminal()
        self.echo, self._bar, self._task = echo, None, None
        if bar:
            self._bar = terminal_bar("step", count="steps")

    @property
    def bar(self) -> bool:
        return self._bar is not None

    def line(self, text: str) -> None:
        if self._bar is not None:
            self._bar.console.print(text, markup=False)
        else:
            self.echo(text)

    def start(self, *, first: int, total: int) -> None:
        """Begin counting at step `first` (a resumed run) of `total`."""
        if self._bar is not None:
            self._bar.start()
            self._task = self._bar.add_task("train", total=total, completed=first, status="")

    def step(self, n: int, *, loss: float, tokens_per_s: float, text: str | None) -> None:
        """Step `n` is done; `text` is its line (printed only without a bar)."""
        if self._bar is not None:
            self._bar.update(self._task, completed=n,
                             status=f"loss {loss:.4f} | {tokens_per_s:,.0f} tok/s")
        elif text:
            self.echo(text)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


class Timed:
    """`with Timed(progress, "compiling (first step)"):` prints "compiling (first step)..." and
    then "  compiled in 12.3 s" (the duration is kept in `.seconds`)."""

    def __init__(self, progress: Progress, what: str, done: str = "done"):
        self.progress, self.what, self.done, self.seconds = progress, what, done, 0.0

    def __enter__(self) -> "Timed":
        self.progress.line(f"{self.what}...")
        sys.stdout.flush()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.seconds = time.perf_counter() - self._t0
        if exc_type is None:
            self.progress.line(f"  {self.done} in {self.seconds:.1f} s")
