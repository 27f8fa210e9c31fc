"""A CPU-only kernel (a jax.ffi target registered for the CPU) refused, in one line, when the
function holding it is lowered for another platform.

`on_cpu_only(fn, message)` is `fn` where the caller is lowered for CPU; lowered for any other
platform (or run eagerly where jax's default backend is not the CPU) it raises
ValueError(message.format(platform=...)) instead of leaving XLA to fail later on a custom call
it has no implementation for. The choice is made when lowering (`jax.lax.platform_dependent`),
not from jax's default backend when tracing, so it is right for arrays committed to the CPU on a
GPU host and for a function lowered for CUDA on a CPU host; a CPU-only kernel inside another
platform's unlowered branch (`auto`'s CPU branch lowered for CUDA) is never refused.

The other platforms' branch is values of `fn`'s output shapes made by a primitive whose lowering
raises; its custom VJP makes the cotangents such values too, so a gradient-only caller (whose
forward outputs XLA would drop as unused) is refused as well.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import mlir

_refused_p = Primitive("dropless_cpu_only")


@_refused_p.def_abstract_eval
def _refused_aval(*, shape, dtype, message):
    return jax.core.ShapedArray(shape, dtype)


@_refused_p.def_impl
def _refused_impl(*, shape, dtype, message):
    raise ValueError(message.format(platform=jax.default_backend()))


def _refused_lowering(ctx, *, shape, dtype, message):
    raise ValueError(message.format(platform="/".join(ctx.module_context.platforms)))


mlir.register_lowering(_refused_p, _refused_lowering)


def _refusal(like, message: str) -> jax.Array:
    """A value shaped like `like` whose lowering raises ValueError(message)."""
    return _refused_p.bind(shape=tuple(like.shape), dtype=jnp.dtype(like.dtype),
                           message=message)


def on_cpu_only(fn: Callable, message: str) -> Callable:
    """`fn(*arrays)` on CPU; elsewhere ValueError(message.format(platform=the platform)) when
    lowered. `message` is the whole line the user sees: name the kernel and what to use."""
    def elsewhere(*args):
        outs = jax.eval_shape(fn, *args)
        avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]

        @jax.custom_vjp
        def refused(*_):
            return jax.tree.map(lambda o: _refusal(o, message), outs)

        def bwd(_, ct):
            return tuple(_refusal(a, message) if jnp.issubdtype(a.dtype, jnp.inexact) else None
                         for a in avals)
        refused.defvjp(lambda *a: (refused(*a), None), bwd)
        return refused(*args)

    def on_cpu(*args):
        return jax.lax.platform_dependent(*args, cpu=fn, default=elsewhere)
    return on_cpu
