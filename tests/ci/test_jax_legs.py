"""The second CI leg's Python 3.12 lookup (.ci/find_python312) and its skip-or-fail rule
(.ci/jax_leg): run as CI runs them, with fake interpreters in a fake pyenv root."""
import subprocess
from pathlib import Path
from tests._support.paths import ROOT



def _fake_python(path: Path, runs: bool) -> None:
    """An executable that answers the "are you 3.12?" probe yes (exit 0) or fails to run."""
    path.parent.mkdir(parents=True)
    path.write_text("#!/bin/sh\nexit 0\n" if runs else "#!/bin/sh\nexit 1\n")
    path.chmod(0o755)


def _env(root: Path, **kw) -> dict:
    # no pyenv and no python3.12 on this PATH: only the fake root can answer
    return {"PATH": "/usr/bin:/bin", "HOME": str(root / "home"), "PYENV_ROOT": str(root), **kw}


def _run(args, env):
    return subprocess.run(args, env=env, capture_output=True, text=True, cwd=ROOT)


def test_newest_pyenv_312_that_runs_is_chosen(tmp_path):
    for version, runs in (("3.12.9", True), ("3.12.10", True), ("3.12.11", False)):
        _fake_python(tmp_path / "versions" / version / "bin" / "python3.12", runs)
    r = _run([str(ROOT / ".ci/find_python312")], _env(tmp_path))
    # 3.12.11 does not run; 3.12.10 sorts above 3.12.9 (version order, not text order)
    assert r.returncode == 0 and r.stdout.strip().endswith("versions/3.12.10/bin/python3.12")


def test_none_found_is_one_line_saying_where_it_looked(tmp_path):
    r = _run([str(ROOT / ".ci/find_python312")], _env(tmp_path, PYTHON312="/nonexistent"))
    if r.returncode == 0:   # a real /usr/bin/python3.12 on this machine answers first
        assert r.stdout.strip() in ("/usr/local/bin/python3.12", "/usr/bin/python3.12")
        return
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.startswith("no Python 3.12 found (looked at $PYTHON312, "
                               f"{tmp_path}/versions/3.12*") and len(r.stderr.splitlines()) == 1


def test_the_leg_skips_locally_and_fails_in_ci_without_312(tmp_path):
    env = _env(tmp_path, PYTHON312="/nonexistent")
    if _run([str(ROOT / ".ci/find_python312")], env).returncode == 0:
        return   # this machine has a system 3.12: nothing to skip
    venv = str(tmp_path / "venv")
    skip = _run([str(ROOT / ".ci/jax_leg"), venv, "0.11.2", "setup"], env)
    assert skip.returncode == 0 and skip.stdout.startswith("ci: SKIPPED the jax 0.11.2 leg")
    fail = _run([str(ROOT / ".ci/jax_leg"), venv, "0.11.2", "setup"],
                dict(env, GPU_LEG="required"))
    assert fail.returncode == 2 and fail.stderr.startswith("ci: error: the jax 0.11.2 leg needs")
    assert not Path(venv).exists()


def _fake_312(path: Path, log: Path) -> Path:
    """A 'Python 3.12' for .ci/jax_leg: says yes to the version probe, prints a fixed pyproject
    hash and the pinned versions, and logs a pytest run (its arguments and DROPLESS_GPU_LEG)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"""#!/bin/sh
case "$*" in
  *version_info*) exit 0 ;;
  *hashlib*) echo HASH ;;
  *importlib.metadata*) echo 0.11.2 0.11.2 0.11.2 0.11.2 ;;
  "-m pytest "*) shift 2; echo "$DROPLESS_GPU_LEG $*" >> {log} ;;
  *) exit 9 ;;
esac
""")
    path.chmod(0o755)
    return path


def test_the_leg_runs_the_files_it_is_given_and_no_others(tmp_path):
    log = tmp_path / "pytest.log"
    py = _fake_312(tmp_path / "py312/bin/python3.12", log)
    venv = tmp_path / "venv"
    _fake_312(venv / "bin/python", log)
    (venv / ".installed").write_text(f"HASH jax==0.11.2+cuda13-plugin {py}\n")  # up to date
    env = _env(tmp_path, PYTHON312=str(py), TEST_WORKERS="2")
    r = _run([str(ROOT / ".ci/jax_leg"), str(venv), "0.11.2", "test", "tests/a.py", "tests/b c.py"],
             env)
    assert r.returncode == 0, r.stderr
    assert log.read_text().splitlines() == [
        "required -n 2 --dist loadfile --no-loadscope-reorder tests/a.py tests/b c.py"]
    # no files is a mistake in the Makefile, not "run everything"
    r = _run([str(ROOT / ".ci/jax_leg"), str(venv), "0.11.2", "test"], env)
    assert r.returncode == 2 and r.stderr.startswith("ci: error: ") and "no test files" in r.stderr
    assert len(log.read_text().splitlines()) == 1
