"""`tokamax`: delegate to `tokamax.ragged_dot` (the Pallas kernel library MaxText uses on GPU).

Legend: M rows (sorted by group), K contraction dim, N output dim, G groups.

tokamax is optional (`pip install 'dropless[gpu]'`), and a choice that cannot crash `auto`:
  - supported pairs (checked against each wheel's Requires-Dist and imports): tokamax 0.0.12
    with jax 0.10.x (Python 3.11+; it calls `pl.dot`, which jax 0.11 removed), tokamax 0.0.17
    with jax >= 0.11.1 (Python 3.12+; it imports `xprof` at start-up, and its "triton"
    implementation exists only when `jax_triton` is installed). `tokamax_problem()` names what
    is wrong with the installed pair, and `auto` then picks `pallas_gpu` instead.
  - the default implementation list is what the installed tokamax offers of ("mosaic",
    "triton"), never its "xla" fallback (`jax.lax.ragged_dot`, zero-padded on CUDA).
  - tuned configs shipped for the device kind (`tokamax_tuned`: ops/gpu/tuned/
    tokamax_<kind>.json) are applied around the forward and the backward of each call; without
    a file for the kind tokamax uses its heuristic; the choice records which (`configs`).
  - each implementation is tried in order; a failure to trace or to lower it for CUDA (any
    exception: tokamax declining a shape, no NVIDIA device at trace time when cross-lowering,
    an API that moved) falls back to our `pallas_gpu` kernels with one log line saying which
    implementation failed and why. Passing `implementation="xla"` explicitly is allowed.
"""
from __future__ import annotations

import functools
import logging

import jax

from dropless.ops.gmm import choices, winners
from dropless.ops.gpu import tokamax_tuned
from dropless.ops.gpu.pallas_gpu import pallas_gpu_gmm

IMPLEMENTATIONS = ("mosaic", "triton", "xla")
PREFERRED = ("mosaic", "triton")
SUPPORTED = "tokamax 0.0.12 with jax 0.10.x, or tokamax 0.0.17 with jax >= 0.11.1"
log = logging.getLogger("dropless.ops.gmm")


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits or 0))
    return tuple(out)


def version_problem(tokamax_version: str, jax_version: str) -> str | None:
    """Why this tokamax cannot run beside this jax (None if the pair is supported)."""
    t, j = _version_tuple(tokamax_version), _version_tuple(jax_version)
    if t < (0, 0, 12):
        return f"tokamax {tokamax_version} is older than 0.0.12; supported: {SUPPORTED}"
    if t < (0, 0, 13) and j >= (0, 11):
        return (f"tokamax {tokamax_version} calls jax.experimental.pallas.dot, which jax "
                f"{jax_version} removed; supported: {SUPPORTED}")
    if t >= (0, 0, 13) and j < (0, 11, 1):
        return (f"tokamax {tokamax_version} needs jax >= 0.11.1, not {jax_version}; "
                f"supported: {SUPPORTED}")
    if t >= (0, 0, 18):
        return f"tokamax {tokamax_version} is newer than the tested 0.0.17; supported: {SUPPORTED}"
    return None


def import_tokamax():
    """Import tokamax, or raise ImportError saying which extra installs it."""
    try:
        import tokamax  # noqa: PLC0415 (optional dependency)
    except Exception as e:  # noqa: BLE001 (0.0.17 raises ImportError for xprof, others vary)
        raise ImportError("grouped_matmul backend 'tokamax' needs the optional package tokamax: "
                          "pip install 'dropless[gpu]' (or pip install tokamax); "
                          f"import failed: {type(e).__name__}: {e}") from e
    # tokamax reads its settings from absl flags and, if nobody parsed them, parses sys.argv on
    # first use: under `dropless train --preset ...` or pytest that raises UnrecognizedFlagError.
    # We run no absl app, so take the flags' defaults (an absl app that parsed them is left alone)
    from absl import flags  # noqa: PLC0415 (a dependency of tokamax)
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    return tokamax


@functools.cache
def tokamax_problem() -> str | None:
    """None when tokamax imports and its version suits this jax; else why not (cached)."""
    version = tokamax_version()
    if version is None:
        return "tokamax is not installed"
    problem = version_problem(version, jax.__version__)
    if problem:
        return problem
    try:
        import_tokamax()
    except ImportError as e:
        return str(e)
    return None


def available_implementations(tokamax) -> tuple[str, ...]:
    """Which of PREFERRED this tokamax registers ("mosaic" is "mosaic_gpu" in its table)."""
    table = getattr(getattr(getattr(tokamax, "ops", None), "ragged_dot", None),
                    "IMPLEMENTATIONS", None)
    if table is None:
        try:
            from tokamax._src.ops.ragged_dot import api  # noqa: PLC0415 (no public table)
            table = api.IMPLEMENTATIONS
        except Exception:  # noqa: BLE001 (layout changed: try every preferred one)
            return PREFERRED
    keys = set(table)
    return tuple(i for i in PREFERRED if i in keys or f"{i}_gpu" in keys)


def _check_implementation(implementation) -> tuple[str, ...] | None:
    if implementation is None:
        return None
    impls = (implementation,) if isinstance(implementation, str) else tuple(implementation)
    bad = [i for i in impls if i not in IMPLEMENTATIONS]
    if not impls or bad:
        raise ValueError(f"tokamax implementation={implementation!r} must be one of "
                         f"{IMPLEMENTATIONS} or a non-empty sequence of them")
    return impls


def _probe(tokamax, impl, avals, out_dtype) -> None:
    """Trace and lower tokamax's forward and backward for CUDA on these shapes (raises)."""
    def f(lhs, rhs, gs, dy):
        out, vjp = jax.vjp(lambda a, b: tokamax.ragged_dot(
            a, b, gs, preferred_element_type=out_dtype, implementation=(impl,)), lhs, rhs)
        return out, vjp(dy)
    jax.jit(f).trace(*avals).lower(lowering_platforms=("cuda",))


@functools.lru_cache(maxsize=256)
def _works(impl: str, shapes: tuple, dtypes: tuple, out_dtype) -> str | None:
    """None if `impl` traces and lowers for these shapes, else the failure (cached)."""
    tokamax = import_tokamax()
    avals = [jax.ShapeDtypeStruct(s, d) for s, d in zip(shapes, dtypes)]
    try:
        _probe(tokamax, impl, avals, out_dtype)
    except Exception as e:  # noqa: BLE001 (any failure: fall back, never crash auto)
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    return None


def tokamax_gmm(lhs_MK, rhs_GKN, group_sizes_G, *, out_dtype, implementation=None):
    """`tokamax.ragged_dot` with `jax.lax.ragged_dot` semantics; differentiable (tokamax's VJP).

    implementation: one of ("mosaic", "triton", "xla") or a sequence tried in order; default:
    those of ("mosaic", "triton") the installed tokamax has. The first that traces and lowers
    for CUDA on these shapes runs; if none does (or tokamax is unusable beside this jax), our
    `pallas_gpu` kernels run and one warning says why. With "xla" in the list, failures raise.
    Raises ImportError naming the `gpu` extra when tokamax is missing (asked for by name),
    ValueError for an unknown implementation.
    """
    impls = _check_implementation(implementation)
    tokamax = import_tokamax()
    key = choices.shape_key(lhs_MK, rhs_GKN, group_sizes_G, out_dtype)
    if impls is not None and "xla" in impls:   # asked for tokamax's own fallback: as is
        choices.note({"asked": "tokamax", "backend": "tokamax", "shape": key,
                       "implementation": ",".join(impls)})
        return tokamax.ragged_dot(lhs_MK, rhs_GKN, group_sizes_G,
                                  preferred_element_type=out_dtype, implementation=impls)
    problem = version_problem(tokamax_version() or "0", jax.__version__)
    reasons = [problem] if problem else []
    if not problem:
        impls = impls or available_implementations(tokamax)
        if not impls:
            reasons.append("this tokamax has neither a 'mosaic' nor a 'triton' implementation")
        dy = jax.ShapeDtypeStruct((lhs_MK.shape[0], rhs_GKN.shape[2]), out_dtype)
        shapes = (lhs_MK.shape, rhs_GKN.shape, group_sizes_G.shape, dy.shape)
        dtypes = (lhs_MK.dtype, rhs_GKN.dtype, group_sizes_G.dtype, dy.dtype)
        tuned = tokamax_tuned.tuned(winners.device_kind(), tokamax)
        for impl in impls:
            with tokamax_tuned.applied(tuned):
                why = _works(impl, shapes, dtypes, out_dtype)
            if why is None:
                choices.note({"asked": "tokamax", "backend": "tokamax", "shape": key,
                               "implementation": impl, "configs": tuned.status})
                return _tuned_ragged_dot(tokamax, tuned, impl, out_dtype)(
                    lhs_MK, rhs_GKN, group_sizes_G)
            reasons.append(f"{impl}: {why}")
    _warn_once(f"grouped_matmul: tokamax did not run lhs {tuple(lhs_MK.shape)} rhs "
               f"{tuple(rhs_GKN.shape)} {lhs_MK.dtype} ({'; '.join(reasons)}); using pallas_gpu")
    choices.note({"asked": "tokamax", "backend": "pallas_gpu", "shape": key,
                   "reason": f"tokamax did not trace or lower: {'; '.join(reasons)}"[:400]})
    return pallas_gpu_gmm(lhs_MK, rhs_GKN, group_sizes_G, out_dtype=out_dtype)


def _tuned_ragged_dot(tokamax, tuned, impl, out_dtype):
    """`tokamax.ragged_dot` with `tuned` applied while its forward and its backward are traced
    (tokamax picks a config when traced; a backward is traced after the forward's context has
    closed, so it re-enters it). Without tuned configs: tokamax's own call and VJP."""
    def call(lhs_MK, rhs_GKN, group_sizes_G):
        return tokamax.ragged_dot(lhs_MK, rhs_GKN, group_sizes_G,
                                  preferred_element_type=out_dtype, implementation=(impl,))
    if tuned.result is None:
        return call

    @jax.custom_vjp
    def f(lhs_MK, rhs_GKN, group_sizes_G):
        with tokamax_tuned.applied(tuned):
            return call(lhs_MK, rhs_GKN, group_sizes_G)

    def fwd(lhs_MK, rhs_GKN, group_sizes_G):
        return f(lhs_MK, rhs_GKN, group_sizes_G), (lhs_MK, rhs_GKN, group_sizes_G)

    def bwd(res, dy_MN):
        lhs_MK, rhs_GKN, group_sizes_G = res
        with tokamax_tuned.applied(tuned):   # XLA drops the forward this recomputes
            _, vjp = jax.vjp(lambda a, b: call(a, b, group_sizes_G), lhs_MK, rhs_GKN)
            return (*vjp(dy_MN), None)

    f.defvjp(fwd, bwd)
    return f


@functools.cache
def _warn_once(line: str) -> None:
    """One log line per distinct fallback (a function traced again does not repeat it)."""
    log.warning("%s", line)


def tokamax_version() -> str | None:
    """tokamax's version, or None when it is not installed (for bench metadata)."""
    try:
        from importlib.metadata import version  # noqa: PLC0415
        return version("tokamax")
    except Exception:  # noqa: BLE001 (not installed: any metadata error means the same)
        return None


__all__ = ["tokamax_gmm", "import_tokamax", "tokamax_version", "tokamax_problem",
           "version_problem", "IMPLEMENTATIONS", "PREFERRED"]
