"""Writing a file so that a reader (or a crash, or a full disk) sees the old file or the new
one, never a mix or a truncated one: the bytes go to a temporary file beside the destination
(`.NAME.tmp-PID-N`, same folder, so the same file system), are flushed to disk, and the file is
renamed over the destination in one `os.replace`. On any error the temporary file is removed
and the destination is left as it was.

Every file dropless writes whole (config.json, the run marker, converted model files, plots,
plan and bench outputs) goes through here; append-only logs (metrics.jsonl) are not rewritten
and are not. `same_file` is the check every lock taken on an open file or folder makes (the
name still means what was locked).
"""
from __future__ import annotations

import contextlib
import itertools
import os
from pathlib import Path
from typing import Iterator

_COUNTER = itertools.count()


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def replacing(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside `path` for the caller to write (by any means: `savefig`,
    `np.save`, a library's writer); on a clean exit it is flushed and renamed over `path`, on an
    exception it is removed and `path` is untouched. Raises what the write or the rename
    raises (OSError: no space, permission)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{next(_COUNTER)}")
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(path.parent)


def write_bytes(path: str | Path, data: bytes) -> None:
    """Write `data` to `path` whole or not at all (see `replacing`)."""
    with replacing(path) as tmp:
        with open(tmp, "wb") as fh:
            fh.write(data)


def write_text(path: str | Path, text: str) -> None:
    """Write `text` (UTF-8) to `path` whole or not at all (see `replacing`)."""
    write_bytes(path, text.encode("utf-8"))


def same_file(path: str | Path, fd: int) -> bool:
    """True while `path` still names the file (or folder) open as `fd`: not removed, renamed
    or replaced since it was opened (what a lock taken on `fd` protects)."""
    try:
        a, b = os.stat(path), os.fstat(fd)
    except OSError:
        return False
    return (a.st_ino, a.st_dev) == (b.st_ino, b.st_dev)
