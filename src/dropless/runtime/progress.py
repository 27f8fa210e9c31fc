"""Progress shown to a person, the same way by every command that shows it (`train`'s steps,
`data prepare`'s bytes): one rich bar on a terminal (label, how much is done, the bar, elapsed
time, ETA, a status text), and plain lines from the command itself anywhere else."""
from __future__ import annotations

import sys
from typing import Any

COUNTS = ("steps", "bytes")


def on_terminal(*, stderr: bool = False) -> bool:
    """Whether the stream a command shows its progress on is a terminal."""
    return (sys.stderr if stderr else sys.stdout).isatty()


def terminal_bar(label: str, *, count: str, stderr: bool = False, transient: bool = False
                 ) -> Any:
    """An unstarted rich `Progress`: `label`, the amount done (`count`="steps": n/N; "bytes":
    bytes of the total), a bar, elapsed time, ETA and the task's `status` field, printed on
    stdout (or stderr). Raises ValueError for another `count`."""
    if count not in COUNTS:
        raise ValueError(f"count={count!r} must be one of {COUNTS}")
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, MofNCompleteColumn, Progress,
                               TextColumn, TimeElapsedColumn, TimeRemainingColumn)
    amount = MofNCompleteColumn() if count == "steps" else DownloadColumn()
    return Progress(TextColumn(label), amount, BarColumn(), TimeElapsedColumn(),
                    TextColumn("ETA"), TimeRemainingColumn(), TextColumn("{task.fields[status]}"),
                    console=Console(stderr=stderr, highlight=False), transient=transient)
