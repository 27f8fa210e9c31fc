"""`tokamax`: delegate to `tokamax.ragged_dot` (the Pallas kernel library MaxText uses on GPU).

Legend: M rows (sorted by group), K contraction dim, N output dim, G groups.

tokamax is optional (`pip install 'dropless[gpu]'`). Its kernels: Mosaic GPU ones for SM90
(Hopper) and SM100 (Blackwell) and a Triton one; it picks the Mosaic kernel by looking at the
default device when the function is traced. Its own fallback, `implementation="xla"`, is
`jax.lax.ragged_dot`, which on CUDA is the zero-padded dense product this backend exists to
avoid, so our default tries only ("mosaic", "triton"), and when tokamax declines both (a shape or
dtype it does not support, or no NVIDIA device at trace time, e.g. when cross-lowering from a
CPU host) this backend runs our own `pallas_gpu` kernels instead of ragged_dot. Passing
`implementation="xla"` explicitly is allowed.
"""
from __future__ import annotations

from dropless.ops.gmm.pallas_gpu import pallas_gpu_gmm

IMPLEMENTATIONS = ("mosaic", "triton", "xla")
DEFAULT_IMPLEMENTATION = ("mosaic", "triton")


def import_tokamax():
    """Import tokamax, or raise ImportError saying which extra installs it."""
    try:
        import tokamax  # noqa: PLC0415 (optional dependency)
    except ImportError as e:
        raise ImportError("grouped_matmul backend 'tokamax' needs the optional package tokamax: "
                          "pip install 'dropless[gpu]' (or pip install tokamax); "
                          f"import failed: {e}") from e
    # tokamax reads its settings from absl flags and, if nobody parsed them, parses sys.argv on
    # first use: under `dropless train --preset ...` or pytest that raises UnrecognizedFlagError.
    # We run no absl app, so take the flags' defaults (an absl app that parsed them is left alone)
    from absl import flags  # noqa: PLC0415 (a dependency of tokamax)
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    return tokamax


def _check_implementation(implementation) -> tuple[str, ...]:
    impls = (implementation,) if isinstance(implementation, str) else tuple(implementation)
    bad = [i for i in impls if i not in IMPLEMENTATIONS]
    if not impls or bad:
        raise ValueError(f"tokamax implementation={implementation!r} must be one of "
                         f"{IMPLEMENTATIONS} or a non-empty sequence of them")
    return impls


def tokamax_gmm(lhs_MK, rhs_GKN, group_sizes_G, *, out_dtype,
                implementation=DEFAULT_IMPLEMENTATION):
    """`tokamax.ragged_dot` with `jax.lax.ragged_dot` semantics; differentiable (tokamax's VJP).

    implementation: one of ("mosaic", "triton", "xla") or a sequence tried in order.
    Raises ImportError naming the `gpu` extra when tokamax is missing, ValueError for an
    unknown implementation.
    """
    impls = _check_implementation(implementation)
    tokamax = import_tokamax()
    try:
        return tokamax.ragged_dot(lhs_MK, rhs_GKN, group_sizes_G,
                                  preferred_element_type=out_dtype, implementation=impls)
    except (NotImplementedError, ExceptionGroup):
        if "xla" in impls:
            raise
        # tokamax declined every kernel asked for: run ours, never the padded ragged_dot
        return pallas_gpu_gmm(lhs_MK, rhs_GKN, group_sizes_G, out_dtype=out_dtype)


def tokamax_version() -> str | None:
    """tokamax's version, or None when it is not installed (for bench metadata)."""
    try:
        from importlib.metadata import version  # noqa: PLC0415
        return version("tokamax")
    except Exception:  # noqa: BLE001 (not installed: any metadata error means the same)
        return None


__all__ = ["tokamax_gmm", "import_tokamax", "tokamax_version", "IMPLEMENTATIONS",
           "DEFAULT_IMPLEMENTATION"]
