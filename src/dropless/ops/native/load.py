"""Building and loading the native library: every C++ source in `csrc/` compiled into one shared
library the first time it is needed, with the system's C++ compiler (or the `ziglang`
package's, where there is none) against jaxlib's FFI headers and the `scipy-openblas32` wheel,
for this CPU (-march=native), into a cache folder keyed by everything the binary depends on:
each source and header, the compile command, the compiler's version, the CPU, and the versions
of jaxlib and scipy-openblas32 (`DROPLESS_CACHE`, default `~/.cache/dropless`). A finished build
is moved into place atomically, so concurrent processes never load a half-written file (an
unwritable cache folder: the temp folder).

`problem()` builds, loads and registers the library's FFI handlers for the CPU once a process,
and says why it cannot where it cannot (no compiler, no wheel, a failed build); the grouped
matmul's `auto` then runs `tiled`. Loading also reads the GEMM kernel choice,
DROPLESS_NATIVE_KERNEL (choice.py says what it means).
"""
from __future__ import annotations

import ctypes
import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import jax

NATIVE = Path(__file__).parent / "csrc"
SOURCES = tuple(sorted(NATIVE.glob("*.cc")))   # one library
HEADERS = tuple(sorted(NATIVE.glob("*.h")))

TARGET = "dropless_grouped_gemm_f32"
# FFI target name -> the handler symbol in the library: the grouped GEMMs, and the row gathers
GEMM_HANDLERS = {TARGET: "DroplessGroupedGemmF32",
                 "dropless_gate_up_swiglu_f32": "DroplessGateUpSwigluF32",
                 "dropless_swiglu_dlhs_f32": "DroplessSwigluDlhsF32",
                 "dropless_dual_dlhs_f32": "DroplessDualDlhsF32"}
ROW_HANDLERS = {"dropless_gather_rows_f32": "DroplessGatherRowsF32",
                "dropless_gather_sum_f32": "DroplessGatherSumF32",
                "dropless_row_dots_f32": "DroplessRowDotsF32",
                "dropless_sort_by_expert": "DroplessSortByExpert",
                "dropless_top_k": "DroplessTopK"}
HANDLERS = {**GEMM_HANDLERS, **ROW_HANDLERS}

KERNEL_ENV = "DROPLESS_NATIVE_KERNEL"
KERNEL_CHOICES = ("auto", "own", "openblas")   # the library's choice codes 0, 1, 2

_LOCK = threading.Lock()
_STATE: dict[str, object] = {}   # "problem": str | None once decided; "lib": the loaded CDLL


def cache_dir() -> Path:
    """Where built kernels are kept: $DROPLESS_CACHE/native, else ~/.cache/dropless/native."""
    root = os.environ.get("DROPLESS_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "dropless")
    return Path(root) / "native"


def _compiler() -> list[str] | None:
    """The C++ compiler command: $CXX, c++, g++ or clang++ on PATH, else the `ziglang` package's
    (pip-installable; its first build takes minutes); None when there is none."""
    cxx = next((c for c in (os.environ.get("CXX"), "c++", "g++", "clang++")
                if c and shutil.which(c)), None)
    if cxx is not None:
        return [cxx]
    if importlib.util.find_spec("ziglang") is not None:
        return [sys.executable, "-m", "ziglang", "c++"]
    return None


def _cpu() -> str:
    """This CPU's model and feature flags (-march=native builds for it; a cache folder shared
    by several machines keeps one build per CPU)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        import platform  # noqa: PLC0415
        return platform.processor() or platform.machine()
    return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))


def _build_inputs() -> tuple[list[str], str]:
    """The compile command (output path last, to be filled in) and its cache key."""
    import scipy_openblas32  # noqa: PLC0415 (optional at import time of the package)
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (set CXX, install g++, or pip install ziglang)")
    inc_ffi = jax.ffi.include_dir()
    lib_dir = scipy_openblas32.get_lib_dir()
    # -march=native and -fno-trapping-math let the fused handlers' elementwise loops vectorize;
    # -ffp-contract=fast lets the tiled kernel's multiply-adds be FMAs under -std=c++17
    cmd = [*cxx, "-O3", "-march=native", "-fno-trapping-math", "-ffp-contract=fast",
           "-std=c++17", "-shared", "-fPIC",
           "-w", f"-I{inc_ffi}", *map(str, SOURCES),
           f"-L{lib_dir}", f"-l{scipy_openblas32.get_library()}", f"-Wl,-rpath,{lib_dir}"]
    version = subprocess.run([*cxx, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([
        *(f.read_text() for f in SOURCES + HEADERS), " ".join(cmd), version, _cpu(),
        importlib.metadata.version("jaxlib"), importlib.metadata.version("scipy-openblas32"),
    ]).encode()).hexdigest()[:16]
    return cmd, key


def build() -> Path:
    """Compile the library into the cache (once per key) and return the shared library's path.
    Raises RuntimeError (with the compiler's message) when it cannot be built."""
    cmd, key = _build_inputs()
    out = None
    for root in (cache_dir(), Path(tempfile.gettempdir()) / f"dropless-{os.getuid()}" / "native"):
        out = root / key / "libdropless_gmm.so"
        if out.exists():
            return out
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(out.parent, os.W_OK):
            break   # else: an unwritable cache folder, build into the temp folder instead
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        proc = subprocess.run(cmd + ["-o", tmp], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"building {', '.join(f.name for f in SOURCES)} failed: "
                               f"{(proc.stderr or proc.stdout).strip()[-600:]}")
        os.replace(tmp, out)   # atomic: a reader sees no file or the whole one
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def problem() -> str | None:
    """Why the native library cannot run in this process (None: it can). Builds, loads and
    registers the library on first call; the answer is kept for the process."""
    with _LOCK:
        if "problem" not in _STATE:
            try:
                lib = ctypes.CDLL(str(build()))
                for target, symbol in HANDLERS.items():
                    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                                platform="cpu")
                _STATE["lib"] = lib
                _STATE["problem"] = None
                try:   # the kernel choice, once: a bad value fails every call, naming it
                    lib.dropless_set_kernel(kernel_code(os.environ.get(KERNEL_ENV) or "auto",
                                                        KERNEL_ENV))
                except ValueError as e:
                    _STATE["kernel_error"] = f"{e} (or leave it unset)"
            except ImportError:
                _STATE["problem"] = "the scipy-openblas32 package is not installed"
            except (RuntimeError, OSError, AttributeError) as e:
                _STATE["problem"] = f"the native kernel is unavailable: {e}"
        return _STATE["problem"]  # type: ignore[return-value]


def kernel_code(name: str, where: str) -> int:
    """The library's code for GEMM kernel choice `name` (its index in KERNEL_CHOICES). Raises
    ValueError naming `where` (the setting it came from) and the choices."""
    if name not in KERNEL_CHOICES:
        raise ValueError(f"{where}={name!r}: use one of {', '.join(KERNEL_CHOICES)}")
    return KERNEL_CHOICES.index(name)


def require() -> None:
    """Raise unless the library's GEMMs can run: RuntimeError saying why it is not built (use
    `tiled`), ValueError naming a bad DROPLESS_NATIVE_KERNEL."""
    why = problem()
    if why is not None:
        raise RuntimeError(f"grouped_matmul backend 'native': {why}; use backend='tiled'")
    if "kernel_error" in _STATE:
        raise ValueError(_STATE["kernel_error"])


def loaded() -> ctypes.CDLL | None:
    """The loaded library, None where it cannot run (`problem()` says why)."""
    return None if problem() is not None else _STATE["lib"]  # type: ignore[return-value]


def library() -> ctypes.CDLL:
    """The loaded library, for its settings and counters (raises as `require` does)."""
    require()
    return _STATE["lib"]  # type: ignore[return-value]
