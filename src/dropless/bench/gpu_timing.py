"""Timing on an accelerator, for `dropless bench gpu`: JAX calls and the torch peer.

Legend: M routed rows, K contraction dim, N output dim, G groups.

A GPU kernel of tens of microseconds is shorter than one Python dispatch, so a call is never
timed alone: `reps` calls are queued back to back (JAX dispatches asynchronously; the stream runs
them in order) and one wait ends the sample, giving time per call. The torch peer is timed the
same way with CUDA events. Medians of `samples` samples are reported.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import jax
import numpy as np


def time_jax(fn: Callable[[], Any], *, min_sample_s: float = 0.02, samples: int = 5,
             max_reps: int = 200) -> dict[str, float]:
    """{"median_ms", "min_ms", "compile_ms", "reps"} of a zero-argument JAX call."""
    t = time.perf_counter()
    jax.block_until_ready(fn())
    compile_ms = (time.perf_counter() - t) * 1e3
    t = time.perf_counter()
    jax.block_until_ready(fn())
    one = time.perf_counter() - t
    reps = int(max(1, min(max_reps, min_sample_s / max(one, 1e-6))))
    per_call = []
    for _ in range(samples):
        t = time.perf_counter()
        out = None
        for _ in range(reps):
            out = fn()
        jax.block_until_ready(out)
        per_call.append((time.perf_counter() - t) / reps * 1e3)
    return {"median_ms": statistics.median(per_call), "min_ms": min(per_call),
            "compile_ms": compile_ms, "reps": reps}


def torch_info() -> dict[str, Any]:
    """torch's version and whether it sees a CUDA device (never raises)."""
    try:
        import torch  # noqa: PLC0415 (optional peer, present on the device machine)
    except ImportError as e:
        return {"torch": None, "torch_cuda": False, "torch_error": str(e)}
    return {"torch": torch.__version__, "torch_cuda": bool(torch.cuda.is_available())}


def _time_torch(fn: Callable[[], Any], *, min_sample_s: float, samples: int) -> dict[str, float]:
    import torch  # noqa: PLC0415
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    reps = int(max(1, min(200, min_sample_s * 1e3 / max(start.elapsed_time(end), 1e-3))))
    per_call = []
    for _ in range(samples):
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        per_call.append(start.elapsed_time(end) / reps)
    return {"median_ms": statistics.median(per_call), "min_ms": min(per_call), "reps": reps}


def torch_peer(sizes_G: np.ndarray, m: int, k: int, n: int, *, samples: int = 5,
               min_sample_s: float = 0.02) -> dict[str, dict[str, Any]]:
    """torch._grouped_mm (bf16, fwd and fwd+bwd) and torch's cuBLAS dense mm of equal FLOPs.

    Returns {"torch_grouped_mm/fwd": stats | {"error"}, ...}; every failure is recorded, not
    raised (the peer is a guest on the machine: its API is private and version-dependent).
    """
    info = torch_info()
    if not info["torch_cuda"]:
        reason = info.get("torch_error") or "torch has no CUDA device here"
        return {f"{nm}/{mode}": {"skipped": reason} for nm in ("torch_grouped_mm", "torch_dense")
                for mode in ("fwd", "fwd+bwd")}
    import torch  # noqa: PLC0415
    dev, dt = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(m, k, device=dev, dtype=dt, generator=gen, requires_grad=True)
    # weights stored [G, N, K] and passed transposed, the layout torch's grouped kernel expects
    w = (torch.randn(len(sizes_G), n, k, device=dev, dtype=dt, generator=gen) / k ** 0.5
         ).requires_grad_(True)
    w_dense = w[0].detach().t().contiguous().requires_grad_(True)
    dy = torch.randn(m, n, device=dev, dtype=dt, generator=gen)
    offs = torch.tensor(np.cumsum(sizes_G), device=dev, dtype=torch.int32)

    def gmm():
        return torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)

    fns = {"torch_grouped_mm/fwd": lambda: gmm(),
           "torch_grouped_mm/fwd+bwd": lambda: torch.autograd.grad(gmm(), (a, w), dy),
           "torch_dense/fwd": lambda: a @ w_dense,
           "torch_dense/fwd+bwd": lambda: torch.autograd.grad(a @ w_dense, (a, w_dense), dy)}
    out: dict[str, dict[str, Any]] = {}
    for name, fn in fns.items():
        try:
            out[name] = _time_torch(fn, min_sample_s=min_sample_s, samples=samples)
        except Exception as e:  # noqa: BLE001 (recorded in the results, see docstring)
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    if "error" not in out["torch_grouped_mm/fwd"]:  # check the peer computes the same product
        with torch.no_grad():
            y = gmm().float()
            g = int(np.argmax(sizes_G))
            lo = int(np.cumsum(sizes_G)[g] - sizes_G[g])
            ref = a[lo:lo + int(sizes_G[g])].float() @ w[g].float().t()
            err = (y[lo:lo + int(sizes_G[g])] - ref).abs().max().item()
        out["torch_grouped_mm/fwd"]["max_abs_err_largest_group"] = err
    return out
