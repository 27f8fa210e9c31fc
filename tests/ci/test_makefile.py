"""The Makefile's setup: a .venv made by another (or an unsupported) Python is rebuilt with a
message, never reused; an unsupported $(PYTHON) is refused before anything is created.

Fake interpreters (shell scripts printing what the Makefile's version probe prints) stand in for
other Python versions; `make -n` shows what would run without installing anything.
"""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tests._support.paths import ROOT

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def fake_python(path: Path, answer: str) -> Path:
    """An 'interpreter' that answers the Makefile's probe ("major.minor ok") and nothing else."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'#!/bin/sh\necho "{answer}"\n')
    path.chmod(0o755)
    return path


def real_python(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    path.chmod(0o755)
    return path


@pytest.fixture
def project(tmp_path):
    shutil.copy(ROOT / "Makefile", tmp_path)
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    return tmp_path


# what a make running these tests hands its children (`make test-main` from a shell vs. from
# .ci/legs): the make under test starts from none of it, so the result is the same either way
MAKE_ENV = {k: v for k, v in os.environ.items()
            if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")}


def make(project, *args):
    return subprocess.run(["make", *args], cwd=project, capture_output=True, text=True,
                          timeout=60, env=MAKE_ENV)


def test_an_installed_venv_of_the_same_python_is_reused(project):
    real_python(project / ".venv/bin/python")
    (project / ".venv/.installed").touch()
    r = make(project, "-q", "setup", f"PYTHON={sys.executable}")
    assert r.returncode == 0, r.stdout + r.stderr  # up to date: nothing would run


def test_a_venv_of_another_python_is_recreated_with_a_message(project):
    fake_python(project / ".venv/bin/python", "3.9 0")
    (project / ".venv/.installed").touch()  # even when it looks installed
    r = make(project, "-n", "setup", f"PYTHON={sys.executable}")
    v = f"{sys.version_info[0]}.{sys.version_info[1]}"
    assert r.returncode == 0, r.stderr
    assert f"was made by Python 3.9, not {sys.executable} ({v}): recreating it" in r.stdout
    assert "rm -rf .venv" in r.stdout and "-m venv .venv" in r.stdout
    assert "pip install -q --no-compile -e '.[test,report,mkl]'" in r.stdout  # report plots and MKL too


def test_a_broken_venv_is_recreated(project):
    (project / ".venv/bin").mkdir(parents=True)
    (project / ".venv/bin/python").symlink_to(project / "removed-interpreter")
    (project / ".venv/.installed").touch()
    r = make(project, "-n", "setup", f"PYTHON={sys.executable}")
    assert "that no longer runs" in r.stdout and "rm -rf .venv" in r.stdout, r.stdout


def test_an_unsupported_python_is_refused_before_creating_anything(project):
    old = fake_python(project / "bin/python3.10", "3.10 0")
    r = make(project, "test", f"PYTHON={old}")
    assert r.returncode != 0
    assert f"dropless needs Python >= 3.11, but {old} is 3.10" in r.stdout
    assert "make PYTHON=python3.12 test" in r.stdout
    assert not (project / ".venv").exists()
    r = make(project, "run", "PYTHON=no-such-python3")
    assert "no-such-python3 is not runnable" in r.stdout and r.returncode != 0


def _legs_project(tmp_path: Path) -> Path:
    """A project whose Makefile has legs that pass (ok, ok2) and one that fails (bad), with the
    real .ci/legs."""
    (tmp_path / ".ci").mkdir()
    shutil.copy(ROOT / ".ci/legs", tmp_path / ".ci/legs")
    (tmp_path / "Makefile").write_text(
        "ok:\n\t@echo ran ok\nok2:\n\t@echo ran ok2 $(GPU_LEG)\nbad:\n\t@echo ran bad; exit 3\n")
    return tmp_path


def test_every_leg_runs_and_the_failed_one_is_named(tmp_path):
    project = _legs_project(tmp_path)
    r = subprocess.run([".ci/legs", "ok", "bad", "ok2"], cwd=project, capture_output=True,
                       text=True, timeout=60, env={"PATH": "/usr/bin:/bin",
                                                   "MAKEFLAGS": "GPU_LEG=required"})
    assert r.returncode == 1
    out = r.stdout.splitlines()
    # the leg after the failed one still ran, with make's variables
    assert "ran ok" in out and "ran bad" in out and "ran ok2 required" in out
    summary = out[-4:]
    assert summary[0].startswith("ci: ok passed in ")
    assert summary[1].startswith("ci: bad FAILED (exit 2) in ")   # make's status for a failure
    assert summary[2].startswith("ci: ok2 passed in ")
    assert summary[3] == "ci: 1 of 3 legs failed: bad (rerun one with 'make bad')"
    # each leg's line says the disk space left after it, and the first line the space before
    assert all(re.search(r" s \(\d+\.\d GiB free after\)$", line) for line in summary[:3])
    assert re.fullmatch(r"ci: \d+\.\d GiB free before the legs", out[0])


def test_all_legs_passing_says_so(tmp_path):
    project = _legs_project(tmp_path)
    r = subprocess.run([".ci/legs", "ok", "ok2"], cwd=project, capture_output=True, text=True,
                       timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 0 and r.stdout.splitlines()[-1] == "ci: all 2 legs passed"
    assert r.stderr == ""   # (an empty list of failed legs is no error under set -u)


def test_make_test_runs_the_three_legs_through_the_leg_runner(project):
    real_python(project / ".venv/bin/python")
    (project / ".venv/.installed").touch()
    (project / ".ci").mkdir()
    shutil.copy(ROOT / ".ci/legs", project / ".ci/legs")
    r = make(project, "-n", "test", f"PYTHON={sys.executable}")   # the legs' makes see -n too
    assert r.returncode == 0, r.stderr
    assert ".ci/legs test-main test-native-avx2 test-gpu-lowering" in r.stdout
    assert "-m pytest -n auto --dist loadfile tests/ops/native tests/moe/test_layer.py" in r.stdout
    assert "DROPLESS_NATIVE_ISA=avx2 " in r.stdout
    # the concurrent-build test is the main leg's alone (the race is the same for every ISA)
    assert "--deselect tests/ops/native/test_load.py::test_concurrent_builds" in r.stdout
    assert "def test_concurrent_builds_into_one_empty_cache_both_load(" in (
        ROOT / "tests/ops/native/test_load.py").read_text()   # a stale name deselects nothing
    assert r.stdout.splitlines()[-1] == "ci: all 3 legs passed"


def _gpu_leg_commands() -> dict[str, list[str]]:
    """What `make test-gpu-lowering` runs in this checkout: {venv: the test files it gets}."""
    r = subprocess.run(["make", "-n", "--no-print-directory", "test-gpu-lowering"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60, env=MAKE_ENV)
    assert r.returncode == 0, r.stderr
    legs = {}
    for line in r.stdout.splitlines():
        words = line.split()
        assert words[0] == ".ci/jax_leg" and words[3] == "test", line
        legs[words[1]] = words[4:]
    return legs


def test_the_gpu_compile_tests_run_on_the_gpu_machines_jax_only():
    legs = _gpu_leg_commands()
    assert set(legs) == {".venv-jax011", ".venv-jaxnew"}
    old, new = legs[".venv-jax011"], legs[".venv-jaxnew"]
    compiles = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("tests/**/test_*_gpu_compile.py"))
    assert "tests/train/test_preflight_gpu_compile.py" in compiles
    assert "tests/ops/gpu/test_mosaic_gpu_compile.py" in compiles
    # jax 0.11.2 (the GPU machines' JAX) runs everything; the newest release all but the compiles
    # and the device check's dry run (the device check runs on the GPU machines' JAX)
    assert sorted(set(old) - set(new)) == sorted(compiles + ["tests/bench/test_gpu.py"])
    assert set(new) < set(old) and len(old) == len(set(old))
    # every file that needs the CUDA plugin is in the leg, and every file named exists
    needs_plugin = {str(p.relative_to(ROOT)) for p in ROOT.glob("tests/**/test_*.py")
                    if p != Path(__file__) and "require_plugin(" in p.read_text()}
    assert needs_plugin and needs_plugin <= set(old)
    assert all((ROOT / f).is_file() for f in old)


@pytest.mark.parametrize("found", [True, False], ids=["gpu-leg-runs", "no-python312"])
def test_the_main_leg_leaves_the_device_checks_dry_run_to_the_gpu_leg(project, found):
    """tests/bench/test_gpu.py (the device check's dry run, minutes) runs in the GPU leg, on the
    GPU machines' JAX; the main leg runs it only where no Python 3.12 is found for that leg."""
    real_python(project / ".venv/bin/python")
    (project / ".venv/.installed").touch()
    finder = project / ".ci/find_python312"
    finder.parent.mkdir()
    finder.write_text("#!/bin/sh\n" + ("echo /usr/bin/python3.12\n" if found
                                       else "echo 'no Python 3.12 found' >&2\nexit 1\n"))
    finder.chmod(0o755)
    r = make(project, "-n", "test-main", f"PYTHON={sys.executable}")
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if "-m pytest" in ln).rstrip()
    assert line.endswith("--dist loadfile" + (" --ignore=tests/bench/test_gpu.py" if found
                                              else "")), line
    assert "tests/bench/test_gpu.py" in _gpu_leg_commands()[".venv-jax011"]
