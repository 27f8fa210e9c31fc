"""Run directories: one per run, never shared by two processes, gone when a run never started.

A new run's directory is made with an exclusive `mkdir` (a timestamped name gets `-2`, `-3`, ...
when a run started in the same second already took it), and every run holds an exclusive
`flock` on its directory for the life of the process, so a second process resuming the same
directory is refused instead of interleaving checkpoints and metrics. The lock is taken on the
directory itself, not on a lock file, so a refused resume leaves the directory byte-identical;
the kernel drops it when the process dies, even by kill -9.

`heal_metrics` cuts a torn last line of metrics.jsonl (a process killed in the middle of a
write) back to the last complete record before a resume appends to it.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from pathlib import Path

from dropless.config import TrainConfig


class RunDirInUse(RuntimeError):
    """Another live process holds the run directory."""


class RunDir:
    """An open, locked run directory. `created`: this process made it (a new run)."""

    def __init__(self, path: Path, created: bool, fd: int, made_parents: tuple[Path, ...] = ()):
        self.path, self.created, self._fd = path, created, fd
        self.made_parents = made_parents   # RUN_DIR and the folders above it this process made
        self.steps_done = 0          # steps this process completed (set by the loop)

    def write_json(self, name: str, obj) -> None:
        """Write RUN_DIR/name atomically (a temporary file renamed over it)."""
        tmp = self.path / f".{name}.tmp-{os.getpid()}"
        tmp.write_text(json.dumps(obj, indent=2))
        os.replace(tmp, self.path / name)

    def release(self) -> None:
        """Drop the lock (idempotent)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def discard(self) -> None:
        """Remove the directory of a new run that never completed a step; release the lock."""
        self.release()
        for _ in range(3):   # a file created meanwhile (another thread) fails one pass
            if not self.created or not self.path.exists():
                break
            shutil.rmtree(self.path, ignore_errors=True)
        for parent in self.made_parents if self.created else ():   # innermost first
            try:
                parent.rmdir()           # only while empty: another run may have started there
            except OSError:
                break


def _complete(line: bytes) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except (ValueError, UnicodeDecodeError):
        return False


def heal_metrics(path: Path) -> str | None:
    """Cut `path` (a metrics.jsonl) back to its last complete record when its last line is torn
    (no final newline, or not a JSON object); returns the words saying what was cut, or None
    when the file is whole (or absent). Only the end is looked at: a torn line in the middle is
    left for `dropless report` to skip and name."""
    if not path.is_file():
        return None
    data = path.read_bytes()
    lines = data.split(b"\n")
    if not data or (lines[-1] == b"" and _complete(lines[-2] if len(lines) > 1 else b"{}")):
        return None
    if lines[-1] != b"" and _complete(lines[-1]):   # whole record, only its newline missing
        with open(path, "ab") as fh:
            fh.write(b"\n")
        return f"{path}: its last record lacked the final newline (added)"
    keep = len(lines) - 1 if lines[-1] != b"" else len(lines) - 2   # complete lines before
    while keep > 0 and not _complete(lines[keep - 1]):              # (blank or torn) ends
        keep -= 1
    good = b"".join(x + b"\n" for x in lines[:keep])
    cut = len(data) - len(good)
    with open(path, "r+b") as fh:
        fh.truncate(len(good))
    return (f"{path}: cut a torn last line ({cut} bytes from line {keep + 1}) back to the last "
            f"complete record (line {keep})")


def _lock(path: Path) -> int:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RunDirInUse(f"run directory {path} is in use by another dropless process; wait "
                          "for it to finish (or stop it), or pick another run_name") from None
    return fd


def open_run_dir(cfg: TrainConfig) -> RunDir:
    """Open (and lock) RUN_DIR/run_name, creating it if absent; with no run_name, create a new
    uniquely named RUN_DIR/<YYYYmmdd-HHMMSS>-<preset>[-N]. Raises RunDirInUse if another process
    holds it, OSError if the parent cannot be written."""
    root = Path(cfg.run_dir)
    made = tuple(p for p in (root, *root.parents) if not p.exists())   # innermost first
    root.mkdir(parents=True, exist_ok=True)
    if cfg.run_name:
        path = root / cfg.run_name
        try:
            path.mkdir()
            created = True
        except FileExistsError:
            if not path.is_dir():
                raise ValueError(f"run_name={cfg.run_name!r}: {path} exists and is not a "
                                 "directory; pick another run_name") from None
            created = False
        return RunDir(path, created, _lock(path), made if created else ())
    base = time.strftime("%Y%m%d-%H%M%S") + f"-{cfg.preset or 'custom'}"
    for n in range(1, 10_000):
        path = root / (base if n == 1 else f"{base}-{n}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return RunDir(path, True, _lock(path), made)
    raise RuntimeError(f"could not create a unique run directory under {root} for {base}")
