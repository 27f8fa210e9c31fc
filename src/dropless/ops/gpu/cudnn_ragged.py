"""`cudnn_ragged_dot`: XLA's cuDNN grouped GEMM for `jax.lax.ragged_dot`, only where detected.

Legend: M rows (sorted by group), K contraction dim, N output dim, G groups.

XLA:GPU lowers `ragged_dot` to a cuDNN grouped GEMM when the process runs with
`--xla_gpu_experimental_use_ragged_dot_fusion=true` in XLA_FLAGS and the loaded cuDNN is 9.22
or newer (older ones lack the grouped GEMM; XLA then runs ragged_dot as the zero-padded dense
product, G times the FLOPs, without a word). Nothing here is assumed: `cudnn_version()` asks
the loaded library (the jax CUDA plugin's version helper, else libcudnn's `cudnnGetVersion`),
`problem()` names what is missing, and the backend is usable (`registry.unusable`) only when
both the flag and the version are there. Asked for by name where it is not, it raises that
line rather than run the padded product. `info()` is the record the device check writes.
"""
from __future__ import annotations

import ctypes
import functools
import os

from dropless.ops.gmm import choices
from dropless.ops.gmm.baselines import ragged_dot_gmm

FLAG = "--xla_gpu_experimental_use_ragged_dot_fusion=true"
MIN_VERSION = (9, 22)


def _from_int(v: int) -> tuple[int, int, int]:
    """cuDNN 9's version integer (major*10000 + minor*100 + patch): 92200 -> (9, 22, 0)."""
    return v // 10000, (v % 10000) // 100, v % 100


def _plugin_version() -> int | None:
    """cuDNN's version as the jax CUDA plugin this process imported reports it (jax looks for
    the cuda13 plugin, then cuda12's), None where there is none or it cannot say."""
    try:
        from jax._src.lib import cuda_versions  # noqa: PLC0415 (the plugin's _versions or None)
        return int(cuda_versions.cudnn_get_version()) if cuda_versions is not None else None
    except Exception:  # noqa: BLE001 (no plugin, no library: unknown)
        return None


def _library_version() -> int | None:
    for name in ("libcudnn.so.9", "libcudnn.so"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        lib.cudnnGetVersion.restype = ctypes.c_size_t
        return int(lib.cudnnGetVersion())
    return None


@functools.cache
def cudnn_version() -> tuple[int, int, int] | None:
    """The cuDNN this process loads, (major, minor, patch); None when none is found."""
    v = _plugin_version() or _library_version()
    return _from_int(v) if v else None


def flag_set(xla_flags: str | None = None) -> bool:
    """Whether XLA_FLAGS (or `xla_flags`) turns the ragged-dot fusion on."""
    flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    return FLAG in flags.split()


def problem_for(version: tuple[int, int, int] | None, flag: bool) -> str | None:
    """Why the cuDNN grouped GEMM cannot be used with this cuDNN and flag (None: it can)."""
    if version is None:
        return "cudnn_ragged_dot: no cuDNN library found in this process"
    text = ".".join(map(str, version))
    if version[:2] < MIN_VERSION:
        return (f"cudnn_ragged_dot needs cuDNN >= {MIN_VERSION[0]}.{MIN_VERSION[1]} for XLA's "
                f"grouped GEMM; this process loads {text}")
    if not flag:
        return f"cudnn_ragged_dot needs XLA_FLAGS to hold {FLAG} (cuDNN {text} is new enough)"
    return None


def problem() -> str | None:
    """Why this process cannot use the cuDNN grouped GEMM (None: it can)."""
    return problem_for(cudnn_version(), flag_set())


def info() -> dict:
    """{"cudnn_version": "9.19.0" or None, "cudnn_ragged_dot": "usable" or why not}."""
    v = cudnn_version()
    return {"cudnn_version": ".".join(map(str, v)) if v else None,
            "cudnn_ragged_dot": problem() or "usable"}


def cudnn_ragged_gmm(lhs_MK, rhs_GKN, group_sizes_G, *, out_dtype):
    """`jax.lax.ragged_dot`, which XLA runs as cuDNN's grouped GEMM in this process; raises
    ValueError (the `problem()` line) where it would not."""
    why = problem()
    if why is not None:
        raise ValueError(why)
    choices.note({"asked": "cudnn_ragged_dot", "backend": "cudnn_ragged_dot",
                  "shape": choices.shape_key(lhs_MK, rhs_GKN, group_sizes_G, out_dtype),
                  "implementation": f"cuDNN {info()['cudnn_version']}"})
    return ragged_dot_gmm(lhs_MK, rhs_GKN, group_sizes_G, out_dtype=out_dtype)


__all__ = ["cudnn_version", "problem", "problem_for", "info", "flag_set", "cudnn_ragged_gmm",
           "FLAG", "MIN_VERSION"]
