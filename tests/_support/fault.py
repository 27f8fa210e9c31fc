"""The fault table's row type and runner: every way a user can break an input, a file
on disk or a run, as one row, and one runner that checks every row the same way.

A row says how to break something (`setup`), which `dropless` command to run on it (`argv`), the
exit status and the words the one-line error must contain, and which paths must be byte-identical
afterwards (a refused command changes nothing). Rows live in `tests/_support/faults_<area>.py`
files, each a `ROWS` list (and, if its rows share expensive inputs such as a trained run, a `BUILDERS` dict);
`tests/cli/test_main_faults.py` collects every such file, so a new failure mode is one more row.

What the runner checks for every row:
- the exit status is `rc`;
- for rc != 0: stderr holds no Python traceback, its first non-empty line starts with
  `dropless: error:` (or `dropless: ` for exit 75/130 stops) and contains every word of `words`
  (case-insensitive); for exit 2 that line is the only one;
- for rc == 0: every word of `words` appears in stdout + stderr (an announced recovery);
- every path of `unchanged` (relative to the case directory) is byte-identical before and after
  (a directory: every file under it, and no file added or removed);
- `check(case_dir, result)`, if given, for what only that row knows (a recovered run's records).

Where a row runs: in a fresh `python -m dropless.cli` subprocess (the default: the whole path a
user takes, signals and exit codes included), or, for a row marked `in_process=True`, by calling
`dropless.cli.main(argv)` in the test process with stdout/stderr captured, the case directory as
the working directory and the row's environment set for the call. In-process saves the ~1.5 s of
Python start-up and `import jax` per row; mark only rows refused before any JAX computation (a
bad argument, config value or data file), whose command leaves no process state behind.
FAULT_SUBPROCESS=1 runs every row in a subprocess (to check the in-process rows the slow way).
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable
from tests._support.paths import SRC



@dataclasses.dataclass(frozen=True)
class Result:
    rc: int
    out: str
    err: str


@dataclasses.dataclass(frozen=True)
class Fault:
    """One row: break something under the case directory, run a command, say what must hold.

    id: the test id (unique over all rows files).
    argv: the arguments after `dropless`, or a function of the case directory returning them.
    setup: `setup(case_dir, artifacts)` creates the broken input under case_dir (artifacts: the
      shared inputs, see `Artifacts`), or None.
    rc: the expected exit status.
    words: substrings the one-line error (or, for rc 0, the output) must contain, any case.
    unchanged: paths relative to case_dir that must be byte-identical after the command.
    check: `check(case_dir, result)` raising AssertionError, or None.
    env: extra environment variables for the command.
    timeout: seconds before the command is killed (and the row fails; subprocess rows only).
    in_process: run `dropless.cli.main` in the test process (see the module docstring); only for
      rows refused before any JAX computation.
    """
    id: str
    argv: list[str] | Callable[[Path], list[str]]
    rc: int
    words: tuple[str, ...] = ()
    setup: Callable[[Path, "Artifacts"], None] | None = None
    unchanged: tuple[str, ...] = ()
    check: Callable[[Path, Result], None] | None = None
    env: dict | None = None
    timeout: float = 600.0
    in_process: bool = False


class Artifacts:
    """Expensive inputs several rows share (a trained run directory, a converted model), each
    built once per test session by a `BUILDERS[name](dest_dir, env)` function and copied into a
    case directory with `artifacts.copy(name, dest)` (rows never change the pristine copy)."""

    def __init__(self, root: Path, builders: dict, env: dict):
        self.root, self.builders, self.env = root, builders, env

    def path(self, name: str) -> Path:
        dest = self.root / name
        if not (dest / ".built").exists():
            shutil.rmtree(dest, ignore_errors=True)
            dest.mkdir(parents=True)
            self.builders[name](dest, self.env)
            (dest / ".built").write_text("")
        return dest

    def copy(self, name: str, dest: Path) -> Path:
        src = self.path(name)
        shutil.copytree(src, dest, dirs_exist_ok=True, symlinks=True,
                        ignore=shutil.ignore_patterns(".built"))
        return dest


def command_env(cache_dir: Path) -> dict:
    """The environment of every row's command: the source tree on the path, CPU only, one
    persistent compilation cache for all rows (each train step shape compiles once)."""
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
               JAX_COMPILATION_CACHE_DIR=str(cache_dir),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", XLA_FLAGS="",
               JAX_PLATFORMS="cpu")
    env.pop("DROPLESS_TRACEBACK", None)
    return env


def run_dropless(argv: list[str], env: dict, cwd: Path, timeout: float) -> Result:
    p = subprocess.run([sys.executable, "-m", "dropless.cli", *argv], env=env, cwd=cwd,
                       capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    return Result(p.returncode, p.stdout, p.stderr)


def run_in_process(argv: list[str], env: dict, cwd: Path) -> Result:
    """`dropless.cli.main(argv)` here, as `run_dropless` would run it: output captured, `cwd` the
    working directory and `env` the environment for the call (both restored afterwards)."""
    import jax

    from dropless import cli
    # start the backend under the test process's own flags (conftest's 8 host devices) before
    # the row's environment is set: a row must not decide the devices of the tests after it
    jax.devices()
    out, err = io.StringIO(), io.StringIO()
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = cli.main(list(argv))
            except SystemExit as e:   # argparse's usage errors
                rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
    return Result(int(rc or 0), out.getvalue(), err.getvalue())


def snapshot(root: Path) -> dict:
    """Every path under `root` (or root itself, a file) with its bytes; None for directories."""
    if root.is_file():
        return {"": root.read_bytes()}
    if not root.exists():
        return {"": "missing"}
    return {str(p.relative_to(root)): (None if p.is_dir() else p.read_bytes())
            for p in sorted(root.rglob("*"))}


def check_row(row: Fault, case: Path, artifacts: Artifacts) -> Result:
    """Run one row in `case` (an empty directory) and assert everything the module doc lists."""
    if row.setup is not None:
        row.setup(case, artifacts)
    before = {p: snapshot(case / p) for p in row.unchanged}
    argv = row.argv(case) if callable(row.argv) else list(row.argv)
    env = dict(artifacts.env, **(row.env or {}))
    if row.in_process and os.environ.get("FAULT_SUBPROCESS", "") in ("", "0"):
        res = run_in_process([str(a) for a in argv], env, case)
    else:
        res = run_dropless([str(a) for a in argv], env, case, row.timeout)
    shown = f"\n--- argv: {argv}\n--- stdout:\n{res.out[-3000:]}\n--- stderr:\n{res.err[-3000:]}"
    assert res.rc == row.rc, f"exit {res.rc}, expected {row.rc}{shown}"
    assert "Traceback" not in res.err + res.out, f"a traceback{shown}"
    if row.rc == 0:
        text = (res.out + res.err).lower()
        missing = [w for w in row.words if w.lower() not in text]
    else:
        lines = [x for x in res.err.splitlines() if x.strip()]
        assert lines, f"no error line{shown}"
        prefix = "dropless: error:" if row.rc not in (75, 130) else "dropless: "
        assert lines[0].startswith(prefix), f"first stderr line is not '{prefix} ...'{shown}"
        if row.rc == 2:
            assert len(lines) == 1, f"exit 2 with more than one line on stderr{shown}"
        missing = [w for w in row.words if w.lower() not in lines[0].lower()]
    assert not missing, f"missing words {missing}{shown}"
    for p in row.unchanged:
        assert snapshot(case / p) == before[p], f"{p} changed on disk{shown}"
    if row.check is not None:
        row.check(case, res)
    return res
