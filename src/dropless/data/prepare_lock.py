"""One writer per `data prepare` output: an exclusive `fcntl.flock` on `OUT/.prepare/lock`.

The lock is held for the whole prepare. The kernel releases a flock when its holder dies, so the
lock file a killed run leaves is simply locked again by the next run; the file's text (pid, host,
start time of the holder) only names the holder in the refusal of a second prepare.
"""
from __future__ import annotations

import datetime
import fcntl
import os
import socket
from pathlib import Path

LOCK_NAME = "lock"


class PrepareLock:
    """Hold the lock on `folder / LOCK_NAME` (`folder` is created) until `release`; raises
    ValueError naming the holder when another process holds it."""

    def __init__(self, folder: Path):
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / LOCK_NAME
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 512, 0).decode(errors="replace").strip() or "unknown"
            os.close(self.fd)
            raise ValueError(f"{folder.parent} is being written by another `data prepare` "
                             f"({holder}); wait for it to end or choose another output "
                             "folder") from None
        start = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        text = f"pid {os.getpid()} on {socket.gethostname()}, started {start}".encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, text, 0)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)     # closing the descriptor releases the flock
            self.fd = -1
