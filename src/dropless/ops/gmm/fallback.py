"""Compile a function whose grouped matmuls use `auto`, falling back when the chosen kernel fails.

Legend: M rows (sorted by group), K contraction dim, N output dim, G groups.

`auto` picks its backend when a function is lowered (registry.py); a kernel can still fail
after that, when XLA compiles it or when it first runs on the device (a Mosaic GPU kernel on a
GPU generation it was not tried on). `compile_auto(fn, *args)` makes that survivable, in this
order:

  1. trace and lower `fn` in an `auto_scope` that records each grouped matmul's choice;
  2. for each shape whose chosen backend (or one of its directions' backends, where the
     winner table splits them) has a next one in `auto`'s chain (tokamax on CUDA),
     compile and run that backend's forward and backward once on its own, on operands of that
     shape (`kernel_problem`, cached per process); a failure refuses the backend at that shape
     and `fn` is traced again: that shape uses the next backend;
  3. compile `fn` (and, with `run_once`, run it once on `args`); a failure while a shape uses a
     backend that has a next one refuses that backend for every shape of `fn` and `fn` is
     traced again. A failure with nothing left to fall back to raises.

Each fallback is one log line (logger "dropless.ops.gmm") and an entry of the returned
`Outcome`, which also says which backend ran at each shape. The same runs on every platform:
on CPU `auto`'s chain is `native`, then `tiled`, and `native` is probed like any backend with
a next one (a test or a dry run puts a failing stand-in first with `registry.stand_in`).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from dropless.ops.gmm import registry

log = logging.getLogger("dropless.ops.gmm")
MAX_ATTEMPTS = 8          # traces of one function: each refuses something, the chains are short


@dataclasses.dataclass(frozen=True, kw_only=True)
class Outcome:
    """What ran in one compiled function: `ran` per grouped-matmul shape (asked, backend,
    shape, and implementation or reason where tokamax decided), `fallbacks` in the order they
    happened (from, to, stage "compile" / "run", shape or None for every shape, reason)."""
    what: str
    platform: str
    ran: tuple[dict, ...]
    fallbacks: tuple[dict, ...]

    @property
    def backend(self) -> str | None:
        """The backend(s) that ran, comma-joined (None: no grouped matmul in the function)."""
        names = sorted({r["backend"] for r in self.ran})
        return ",".join(names) or None

    def record(self) -> dict:
        """The JSON-ready summary: {"gmm_backend_ran", "gmm_ran", "gmm_fallbacks"}."""
        shape = (lambda s: None if s is None else _shape_text(s))
        return {"gmm_backend_ran": self.backend,
                "gmm_ran": [dict(r, shape=shape(r["shape"])) for r in self.ran],
                "gmm_fallbacks": [dict(f, shape=shape(f["shape"])) for f in self.fallbacks]}


def _shape_text(key: tuple) -> str:
    lhs, ldt, rhs, rdt, _, out = key
    return f"lhs {list(lhs)} {ldt} x rhs {list(rhs)} {rdt} -> {out}"


def _error(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"


def _operands(key: tuple):
    """Operands of the grouped matmul `key` (a registry.shape_key) on the default device:
    normal lhs and rhs scaled by 1/sqrt(K), the rows split as evenly as the groups allow."""
    (m, k), ldt, (g, _, n), rdt, gdt, out = key
    kl, kr, kd = jax.random.split(jax.random.key(0), 3)
    lhs = jax.random.normal(kl, (m, k), jnp.float32).astype(ldt)
    rhs = (jax.random.normal(kr, (g, k, n), jnp.float32) / np.sqrt(k)).astype(rdt)
    dy = jax.random.normal(kd, (m, n), jnp.float32).astype(out)
    sizes = np.full(g, m // g, np.int64)
    sizes[: m % g] += 1
    return lhs, rhs, jnp.asarray(sizes, gdt), dy


def kernel_problem(backend: str, key: tuple) -> tuple[str, str] | None:
    """("compile" | "run", the error) when `grouped_matmul(backend=backend)` forward and
    backward (the backward where the dtypes are floating) fails to compile or to run once on
    this device at shape `key` (a registry.shape_key); None when it works. Cached per backend
    function and shape, so a process probes each kernel once."""
    return _kernel_problem(backend, registry.backend_spec(backend).fn, key)


@functools.lru_cache(maxsize=512)
def _kernel_problem(backend: str, fn: Callable, key: tuple) -> tuple[str, str] | None:
    del fn   # part of the cache key only: a stand-in under a registered name is another kernel
    out_dtype = key[5]

    def f(lhs, rhs, gs, dy):
        def gmm(a, b):
            return registry.grouped_matmul(a, b, gs, backend=backend,
                                           preferred_element_type=out_dtype)
        if not (jnp.issubdtype(lhs.dtype, jnp.floating) and jnp.issubdtype(rhs.dtype,
                                                                          jnp.floating)):
            return gmm(lhs, rhs)
        out, vjp = jax.vjp(gmm, lhs, rhs)
        return out, vjp(dy)

    try:
        args = _operands(key)
        compiled = jax.jit(f).lower(*args).compile()
    except Exception as e:  # noqa: BLE001 (any failure: the kernel does not work here)
        return "compile", _error(e)
    try:
        jax.block_until_ready(compiled(*args))
    except Exception as e:  # noqa: BLE001
        return "run", _error(e)
    return None


def _fresh(fn: Callable) -> Callable:
    """`fn` behind a new function object, so jax traces it again (its caches are keyed on the
    function), under `fn`'s name (the compiled module's name, which the persistent compilation
    cache's key includes, stays the same)."""
    def call(*args, **kwargs):
        return fn(*args, **kwargs)
    base = getattr(fn, "func", fn)
    call.__name__ = getattr(base, "__name__", "fn")
    call.__qualname__ = getattr(base, "__qualname__", call.__name__)
    return call


def compile_auto(fn: Callable, *args: Any, what: str, jit_kwargs: dict | None = None,
                 run_once: bool = False, probe: bool = True,
                 platform: str | None = None) -> tuple[Any, Outcome]:
    """(`jax.jit(fn, **jit_kwargs)` compiled for `args`, its Outcome), falling back from a
    kernel `auto` chose that fails to compile or run (see the module docstring).

    what: names the function in the log lines ("train step"). run_once: also run the compiled
    function once on `args` (only where nothing is donated: the run consumes them otherwise).
    probe: compile and run each fallible kernel alone first (step 2). platform: the lowering
    platform (default: jax's default backend).
    Raises the last failure when nothing is left to fall back to; ValueError for `run_once`
    with donated arguments.
    """
    jit_kwargs = dict(jit_kwargs or {})
    if run_once and (jit_kwargs.get("donate_argnums") is not None
                     or jit_kwargs.get("donate_argnames") is not None):
        raise ValueError(f"compile_auto({what!r}): run_once with donated arguments would "
                         "consume them; pass run_once=False")
    platform = registry.platform_name(platform or jax.default_backend())
    refused: set = set()
    fallbacks: list[dict] = []
    for _ in range(MAX_ATTEMPTS):
        events: list[dict] = []
        with registry.auto_scope(refused=frozenset(refused), events=events):
            lowered = jax.jit(_fresh(fn), **jit_kwargs).lower(*args)
            ran = registry.what_ran(events, platform)
            fallible = [(b, r["shape"]) for r in ran if r["asked"] == "auto"
                        for b in _backends(r)
                        if registry.fallback_after(b, platform, r["shape"]) is not None]
            bad = []
            for b, shape in fallible if probe else ():
                problem = kernel_problem(b, shape)
                if problem is not None:
                    bad.append((b, shape, *problem))
            if bad:
                for b, shape, stage, why in bad:
                    refused.add((b, shape))
                    fallbacks.append(_fell_back(what, platform, b, shape, stage, why))
                jax.clear_caches()
                continue
            stage = "compile"
            try:
                compiled = lowered.compile()
                stage = "run"
                if run_once:
                    jax.block_until_ready(compiled(*args))
                return compiled, Outcome(what=what, platform=platform, ran=tuple(ran),
                                         fallbacks=tuple(fallbacks))
            except Exception as e:  # noqa: BLE001 (re-raised when nothing is left)
                if not fallible:
                    raise
                for b in sorted({b for b, _ in fallible}):
                    refused.add((b, None))
                    fallbacks.append(_fell_back(what, platform, b, None, stage, _error(e)))
                jax.clear_caches()
    raise RuntimeError(f"compile_auto({what!r}): no backend left after {MAX_ATTEMPTS} traces; "
                       f"fallbacks: {fallbacks}")


def _backends(r: dict) -> list[str]:
    """The backends one grouped matmul runs: one, or one per direction (the winner table)."""
    return sorted(set(r.get("directions", {}).values()) | {r["backend"]})


def _fell_back(what: str, platform: str, backend: str, shape: tuple | None, stage: str,
               why: str) -> dict:
    """The fallback's entry, after its one log line."""
    to = registry.fallback_after(backend, platform, shape)
    where = _shape_text(shape) if shape is not None else "every shape"
    log.warning("grouped_matmul auto: %s failed to %s in the %s (%s: %s); using %s there",
                backend, stage, what, where, why, to)
    return {"from": backend, "to": to, "stage": stage, "shape": shape, "reason": why}


__all__ = ["compile_auto", "kernel_problem", "Outcome"]
