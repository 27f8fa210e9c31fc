"""What `dropless bench gpu` runs, how long each part may take, and how long it should take.

Legend: M routed rows, K contraction dim, N output dim, G groups (experts).

One table of sections with a hard time cap each (`CAPS_S`: the runner kills a section's process
at its cap, so the whole check is bounded by their sum whatever the estimates say), the
grouped-matmul shapes with the backends measured at each, the rule that skips XLA's padded
`ragged_dot` where it is expensive, and a cost model that turns the plan into an estimated time
per section. The model's figures for an H200 (`ASSUMED_H200`) are assumptions, not
measurements: no device has run this check yet. A device run records every compile time and
call time, and those numbers should then replace them.
"""
from __future__ import annotations

import dataclasses

# run order: measurements first, then the GPU tests, which are time-boxed and take what is left
SECTIONS = ("info", "gmm", "moe", "train", "tests")
# seconds a section's process may run (process start included); their sum is the whole check's
# bound: 330 s, leaving 30 s of the 6 minutes for run.sh (wheels, nvidia-smi) and the runner
CAPS_S = {"info": 20, "gmm": 155, "moe": 55, "train": 60, "tests": 40}
BUDGET_S = 330          # the runner's own deadline: a section gets min(cap, what is left)
MIN_SECTION_S = 5       # a section is skipped (recorded) when less than this is left
# the dry run's caps and budget: a busy 2-core CI machine compiles far slower than the H200's
# host; the dry run checks the runner, not the time
DRY_CAP_SCALE = 5
MODES = ("fwd", "fwd+bwd")


@dataclasses.dataclass(frozen=True)
class Shape:
    """One grouped-matmul problem and the backends measured on it (dense_xla always)."""
    label: str
    m: int
    k: int
    n: int
    g: int
    backends: tuple[str, ...]


# the shapes, the targets (G8, G64) first (a section cut at its cap loses the last);
# tokamax (where installed) at the targets only, to stay within the cap
SHAPES = (
    Shape("G8", 8192, 1024, 1024, 8, ("pallas_gpu", "tokamax", "ragged_dot")),
    Shape("G64", 8192, 1024, 1024, 64, ("pallas_gpu", "tokamax", "ragged_dot")),
    Shape("dsv3_ep", 24576, 7168, 2048, 32, ("pallas_gpu", "ragged_dot")),
    Shape("G256", 8192, 1024, 1024, 256, ("pallas_gpu", "ragged_dot")),
)
DRY_SHAPES = (
    Shape("G2", 64, 32, 32, 2, ("pallas_gpu", "tokamax", "ragged_dot")),
    Shape("G4", 64, 32, 32, 4, ("pallas_gpu", "ragged_dot")),
)
ROUTINGS = ("uniform", "zipf")
# `bench moe` cases (E, K, routing): the layer against a dense SwiGLU over the same rows
MOE_CASES = ((8, 2, "uniform"), (64, 8, "zipf"))
MOE_SHAPE = {"rows": 16384, "d_model": 2048, "d_ff": 1024, "repeats": 10}
DRY_MOE_CASES = ((4, 2, "uniform"),)
DRY_MOE_SHAPE = {"rows": 64, "d_model": 32, "d_ff": 32, "repeats": 1}
TRAIN_STEPS = 8
TIMING = {"samples": 5, "min_sample_s": 0.02}
DRY_TIMING = {"samples": 1, "min_sample_s": 0.0}

# XLA runs ragged_dot on CUDA as a zero-padded dense product: G times the work, [G, M, max(K, N)]
# operands. Measured only while that stays cheap.
RAGGED_DOT_MAX_BYTES = 8 * 2**30
RAGGED_DOT_MAX_S = 3.0

# Assumed costs on one H200 (see the module docstring: not measured).
ASSUMED_H200 = {
    "process_start_s": 8.0,         # python, jax, CUDA and dropless start in a section's process
    "compile_s": {"dense_xla": 2.0, "pallas_gpu": 6.0, "tokamax": 10.0, "ragged_dot": 3.0},
    "tflops": {"dense_xla": 600.0, "pallas_gpu": 300.0, "tokamax": 400.0, "ragged_dot": 150.0},
    "torch_peer_s": 2.0,            # torch._grouped_mm + torch.mm, fwd and fwd+bwd, one routing
    "torch_start_s": 5.0,           # torch's import and CUDA context, once
    "moe_compile_s": 5.0,           # one jitted MoE layer or dense SwiGLU, fwd or fwd+bwd
    "moe_timing_s": 1.0,            # one case's interleaved timings, both modes
    "train_compile_s": 45.0,        # the deepseek3-test train step and its eval
    "train_step_s": 0.1,
    "info_s": 6.0,                  # torch import and nvidia-smi
}


def flops(s: Shape, mode: str) -> int:
    """Useful FLOPs of one call: 2MKN forward, three such products forward+backward."""
    return 2 * s.m * s.k * s.n * (1 if mode == "fwd" else 3)


def ragged_dot_cost(s: Shape) -> tuple[int, float]:
    """(bytes of the padded operands, assumed seconds of one fwd+bwd call) of CUDA ragged_dot."""
    padded_bytes = 2 * s.g * s.m * max(s.k, s.n) * 3
    return padded_bytes, s.g * flops(s, "fwd+bwd") / (ASSUMED_H200["tflops"]["ragged_dot"] * 1e12)


def _measure_s(call_s: float, timing: dict) -> float:
    """time_jax's cost for a call of call_s seconds: two warm-up calls, then `samples` samples
    of max(1, min_sample_s / call_s) calls."""
    per_sample = max(call_s, timing["min_sample_s"])
    return 2 * call_s + timing["samples"] * per_sample


def skip_reason(s: Shape, backend: str, timing: dict = TIMING) -> str | None:
    """Why `backend` is not measured at `s` (None: it is)."""
    if backend != "ragged_dot":
        return None
    padded_bytes, call_s = ragged_dot_cost(s)
    if padded_bytes > RAGGED_DOT_MAX_BYTES:
        return (f"padded ragged_dot: [G, M, max(K, N)] operands of {padded_bytes / 2**30:.1f} "
                f"GiB exceed {RAGGED_DOT_MAX_BYTES >> 30} GiB")
    if _measure_s(call_s, timing) > RAGGED_DOT_MAX_S:
        return (f"padded ragged_dot: about {_measure_s(call_s, timing):.1f} s to time (G x the "
                f"work), over {RAGGED_DOT_MAX_S} s")
    return None


def backends_at(s: Shape, tokamax: bool) -> list[str]:
    """The backends measured at `s`, dense_xla (the baseline) first."""
    return ["dense_xla"] + [b for b in s.backends if b != "tokamax" or tokamax]


def gmm_estimate(shapes, routings, tokamax: bool, torch: bool = True) -> dict:
    """{"compiles", "measurements", "seconds"} of the gmm section on an H200 (ASSUMED_H200)."""
    a = ASSUMED_H200
    compiles = measurements = 0
    sec = a["process_start_s"] + (a["torch_start_s"] if torch else 0.0)
    for s in shapes:
        for b in backends_at(s, tokamax):
            if skip_reason(s, b):
                continue
            for mode in MODES:
                compiles += 1
                sec += a["compile_s"][b]
                for _ in routings:
                    measurements += 1
                    call = flops(s, mode) / (a["tflops"][b] * 1e12)
                    sec += _measure_s(call * (s.g if b == "ragged_dot" else 1), TIMING)
        if torch:
            sec += a["torch_peer_s"] * len(routings)
    return {"compiles": compiles, "measurements": measurements, "seconds": sec}


def estimate(*, tokamax: bool, torch: bool = True, train_steps: int = TRAIN_STEPS) -> dict:
    """{section: {"seconds", "cap_s", ...}} for the full check on one H200, and "total"."""
    a = ASSUMED_H200
    moe_compiles = len(MOE_CASES) * 2 * 2        # (dense, layer) x (fwd, fwd+bwd) per case
    out = {
        "info": {"seconds": a["process_start_s"] + a["info_s"]},
        "gmm": gmm_estimate(SHAPES, ROUTINGS, tokamax, torch),
        "moe": {"compiles": moe_compiles, "seconds": a["process_start_s"] + moe_compiles
                * a["moe_compile_s"] + len(MOE_CASES) * a["moe_timing_s"]},
        "train": {"compiles": 2, "seconds": a["process_start_s"] + a["train_compile_s"]
                  + train_steps * a["train_step_s"]},
        # time-boxed: runs the GPU tests that fit in what the cap (or the budget) leaves
        "tests": {"seconds": float(CAPS_S["tests"]), "time_boxed": True},
    }
    for name, rec in out.items():
        rec["cap_s"] = CAPS_S[name]
    out["total"] = {"seconds": sum(r["seconds"] for r in out.values()),
                    "cap_s": min(BUDGET_S, sum(CAPS_S.values()))}
    return out


def format_estimate(est: dict) -> str:
    """One line per section: estimated seconds, the cap, compiles where counted."""
    lines = ["# estimated time on one H200 (assumed costs, see bench/gpu_plan.py):"]
    for name, r in est.items():
        extra = (f", {r['compiles']} compiles" if "compiles" in r else "") + (
            " (time-boxed)" if r.get("time_boxed") else "")
        lines.append(f"#   {name:<6} {r['seconds']:6.0f} s  (cap {r['cap_s']} s{extra})")
    return "\n".join(lines)
