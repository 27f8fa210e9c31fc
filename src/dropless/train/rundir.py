"""Run directories: one per run, never shared by two processes, gone when a run never started.

A new run's directory is made with an exclusive `mkdir` (a timestamped name gets `-2`, `-3`, ...
when a run started in the same second already took it), and every run holds an exclusive
`flock` on its directory for the life of the process, so a second process resuming the same
directory is refused instead of interleaving checkpoints and metrics. The lock is taken on the
directory itself, not on a lock file, so a refused resume leaves the directory byte-identical;
the kernel drops it when the process dies, even by kill -9.

A folder is a run only if dropless made it: a new run's directory gets the marker file
`.dropless-run` (a JSON object naming the dropless version and the time) as it is created, and,
for a run started from a model (`init_from`), its own copy of the Hugging Face config.json keys
that model keeps (hf_kept_config.json, `init_from.keep_start_config`), so an export of the run
does not depend on that folder still being there.
Training into, or resuming, a non-empty folder without the marker is refused before anything
is written, in one line saying what the folder looks like (a Hugging Face model folder, a
dropless model directory, something else) and what to do; a run made before the marker existed
is recognised by its own structure (config.json holding a TrainConfig, and checkpoints/ or
metrics.jsonl) and gets its marker once its resume is under way (`RunDir.mark`). Path mistakes
(`run_name` naming a nested or absolute path, a file where a folder belongs, a folder that
cannot be written) are refused as ValueError before any compilation.

`heal_metrics` cuts a torn last line of metrics.jsonl (a process killed in the middle of a
write) back to the last complete record before a resume appends to it.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
import time
from pathlib import Path

from dropless.config import TrainConfig
from dropless.runtime import files

MARKER = ".dropless-run"      # written into every run directory as it is created


class RunDirInUse(RuntimeError):
    """Another live process holds the run directory."""


class RunDir:
    """An open, locked run directory. `created`: this process made it (a new run)."""

    def __init__(self, path: Path, created: bool, fd: int, made_parents: tuple[Path, ...] = ()):
        self.path, self.created, self._fd = path, created, fd
        self.made_parents = made_parents   # RUN_DIR and the folders above it this process made
        self.steps_done = 0          # steps this process completed (set by the loop)
        self.marked_empty = False    # the marker was written into a folder found empty
        self.found: tuple[str, ...] = ()   # the empty folders (mount points) it held then

    def write_json(self, name: str, obj) -> None:
        """Write RUN_DIR/name atomically (a temporary file renamed over it)."""
        files.write_text(self.path / name, json.dumps(obj, indent=2))

    def mark(self) -> None:
        """Write the run marker unless it is there (a run made before the marker existed gets
        it here, once its resume is under way)."""
        if not (self.path / MARKER).exists():
            write_marker(self.path)

    def release(self) -> None:
        """Drop the lock (idempotent)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def discard(self) -> None:
        """Remove the directory of a new run that never completed a step (a folder found empty:
        what the run put in it, so it is left as found); release the lock."""
        self.release()
        if self.marked_empty:
            self._empty_again()
        for _ in range(3):   # a file created meanwhile (another thread) fails one pass
            if not self.created or not self.path.exists():
                break
            shutil.rmtree(self.path, ignore_errors=True)
        for parent in self.made_parents if self.created else ():   # innermost first
            try:
                parent.rmdir()           # only while empty: another run may have started there
            except OSError:
                break

    def undo(self) -> str | None:
        """Undo a run that completed no step where it made the folder (removed) or found it
        empty (left empty); the words saying so, or None for a run that keeps its folder (a
        resumed one)."""
        if not (self.created or self.marked_empty):
            return None
        self.discard()
        return (f"the new run directory {self.path} was removed" if self.created else
                f"{self.path} was left empty, as it was found")

    def _empty_again(self) -> None:
        """Remove what this run wrote into the folder it found empty (the marker, the start
        record, orbax's folder, ...): only the empty folders it found there stay, emptied.
        Otherwise the folder would be left neither empty nor a run, and refused next time."""
        for p in list(self.path.iterdir()) if self.path.is_dir() else ():
            kept = p.name in self.found and p.is_dir() and not p.is_symlink()
            for q in (list(p.iterdir()) if kept else [p]):
                if q.is_dir() and not q.is_symlink():
                    shutil.rmtree(q, ignore_errors=True)
                else:
                    q.unlink(missing_ok=True)


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


def write_marker(path: Path) -> None:
    """Write the run marker into folder `path`."""
    # the package's version, read from the package already imported (Python imports
    # `dropless` before any of its modules), not imported here: it sits above every layer
    version = sys.modules["dropless"].__version__
    files.write_text(path / MARKER, json.dumps(
        {"dropless": version, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}) + "\n")


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def _older_run(path: Path) -> bool:
    """A run directory written before the marker existed: config.json holding a TrainConfig
    (`model` and `steps`) beside checkpoints/ or metrics.jsonl, and no params/."""
    conf = _json(path / "config.json")
    return (isinstance(conf, dict) and {"model", "steps"} <= set(conf)
            and not (path / "params").exists()
            and ((path / "checkpoints").is_dir() or (path / "metrics.jsonl").is_file()))


def looks_like(path: Path) -> tuple[str, str]:
    """(what non-empty folder `path`, not a run, looks like; what to do instead)."""
    conf = _json(path / "config.json")
    conf = conf if isinstance(conf, dict) else {}
    if "architectures" in conf or "model_type" in conf or any(path.glob("*.safetensors")):
        return ("a Hugging Face model folder", f"to train from its weights use "
                f"init_from=hf:{path} with a new run_name")
    if "model" in conf and (path / "params").is_dir():
        return ("a dropless model directory (`dropless convert` output)",
                f"to train from its weights use init_from={path} with a new run_name")
    if "model" in conf:
        return ("a dropless directory without a run's checkpoints/ or metrics.jsonl",
                "pick a new run_name (or empty the folder)")
    names = sorted(p.name for p in path.iterdir())
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return (f"something else (it holds {shown})", "pick a new run_name or run_dir (or empty "
            "the folder)")


_PREPARED = ("checkpoints", "tb", "profile")   # empty folders a user may make (mount) first


def _empty(path: Path) -> bool:
    """True for a folder holding nothing, or only empty folders a run would make itself (a
    checkpoints/ mount point prepared before the run)."""
    return all(p.name in _PREPARED and p.is_dir() and not any(p.iterdir())
               for p in path.iterdir())


def check_is_run(path: Path) -> bool:
    """Raise ValueError unless folder `path` may be trained into: a run (its marker, or a run
    made before the marker existed) or an empty folder (see `_empty`); True when empty."""
    if (path / MARKER).exists() or _older_run(path):
        return False
    if _empty(path):
        return True
    kind, todo = looks_like(path)
    raise ValueError(f"{path} is not a dropless run (it has no {MARKER}): it looks like {kind}; "
                     f"nothing was changed. To start a run, {todo}")


def check_run_name(name: str) -> None:
    """Raise ValueError unless `name` is one folder name (no separator, not `.` or `..`)."""
    if not name:
        return
    if "/" in name or os.sep in name or name in (".", "..") or name != name.strip():
        raise ValueError(f"run_name={name!r} must be one folder name (no '/', not '.' or '..', "
                         "no surrounding spaces); put the folders above it in run_dir=")


def _make_root(root: Path) -> None:
    """Create run_dir (and the folders above it); ValueError for a file in the way or a folder
    that cannot be written."""
    for p in (root, *root.parents):
        if p.exists() and not p.is_dir():
            raise ValueError(f"run_dir={str(root)!r}: {p} is a file, not a folder; set run_dir "
                             "to a folder")
        if p.exists():
            break
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"run_dir={str(root)!r} cannot be created ({e.strerror}); set run_dir "
                         "to a writable folder") from None
    if not os.access(root, os.W_OK | os.X_OK):
        raise ValueError(f"run_dir={str(root)!r} is not writable; set run_dir to a writable "
                         "folder (or fix its permissions)")


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
    """Open (and lock) RUN_DIR/run_name, creating it (with its marker) if absent; with no
    run_name, create a new uniquely named RUN_DIR/<YYYYmmdd-HHMMSS>-<preset>[-N]. Raises
    ValueError for a path mistake or a folder that is not a run (see the module doc),
    RunDirInUse if another process holds it."""
    root = Path(cfg.run_dir)
    check_run_name(cfg.run_name)
    made = tuple(p for p in (root, *root.parents) if not p.exists())   # innermost first
    _make_root(root)
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
        empty = False if created else check_is_run(path)
        run = RunDir(path, created, _lock(path), made if created else ())
        if created or empty:
            _mark_new(run, empty, cfg)
        return run
    base = time.strftime("%Y%m%d-%H%M%S") + f"-{cfg.preset or 'custom'}"
    for n in range(1, 10_000):
        path = root / (base if n == 1 else f"{base}-{n}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        run = RunDir(path, True, _lock(path), made)
        _mark_new(run, False, cfg)
        return run
    raise RuntimeError(f"could not create a unique run directory under {root} for {base}")


def _mark_new(run: RunDir, empty: bool, cfg: TrainConfig) -> None:
    """Write a new run's start files: the marker, and the kept config.json keys of the model it
    starts from (`init_from.keep_start_config`). A failure undoes the folder (`RunDir.discard`:
    removed, or emptied as it was found) and is raised."""
    from dropless.train.init_from import keep_start_config
    run.marked_empty = empty
    run.found = tuple(p.name for p in run.path.iterdir()) if empty else ()
    try:
        write_marker(run.path)
        keep_start_config(cfg, run.path)
    except BaseException:
        run.discard()
        raise
