"""Writing a model folder without ever destroying one: `hf.save` and `dropless convert` write into
a temporary folder beside the destination and move it into place only when it is complete.

* `check_destination` refuses, before anything is read or written: the source itself as the
  destination (also through symlinks or `..`), a destination inside the source or holding it, a
  file, and a non-empty folder unless `overwrite`.
* `staged(dst)` yields `.NAME.partial-PID` beside dst; on success its files are flushed to disk
  and it takes dst's place in one `renameat2(RENAME_EXCHANGE)` (Linux), so a reader sees the old
  folder or the new one, never a mix; the old one is then deleted. Where the exchange is not
  available, the old folder is first renamed to `.NAME.old-PID` (kept if we are killed between
  the two renames). On an error the partial folder is removed; after a kill it stays, holding no
  config.json (writers put it last), so nothing loads it, and the next write to the same
  destination removes it.
* `claimed(dst)` makes one writer at a time own a destination: an exclusive `flock` on the lock
  file `.NAME.lock` beside it, taken before anything is read or written and held to the end
  (`dropless convert` holds it for the whole conversion, `staged` takes it too). A second
  writer is refused at once (DestinationError, one line naming the holder's pid); the kernel
  drops the lock of a writer that dies, even by kill -9, so a crash never leaves it stuck (the
  stale lock file is taken over by the next writer); the holder removes the lock file when it
  is done.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import shutil
from pathlib import Path
from typing import Iterator

from dropless.runtime.files import same_file

RENAME_EXCHANGE = 2   # linux/fs.h
AT_FDCWD = -100


class DestinationError(ValueError):
    """A destination that would destroy or mix folders; the message names both paths."""


def _inside(a: Path, b: Path) -> bool:
    return a == b or b in a.parents


def check_destination(dst: str | Path, *, sources: tuple = (), overwrite: bool = False) -> Path:
    """The resolved destination; raises DestinationError (see the module doc)."""
    out = Path(dst).expanduser().resolve()
    for src in sources:
        s = Path(src).expanduser().resolve()
        if s == out:
            raise DestinationError(f"destination {dst} is the source {src} itself; write to "
                                   "another folder")
        if _inside(out, s):
            raise DestinationError(f"destination {dst} is inside the source {src}; write to a "
                                   "folder outside it")
        if _inside(s, out):
            raise DestinationError(f"destination {dst} holds the source {src}; replacing it "
                                   "would delete the source")
    if out.exists() and not out.is_dir():
        raise DestinationError(f"destination {dst} is a file, not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise DestinationError(f"destination {dst} is not empty; pass --overwrite "
                               "(overwrite=True) to replace it, or choose an empty folder")
    return out


_HELD: dict[Path, list] = {}     # lock file -> [fd, depth] of the claims this process holds


def _take(lock: Path, dst: str | Path) -> int:
    """An fd holding the exclusive lock on `lock` (created if absent); DestinationError when
    another process holds it."""
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            raise DestinationError(
                f"destination {dst} is being written by another dropless process"
                f"{f' (pid {holder})' if holder.isdigit() else ''}; wait for it to finish, or "
                "write to another folder") from None
        if same_file(lock, fd):       # not removed by a holder finishing meanwhile
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
            return fd
        os.close(fd)


@contextlib.contextmanager
def claimed(dst: str | Path) -> Iterator[Path]:
    """Within: this process is the only writer of destination `dst` (see the module doc);
    yields the lock file. Re-entrant within a process. Raises DestinationError when another
    process writes `dst`; folders it had to make for the lock file are removed again when
    they are still empty."""
    out = Path(dst).expanduser().resolve()
    lock = out.parent / f".{out.name}.lock"
    if lock in _HELD:
        _HELD[lock][1] += 1
        try:
            yield lock
        finally:
            _HELD[lock][1] -= 1
        return
    made = [p for p in (out.parent, *out.parent.parents) if not p.exists()]
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = _take(lock, dst)
    except BaseException:
        _remove_empty(made)
        raise
    _HELD[lock] = [fd, 1]
    try:
        yield lock
    finally:
        del _HELD[lock]
        if same_file(lock, fd):
            with contextlib.suppress(OSError):
                lock.unlink()
        os.close(fd)
        _remove_empty(made)


def _remove_empty(folders: list[Path]) -> None:
    for p in folders:                  # innermost first
        try:
            p.rmdir()
        except OSError:
            break


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2); False where that is not available."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (22, 38, 95):   # EINVAL / ENOSYS / EOPNOTSUPP: the file system cannot exchange
        return False
    raise OSError(err, os.strerror(err), str(b))


def _flush(folder: Path) -> None:
    """fsync every file and folder under `folder`, so the rename publishes written bytes."""
    for root, dirs, files in os.walk(folder):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(dst: Path) -> None:
    """Remove the partial folders of earlier writes to `dst` whose writer has died."""
    for p in dst.parent.glob(f".{dst.name}.partial-*"):
        pid = p.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)


def commit(tmp: Path, dst: Path) -> None:
    """Put the complete folder `tmp` at `dst` (replacing what is there, in one step if we can)."""
    _flush(tmp)
    if not dst.exists():
        os.rename(tmp, dst)
    elif _exchange(tmp, dst):
        shutil.rmtree(tmp)   # tmp now holds the old destination
    else:
        old = dst.parent / f".{dst.name}.old-{os.getpid()}"
        os.rename(dst, old)
        os.rename(tmp, dst)
        shutil.rmtree(old)
    fd = os.open(dst.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def staged(dst: str | Path) -> Iterator[Path]:
    """Yield an empty folder beside `dst`; on a clean exit it replaces dst (`commit`), on an
    exception it is removed. Call `check_destination` first. Holds `claimed(dst)` throughout
    (raises DestinationError when another process writes dst)."""
    dst = Path(dst).expanduser().resolve()
    with claimed(dst):
        dst.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(dst)
        tmp = dst.parent / f".{dst.name}.partial-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            yield tmp
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if out_of_space(e):     # named by the destination, not a file of the staging folder
                raise OSError(errno.ENOSPC, "No space left on device", str(dst)) from None
            raise
        commit(tmp, dst)


def out_of_space(exc: BaseException) -> bool:
    """True for a write that failed for want of space: an OSError ENOSPC / EDQUOT, or the
    error tensorstore raises for one under orbax (RESOURCE_EXHAUSTED ... os_error_code=28)."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(exc)
    return "No space left on device" in text or f"os_error_code='{errno.ENOSPC}'" in text
