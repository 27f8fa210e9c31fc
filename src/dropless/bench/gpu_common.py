"""What the sections of `dropless bench gpu` share: the functions timed, their operands, the
compile through the fallback, the records' common fields, the deadline check and the injected
faults (bench/gpu_sections.py runs the sections; see its docstring).

Legend: M routed rows, K contraction dim, N output dim, G groups (experts).
"""
from __future__ import annotations

import math
import time

from dropless.ops.gmm.shapes import GmmShape


def error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[:300]}"


def fault(spec: dict, key: str) -> None:
    """Do the fault the spec injects at `key` (none: nothing)."""
    kind = spec.get("fault", {}).get(key)
    if kind in ("compile", "run"):     # a stand-in kernel's failure (`_stand_in`), not here
        return
    if kind == "raise":
        raise RuntimeError(f"injected fault at {key}")
    if kind == "hang":
        time.sleep(10**6)
    if kind == "exit":
        import os
        os._exit(3)


def gmm_fn(backend: str, mode: str, group_alignment: int = 1):
    """The function timed for (backend, mode), signature (x_MK, w, sizes_G, dy_MN); w is w_GKN,
    or for dense_xla one group's w_KN (one bf16 cuBLAS matmul of the same FLOPs; sizes_G
    unused). Group sizes are an argument, so one compile serves every routing. Modes: "fwd",
    "fwd+bwd" (the forward and both gradients), "dlhs" and "drhs" (one gradient alone: the vjp
    with respect to that operand only, so what the step's backward runs for it; nothing uses
    the forward's output or the other gradient, and XLA drops them). `group_alignment`: the
    rows' layout (aligned segments), passed to the grouped matmul."""
    import jax

    from dropless.ops import grouped_matmul
    if backend == "dense_xla":
        def f(a, b, s):
            return a @ b
    else:
        def f(a, b, s):
            return grouped_matmul(a, b, s, backend=backend, group_alignment=group_alignment)
    if mode == "fwd":
        return lambda a, b, s, d: f(a, b, s)
    if mode == "fwd+bwd":
        return lambda a, b, s, d: jax.vjp(lambda p, q: f(p, q, s), a, b)[1](d)
    if mode == "dlhs":
        return lambda a, b, s, d: jax.vjp(lambda p: f(p, b, s), a)[1](d)[0]
    if mode == "drhs":
        return lambda a, b, s, d: jax.vjp(lambda q: f(a, q, s), b)[1](d)[0]
    raise ValueError(f"mode={mode!r} is not one of fwd, fwd+bwd, dlhs, drhs")


def aligned_sizes(sizes_G, align: int):
    """Each group's rows rounded up to a multiple of `align` (the aligned layout's sizes,
    moe/permute.align_segments'), int32 numpy."""
    import numpy as np
    sizes_G = np.asarray(sizes_G, np.int64)
    return ((sizes_G + align - 1) // align * align).astype(np.int32)


def operands(s: GmmShape, rows: int | None = None):
    """bf16 x_MK, w_GKN (scaled by 1/sqrt(K)) and dy_MN, drawn on the device: host-side
    random numbers at the DeepSeek-V3 shape would be ~2 G draws. `rows`: M (default s.m)."""
    import jax
    import jax.numpy as jnp
    m = s.m if rows is None else rows
    kx, kw, kd = jax.random.split(jax.random.key(s.g), 3)
    x = jax.random.normal(kx, (m, s.k), jnp.bfloat16)
    w = jax.random.normal(kw, (s.g, s.k, s.n), jnp.bfloat16) * jnp.bfloat16(1 / math.sqrt(s.k))
    dy = jax.random.normal(kd, (m, s.n), jnp.bfloat16)
    return jax.block_until_ready((x, w, dy))


def compiled(fn, args, what: str, **kw) -> tuple:
    """(compiled fn, the fallback Outcome's record, compile ms) via ops/gmm/fallback.py."""
    from dropless.ops.gmm.fallback import compile_auto
    t = time.perf_counter()
    compiled, outcome = compile_auto(fn, *args, what=what, **kw)
    return compiled, outcome.record(), (time.perf_counter() - t) * 1e3


def ran(rec: dict, asked: str, gmm: dict) -> dict:
    """`rec` with the backend that ran ("ran") and, when it is not the one asked for, why."""
    who = gmm["gmm_backend_ran"] or asked
    out = dict(rec, ran=who, gmm_fallbacks=gmm["gmm_fallbacks"])
    why = [r["reason"] for r in gmm["gmm_ran"] if r.get("reason")]
    why += [f"{f['from']} failed to {f['stage']}: {f['reason']}" for f in gmm["gmm_fallbacks"]]
    why = list(dict.fromkeys(why))
    if who != asked and asked != "auto" or why:
        out["ran_because"] = "; ".join(why)[:600] or f"auto on this platform is {who}"
    return out


def late(spec: dict, est_s: float) -> str | None:
    """Why a unit estimated at est_s seconds is not started (None: it fits the deadline)."""
    left = spec["deadline_t"] - time.time()
    if left < est_s:
        return (f"{max(left, 0):.0f} s left before the section's cap, the unit is estimated at "
                f"{est_s:.0f} s")
    return None


def no_compile(stats: dict) -> dict:
    return {k: v for k, v in stats.items() if k != "compile_ms"}
