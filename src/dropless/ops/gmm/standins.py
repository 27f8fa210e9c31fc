"""Stand-in grouped-matmul kernels that fail the way a GPU kernel can, reproducible on CPU.

Legend: M rows (sorted by group), K contraction dim, N output dim, G groups.

`failing_gmm("compile")` traces and lowers like a kernel (a custom call, forward and backward)
but XLA cannot compile it: no handler is registered for its target, as when a Mosaic GPU or
Triton kernel is refused by its compiler. `failing_gmm("run")` compiles and fails when it
first executes (a host callback that raises, as a kernel launch that errors). Registered over
`tokamax` with `registry.stand_in(..., first_on="cpu")`, they make `auto` on CPU meet the
failures `ops/gmm/fallback.py` survives on a GPU; the tests and `bench gpu --dry-run` use them.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dropless.ops.gmm.tiled import tiled_gmm

STAGES = ("compile", "run")
TARGET = "dropless_standin_kernel_without_handler"


def _missing_kernel(*operands, shape, dtype):
    """A custom call XLA has no handler for: lowers, fails to compile."""
    return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(shape, dtype))(*operands)


def _raise_at_run(x):
    raise RuntimeError("stand-in kernel failed when it ran")


def _fails_at_run(out):
    """`out`, computed once a host callback that raises has run: fails on execution."""
    flag = jax.pure_callback(_raise_at_run, jax.ShapeDtypeStruct((), out.dtype),
                             jax.lax.stop_gradient(out).sum())
    return out + flag * 0


def failing_gmm(stage: str):
    """A backend function (`fn(lhs_MK, rhs_GKN, group_sizes_G, *, out_dtype) -> out_MN`,
    differentiable) that fails at `stage` ("compile" or "run"); ValueError for another."""
    if stage not in STAGES:
        raise ValueError(f"stage={stage!r} is not one of {STAGES}")

    @functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
    def gmm(lhs_MK, rhs_GKN, group_sizes_G, out_dtype):
        if stage == "compile":
            return _missing_kernel(lhs_MK, rhs_GKN, group_sizes_G,
                                   shape=(lhs_MK.shape[0], rhs_GKN.shape[2]), dtype=out_dtype)
        return _fails_at_run(tiled_gmm(lhs_MK, rhs_GKN, group_sizes_G, out_dtype=out_dtype))

    def fwd(lhs_MK, rhs_GKN, group_sizes_G, out_dtype):
        return gmm(lhs_MK, rhs_GKN, group_sizes_G, out_dtype), (lhs_MK, rhs_GKN, group_sizes_G)

    def bwd(out_dtype, res, dy_MN):
        lhs_MK, rhs_GKN, group_sizes_G = res
        if stage == "compile":
            d_lhs = _missing_kernel(dy_MN, rhs_GKN, group_sizes_G, shape=lhs_MK.shape,
                                    dtype=lhs_MK.dtype)
        else:
            d_lhs = _fails_at_run(jnp.zeros_like(lhs_MK))
        return d_lhs, jnp.zeros_like(rhs_GKN), None

    gmm.defvjp(fwd, bwd)

    def backend(lhs_MK, rhs_GKN, group_sizes_G, *, out_dtype):
        return gmm(lhs_MK, rhs_GKN, group_sizes_G, jnp.dtype(out_dtype))
    return backend


__all__ = ["failing_gmm", "STAGES"]
