"""Which GEMM kernel the native library runs, and what it says it ran.

Each form's GEMM (forward, dlhs, drhs, the fused gate and up) is the library's own
register-tiled kernel, OpenBLAS's sgemm or, where the `mkl` wheel is installed, MKL's, as this
CPU's calibration chose (calibrate.py; before one, the build's rule: the tiled kernel in AVX-512
builds, OpenBLAS elsewhere): "auto".
DROPLESS_NATIVE_KERNEL=own|openblas|mkl|auto, read when the library loads, forces one for the
process, and `use_kernel` for a block; `kernel()` says which setting holds, `gemm_calls()` how
many GEMMs each kernel has run, and `describe()` puts it in a benchmark record. `chunk_rows()`
and `stream_min_bytes()` are the tiled kernel's sizes on this machine, for the tests that reach
past them (`use_chunk_bytes` makes the chunk small).
"""
from __future__ import annotations

import contextlib
import ctypes

from dropless.ops.native.load import (KERNEL_CHOICES, amx_ready, calibration, kernel_code, library,
                                      loaded, mkl_version)


def core() -> str | None:
    """The kernel set OpenBLAS runs in this process ("SkylakeX", "Haswell", ...: its own
    detection, or OPENBLAS_CORETYPE where that is set), or None where the library cannot run."""
    lib = loaded()
    if lib is None:
        return None
    fn = lib.scipy_openblas_get_corename
    fn.restype = ctypes.c_char_p
    return fn().decode()


def describe() -> dict[str, object]:
    """What the native library runs here, for benchmark records: OpenBLAS's kernel set
    ("openblas_core"), the tiled kernel's vector width in floats ("native_vector_floats"; 16
    in AVX-512 builds, where "auto" runs it for every group) and the kernel choice
    ("native_kernel": "own", "openblas", "mkl", or "auto", the library's rule;
    DROPLESS_NATIVE_KERNEL or `use_kernel`), the MKL it may choose ("native_mkl": the `mkl`
    wheel's version, None without one), whether bf16 products run on AMX tiles
    ("native_bf16_amx"; else `tiled`), and
    this CPU's calibrated choices with the medians that made them (calibrate.py:
    "native_choices", "native_choice_ms", "native_calibration"). Empty where the library cannot
    run."""
    lib = loaded()
    if lib is None:
        return {}
    cal = calibration()
    return {"openblas_core": core(),
            "native_vector_floats": int(lib.dropless_vector_floats()),
            "native_kernel": kernel(), "native_mkl": mkl_version(),
            "native_bf16_amx": amx_ready(),
            **(cal.record() if cal is not None else {})}


@contextlib.contextmanager
def use_kernel(name: str):
    """Run the native library's GEMMs on `name` ("own": the tiled kernel, "openblas", "mkl",
    or "auto", the library's rule) while the block runs, for every call in the process (it is
    one setting, read when a call runs); the previous choice is restored after. For benchmarks
    and tests. Raises ValueError for another name, and for "mkl" where MKL is not installed."""
    code = kernel_code(name, "use_kernel")
    lib = library()
    before = lib.dropless_kernel()
    lib.dropless_set_kernel(code)
    try:
        yield
    finally:
        lib.dropless_set_kernel(before)


def kernel() -> str:
    """The native library's kernel choice now: "auto" (its rule), "own", "openblas" or "mkl"."""
    return KERNEL_CHOICES[library().dropless_kernel()]


def stream_min_bytes() -> int | None:
    """The output size above which the grouped GEMM's forward and rhs gradient are written with
    streaming stores (the workers' L2s together), None where the build has no such stores."""
    fn = library().dropless_stream_min_bytes
    fn.restype = ctypes.c_int64
    got = int(fn())
    return None if got < 0 else got


def chunk_rows() -> dict[str, int]:
    """The tiled kernel's contraction chunk (rows of B a tile reads before C is written and read
    back; half the L2 over a panel's width) by product: "nn" (forward, drhs), "nt" (dlhs and the
    fused backward's, in 2-vector passes) and "gate_up" (the fused forward)."""
    fn = library().dropless_chunk_rows
    fn.restype, fn.argtypes = ctypes.c_int64, [ctypes.c_int]
    return {name: int(fn(i)) for i, name in enumerate(("nn", "nt", "gate_up"))}


# the library's setting id of the contraction chunk's bytes (csrc/kernel.h: kChunkBytes)
_CHUNK_BYTES = 6


@contextlib.contextmanager
def use_chunk_bytes(nbytes: int):
    """Cut the tiled kernel's contractions into chunks of B filling `nbytes` (instead of half the
    L2) while the block runs, for every call in the process: the tests reach past a chunk with
    small operands this way. Raises ValueError for fewer than 1024 bytes."""
    if nbytes < 1024:
        raise ValueError(f"use_chunk_bytes({nbytes}): at least 1024 bytes")
    lib = library()
    before = lib.dropless_setting(_CHUNK_BYTES)
    lib.dropless_set_setting(_CHUNK_BYTES, int(nbytes))
    try:
        yield
    finally:
        lib.dropless_set_setting(_CHUNK_BYTES, before)


def gemm_calls() -> dict[str, int]:
    """GEMMs the native library has run in this process, by kernel ("own", "openblas",
    "mkl")."""
    fn = library().dropless_gemm_calls
    fn.restype, fn.argtypes = ctypes.c_int64, [ctypes.c_int]
    return {"own": int(fn(1)), "openblas": int(fn(0)), "mkl": int(fn(2))}
