"""Every equation of a traced function, nested bodies included (scan, checkpoint, custom_vjp,
jit, cond), for tests that count what a function computes."""
from __future__ import annotations

from collections.abc import Iterator

import jax
import jax.extend


def equations(jaxpr) -> Iterator:
    """The equations of `jaxpr` (a Jaxpr or ClosedJaxpr) and of every jaxpr in their params."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from equations(sub)


def traced(fn, *args) -> list:
    """The equations of `fn` traced at `args` (jax.make_jaxpr), nested ones included."""
    return list(equations(jax.make_jaxpr(fn)(*args)))
