"""The GEMM kernel choice (choice.py): DROPLESS_NATIVE_KERNEL and `use_kernel` name a bad value and
the choices; `describe` and `kernel` say which kernel runs and OpenBLAS's kernel set. Which
kernel actually ran is checked where the products run (test_gemm.py, test_ffn.py)."""
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dropless.ops.native import choice, load


ROOT = Path(__file__).resolve().parents[3]


def test_a_bad_kernel_choice_is_named():
    # read once, when the library loads: a fresh process
    code = textwrap.dedent("""
        import jax.numpy as jnp
        from dropless.ops import grouped_matmul
        grouped_matmul(jnp.ones((4, 8)), jnp.ones((1, 8, 16)), jnp.array([4], jnp.int32),
                       backend="native")
    """)
    env = dict(os.environ, DROPLESS_NATIVE_KERNEL="fastest")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          cwd=ROOT)
    assert proc.returncode != 0
    assert ("ValueError: DROPLESS_NATIVE_KERNEL='fastest': use one of auto, own, openblas, mkl "
            "(or leave it unset)") in proc.stderr
    with pytest.raises(ValueError, match="use_kernel='fast': use one of auto, own, openblas, mkl"):
        with choice.use_kernel("fast"):
            pass


def test_mkl_is_refused_in_one_line_where_it_is_not_installed(monkeypatch):
    # as a process without the mkl wheel sees it (load.py opens MKL only where it is installed)
    load.library()
    monkeypatch.setitem(load._STATE, "mkl", None)
    with pytest.raises(ValueError, match=r"^use_kernel='mkl': MKL is not installed here \(pip "
                                         r"install 'dropless\[mkl\]' on Linux x86_64\), so use "
                                         r"own, openblas or auto$"):
        with choice.use_kernel("mkl"):
            pass
    assert choice.kernel() == "auto"


def test_an_mkl_that_does_not_open_is_named_with_the_loaders_words(monkeypatch, tmp_path):
    # an installed wheel whose library is damaged: the refusal says that, not "not installed"
    lib = load.library()
    bad = tmp_path / "libmkl_rt.so.2"
    bad.write_bytes(b"not an ELF file")
    monkeypatch.setitem(load._STATE, "mkl", load._STATE.get("mkl"))
    monkeypatch.setitem(load._STATE, "mkl_problem", load._STATE.get("mkl_problem"))
    monkeypatch.setattr(load, "mkl_library", lambda: bad)
    load._open_mkl(lib)
    with pytest.raises(ValueError, match=rf"^use_kernel='mkl': the mkl wheel's {re.escape(str(bad))} is not "
                                         r"usable \(it does not open: .*\), so use own, "
                                         r"openblas or auto$"):
        with choice.use_kernel("mkl"):
            pass


def test_mkl_is_opened_where_its_wheel_is_installed():
    # the wheel's libmkl_rt, found through the installed distribution's file list
    import importlib.metadata
    try:
        version = importlib.metadata.version("mkl")
    except importlib.metadata.PackageNotFoundError:
        assert load.mkl_library() is None and choice.describe()["native_mkl"] is None
        return
    path = load.mkl_library()
    assert path is not None and path.name.startswith("libmkl_rt.so") and path.is_file()
    assert choice.describe()["native_mkl"] == version == load.mkl_version()
    assert load.library().dropless_mkl_ready() == 1


def test_describe_says_which_kernels_run():
    info = choice.describe()
    assert info["native_kernel"] == "auto" and info["native_vector_floats"] in (4, 8, 16)
    # bf16 on AMX where the CPU says it has AMX-BF16 and the build is for all of this CPU
    flags = {f for line in open("/proc/cpuinfo") if line.startswith("flags")
             for f in line.split(":", 1)[1].split()}
    native_isa = (os.environ.get("DROPLESS_NATIVE_ISA") or "native") == "native"
    assert info["native_bf16_amx"] == ({"amx_bf16", "amx_tile"} <= flags and native_isa)
    with choice.use_kernel("own"):
        assert choice.describe()["native_kernel"] == "own"
    assert choice.kernel() == "auto"
    # OpenBLAS's own name for its kernel set, or the OPENBLAS_CORETYPE it was told
    want = os.environ.get("OPENBLAS_CORETYPE")
    assert info["openblas_core"] and (not want or info["openblas_core"].lower() == want.lower())
