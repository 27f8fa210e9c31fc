"""Building and loading the native library (load.py): it builds here and is `auto`'s CPU choice;
the build cache (every source and header in its key, atomic, concurrent, an unwritable folder)
and a build that fails with a reason; the `ziglang` compiler where there is no system one; the
AVX2 and SSE builds by DROPLESS_NATIVE_ISA."""
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from dropless.ops.gmm.registry import resolve_backend
from dropless.ops.native import calibrate, load


ROOT = Path(__file__).resolve().parents[3]


def test_builds_here_and_is_autos_cpu_choice():
    # the suite's environment has the dependency and a compiler: a silent fall back to tiled
    # would make every CPU number in the benches a different kernel's
    assert load.problem() is None
    assert resolve_backend("auto", "cpu") == "native"


def test_build_without_a_compiler_says_so(monkeypatch, tmp_path):
    monkeypatch.setenv("DROPLESS_CACHE", str(tmp_path))
    monkeypatch.setattr(load, "_compiler", lambda: None)
    with pytest.raises(RuntimeError, match="no C.. compiler"):
        load.build()
    assert not any(tmp_path.rglob("*.so"))


def test_concurrent_builds_into_one_empty_cache_both_load(tmp_path):
    # two processes build the same key at once: each compiles to its own temp file and moves it
    # into place, so both load a whole library and no temp file is left behind
    script = textwrap.dedent("""
        import jax.numpy as jnp, numpy as np
        from dropless.ops import native
        assert native.problem() is None, native.problem()
        out = native.gmm_forward(jnp.ones((4, 3)), jnp.ones((2, 3, 2)), jnp.array([1, 2]))
        assert np.asarray(out).tolist() == [[3, 3], [3, 3], [3, 3], [0, 0]], out
        print(native.build())
    """)
    env = dict(os.environ, DROPLESS_CACHE=str(tmp_path), JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    paths = {out.strip().splitlines()[-1] for out, _ in outs}
    assert len(paths) == 1
    # and each calibrated this CPU on first use: the one calibration file is whole
    files = sorted((f for f in tmp_path.rglob("*") if f.is_file()), key=lambda f: f.suffix)
    assert [f.suffix for f in files] == [".json", ".so"] and files[1].name == "libdropless_gmm.so"
    entry = json.loads(files[0].read_text())
    assert files[0].parent.name == "calibration" and set(entry["chosen"]) == set(
        calibrate.SETTINGS)


def test_an_unwritable_cache_folder_builds_in_the_temp_folder(monkeypatch, tmp_path):
    # DROPLESS_CACHE names a file: its folder cannot be made, so the build goes to the temp folder
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("")
    monkeypatch.setenv("DROPLESS_CACHE", str(blocker))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", None)   # gettempdir() reads TMPDIR again
    # where the build goes is decided before the compiler runs, and the whole library's compile
    # is the concurrent test's: a build of the smallest source (the same command, folder choice,
    # temp file and move into place) costs a second instead of the whole library's ~20
    monkeypatch.setattr(load, "SOURCES", (min(load.SOURCES, key=lambda f: f.stat().st_size),))
    path = load.build()
    assert path.is_file() and str(path).startswith(str(tmp_path / "tmp"))
    assert blocker.read_text() == ""


@pytest.mark.skipif(importlib.util.find_spec("ziglang") is None,
                    reason="ziglang not installed (the compiler pip brings; 100 MB, not in CI)")
def test_without_a_system_compiler_ziglang_builds_a_working_kernel(monkeypatch, tmp_path):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(load.shutil, "which", lambda name: None)
    assert load._compiler()[1:] == ["-m", "ziglang", "c++"]
    monkeypatch.setenv("DROPLESS_CACHE", str(tmp_path))
    path = load.build()
    script = ("import ctypes, sys, jax, jax.numpy as jnp, numpy as np\n"
              "lib = ctypes.CDLL(sys.argv[1])\n"
              "jax.ffi.register_ffi_target('t', jax.ffi.pycapsule(lib.DroplessGroupedGemmF32),"
              " platform='cpu')\n"
              "out = jax.ffi.ffi_call('t', jax.ShapeDtypeStruct((3, 2), jnp.float32))("
              "jnp.ones((3, 4)), jnp.ones((1, 4, 2)), jnp.array([2], jnp.int32), mode=np.int32(0))\n"
              "assert np.asarray(out).tolist() == [[4, 4], [4, 4], [0, 0]], out\n")
    subprocess.run([sys.executable, "-c", script, str(path)], check=True, timeout=120)


def test_one_library_from_every_source_keyed_by_every_source_and_header(monkeypatch, tmp_path):
    # csrc/*.cc are compiled together and csrc/*.h are what they include: a change to any of
    # them is a new cache key (a new build), and the compile command names every source
    assert set(load.SOURCES) == set(load.NATIVE.glob("*.cc")) and len(load.SOURCES) > 1
    assert set(load.HEADERS) == set(load.NATIVE.glob("*.h")) and load.HEADERS
    cmd, key = load._build_inputs()
    assert all(str(f) in cmd for f in load.SOURCES)
    copies = tmp_path / "csrc"
    copies.mkdir()
    for f in load.SOURCES + load.HEADERS:
        (copies / f.name).write_text(f.read_text())
    monkeypatch.setattr(load, "SOURCES", tuple(copies / f.name for f in load.SOURCES))
    monkeypatch.setattr(load, "HEADERS", tuple(copies / f.name for f in load.HEADERS))
    base = load._build_inputs()[1]
    keys = set()
    for f in load.SOURCES + load.HEADERS:
        text = f.read_text()
        f.write_text(text + "\n// changed\n")
        keys.add(load._build_inputs()[1])
        f.write_text(text)
    assert base not in keys and len(keys) == len(load.SOURCES + load.HEADERS)
    assert load._build_inputs()[1] == base


def test_the_isa_variable_picks_the_build_and_a_bad_value_is_named(monkeypatch):
    # DROPLESS_NATIVE_ISA=avx2 / sse: this CPU's flags less AVX-512 / AVX, each its own cache key
    keys = {}
    for isa, flags in load.ISA_FLAGS.items():
        monkeypatch.setenv(load.ISA_ENV, isa)
        cmd, keys[isa] = load._build_inputs()
        assert "-march=native" in cmd and all(f in cmd for f in flags)
    assert len(set(keys.values())) == len(load.ISA_FLAGS)
    monkeypatch.setenv(load.ISA_ENV, "avx1024")
    with pytest.raises(RuntimeError, match="DROPLESS_NATIVE_ISA='avx1024': use one of native, "
                                           "avx2, sse"):
        load._build_inputs()
