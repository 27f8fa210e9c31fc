"""Building and loading the native library: every C++ source in `csrc/` compiled into one shared
library the first time it is needed, with the system's C++ compiler (or the `ziglang`
package's, where there is none) against jaxlib's FFI headers and the `scipy-openblas32` wheel,
for this CPU (-march=native), into a cache folder keyed by everything the binary depends on:
each source and header, the compile command, the compiler's version, the CPU, and the versions
of jaxlib and scipy-openblas32 (`DROPLESS_CACHE`, default `~/.cache/dropless`). A finished build
is moved into place atomically, so concurrent processes never load a half-written file (an
unwritable cache folder: the temp folder).

DROPLESS_NATIVE_ISA=avx2 builds it without AVX-512 (-mno-avx512f), =sse without AVX (-mno-avx),
so one machine runs the other builds' code paths (CI's AVX2 leg); unset or =native: all of
this CPU's. Each build is its own cache entry.

`problem()` builds, loads and registers the library's FFI handlers for the CPU once a process,
and says why it cannot where it cannot (no compiler, no wheel, a failed build, a bad
DROPLESS_NATIVE_ISA); the grouped matmul's `auto` then runs `tiled`. Where the `mkl` wheel is
installed (`pip install dropless[mkl]`), loading opens its libmkl_rt for MKL's sgemm, a third
GEMM kernel beside the library's own and OpenBLAS's (`mkl_library`). Loading then applies this
CPU's calibrated choices (calibrate.py: measured on first use, cached per CPU and build;
`calibration()` says what and why) and the GEMM kernel forced by DROPLESS_NATIVE_KERNEL, if any
(choice.py says what it means).
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

from dropless.ops.native import calibrate

NATIVE = Path(__file__).parent / "csrc"
SOURCES = tuple(sorted(NATIVE.glob("*.cc")))   # one library
HEADERS = tuple(sorted(NATIVE.glob("*.h")))

TARGET = "dropless_grouped_gemm_f32"
BF16_TARGET = "dropless_grouped_gemm_bf16"   # on AMX tiles (csrc/amx_gemm.cc)
# FFI target name -> the handler symbol in the library: the grouped GEMMs, and the row gathers
GEMM_HANDLERS = {TARGET: "DroplessGroupedGemmF32",
                 BF16_TARGET: "DroplessGroupedGemmBf16",
                 "dropless_gate_up_swiglu_f32": "DroplessGateUpSwigluF32",
                 "dropless_swiglu_dlhs_f32": "DroplessSwigluDlhsF32",
                 "dropless_dual_dlhs_f32": "DroplessDualDlhsF32",
                 "dropless_swiglu_bf16": "DroplessSwigluBf16",
                 "dropless_swiglu_bwd_bf16": "DroplessSwigluBwdBf16"}
ROW_HANDLERS = {"dropless_gather_rows_f32": "DroplessGatherRowsF32",
                "dropless_gather_sum_f32": "DroplessGatherSumF32",
                "dropless_row_dots_f32": "DroplessRowDotsF32",
                "dropless_sort_by_expert": "DroplessSortByExpert",
                "dropless_top_k": "DroplessTopK"}
HANDLERS = {**GEMM_HANDLERS, **ROW_HANDLERS}

KERNEL_ENV = "DROPLESS_NATIVE_KERNEL"
# the instruction set the library is built for: this CPU's whole (-march=native), or without its
# AVX-512 (the AVX2 build, -mno-avx512f) or without AVX altogether (the SSE build, -mno-avx): a
# machine with AVX-512 runs the other builds' code paths (CI's AVX2 leg)
ISA_ENV = "DROPLESS_NATIVE_ISA"
ISA_FLAGS = {"native": (), "avx2": ("-mno-avx512f",), "sse": ("-mno-avx",)}
KERNEL_CHOICES = ("auto", "own", "openblas", "mkl")   # the library's choice codes 0, 1, 2, 3

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
    isa = os.environ.get(ISA_ENV) or "native"
    if isa not in ISA_FLAGS:
        raise RuntimeError(f"{ISA_ENV}={isa!r}: use one of {', '.join(ISA_FLAGS)} "
                           "(or leave it unset)")
    inc_ffi = jax.ffi.include_dir()
    lib_dir = scipy_openblas32.get_lib_dir()
    # -march=native and -fno-trapping-math let the fused handlers' elementwise loops vectorize;
    # -ffp-contract=fast lets the tiled kernel's multiply-adds be FMAs under -std=c++17
    cmd = [*cxx, "-O3", "-march=native", *ISA_FLAGS[isa], "-fno-trapping-math",
           "-ffp-contract=fast",
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
                path = build()
                lib = ctypes.CDLL(str(path))
                for target, symbol in HANDLERS.items():
                    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                                platform="cpu")
                _STATE["lib"] = lib
                _STATE["problem"] = None
                _open_mkl(lib)
                try:   # this CPU's choices (calibrate.py), then the forced kernel if any
                    _STATE["calibration"] = calibrate.calibrate(
                        lib, calibration_key(path), cache_dir() / "calibration")
                except ValueError as e:
                    _STATE["kernel_error"] = str(e)
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


def calibration_key(library_path: Path) -> str:
    """What the calibration is cached by: the CPU (model and flags), the build (its cache key,
    the library's folder), the workers a call runs on and the MKL it may choose (its version)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = os.environ.get("DROPLESS_NATIVE_THREADS") or f"{cores} cores"
    return (f"{_cpu()}\nbuild {library_path.parent.name}\nworkers {threads}\n"
            f"mkl {importlib.metadata.version('mkl') if _STATE.get('mkl') else 'none'}")


def mkl_library() -> Path | None:
    """The installed `mkl` wheel's runtime library (libmkl_rt.so.N), None where there is
    none."""
    try:
        listed = importlib.metadata.files("mkl") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    found = sorted(Path(str(f.locate())).resolve() for f in listed
                   if Path(str(f)).name.startswith("libmkl_rt.so"))
    return next((p for p in found if p.is_file()), None)


MKL_MISSING = "MKL is not installed here (pip install 'dropless[mkl]' on Linux x86_64)"


def _open_mkl(lib) -> None:
    """Open the mkl wheel's sgemm in the library where the wheel is installed: _STATE["mkl"]
    is its path, or None with _STATE["mkl_problem"] saying why not (not installed; installed
    but its library does not open, with the loader's words, or lacks the entry points)."""
    mkl = mkl_library()
    if mkl is not None and lib.dropless_use_mkl(str(mkl).encode()):
        _STATE["mkl"], _STATE["mkl_problem"] = mkl, None
        return
    _STATE["mkl"], _STATE["mkl_problem"] = None, MKL_MISSING
    if mkl is not None:
        try:
            ctypes.CDLL(str(mkl), mode=os.RTLD_LOCAL)
            why = "it has no MKL_Set_Threading_Layer or cblas_sgemm"
        except OSError as e:
            why = f"it does not open: {e}"
        _STATE["mkl_problem"] = f"the mkl wheel's {mkl} is not usable ({why})"


def mkl_version() -> str | None:
    """The `mkl` wheel's version where MKL's sgemm is open in this process, else None."""
    if problem() is not None or not _STATE.get("mkl"):
        return None
    return importlib.metadata.version("mkl")


def calibration() -> "calibrate.Calibration | None":
    """This process's calibration (what was chosen and why), None where the library cannot
    run."""
    return None if problem() is not None else _STATE.get("calibration")  # type: ignore


def kernel_code(name: str, where: str) -> int:
    """The library's code for GEMM kernel choice `name` (its index in KERNEL_CHOICES). Raises
    ValueError naming `where` (the setting it came from) and the choices, and for "mkl" where
    MKL is not open here."""
    if name not in KERNEL_CHOICES:
        raise ValueError(f"{where}={name!r}: use one of {', '.join(KERNEL_CHOICES)}")
    if name == "mkl" and not _STATE.get("mkl"):
        raise ValueError(f"{where}='mkl': {_STATE.get('mkl_problem') or MKL_MISSING}, so use "
                         "own, openblas or auto")
    return KERNEL_CHOICES.index(name)


def require() -> None:
    """Raise unless the library's GEMMs can run: RuntimeError saying why it is not built (use
    `tiled`), ValueError naming a bad DROPLESS_NATIVE_KERNEL."""
    why = problem()
    if why is not None:
        raise RuntimeError(f"grouped_matmul backend 'native': {why}; use backend='tiled'")
    if "kernel_error" in _STATE:
        raise ValueError(_STATE["kernel_error"])


def amx_ready() -> bool:
    """Whether the bf16 grouped GEMM runs here: the library built for AMX-BF16 (-march=native
    on a CPU that has it, not the AVX2 or SSE build) and the OS granted this process the tile
    state."""
    lib = loaded()
    return lib is not None and bool(lib.dropless_amx_ready())


def loaded() -> ctypes.CDLL | None:
    """The loaded library, None where it cannot run (`problem()` says why)."""
    return None if problem() is not None else _STATE["lib"]  # type: ignore[return-value]


def library() -> ctypes.CDLL:
    """The loaded library, for its settings and counters (raises as `require` does)."""
    require()
    return _STATE["lib"]  # type: ignore[return-value]
