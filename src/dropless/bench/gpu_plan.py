"""What `dropless bench gpu` runs, how long each part may take, and how long it should take.

Legend: M routed rows, K contraction dim, N output dim, G groups (experts).

One table of sections with a hard time cap each (`CAPS_S`: the runner kills a section's process
group at its cap, so the whole check is bounded by their sum whatever the estimates say), the
grouped-matmul shapes with the backends measured at each, the rule that skips XLA's padded
`ragged_dot` where it is expensive, and a cost model that turns the plan into an estimated time
per section, counting everything a section does (process start, every compile, the kernel
probes of a fallible `auto` choice, the trainer's eval compile, the timings). The gmm and moe
sections are lists of units in the order of what they tell us (`GMM_PRIORITY`, `MOE_PRIORITY`):
a section keeps the longest head of its list whose estimate, times `MARGIN`, fits its cap; the
rest is recorded as skipped with the reason (least informative first). The model's figures for
an H200 (`ASSUMED_H200`) are assumptions, stated on the conservative side, not measurements:
no device has run this check yet. A device run records every compile and call time, and those
numbers should then replace them.
"""
from __future__ import annotations

import dataclasses

# run order: measurements first, then the GPU tests, which are time-boxed and take what is left
SECTIONS = ("info", "gmm", "moe", "train", "tests")
# seconds a section's process may run (process start included); their sum is the whole check's
# bound: 330 s, leaving 30 s of the 6 minutes for run.sh (wheels, nvidia-smi) and the runner
CAPS_S = {"info": 18, "gmm": 127, "moe": 65, "train": 96, "tests": 24}
MARGIN = 1.25           # a section's estimate times this must fit its cap
# the tests section is time-boxed: it runs until its cap and reports passed / failed / not
# reached; its cap is its estimate
TIME_BOXED = ("tests",)
BUDGET_S = 330          # the runner's own deadline: a section gets min(cap, what is left)
MIN_SECTION_S = 5       # a section is skipped (recorded) when less than this is left
SECTION_RESERVE_S = 2   # a section starts no unit that would end within this of its cap
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
    "moe_timing_s": 0.5,            # one mode's timings of a case (layer and dense)
    "probe_s": 5.0,                 # fallback.kernel_problem: one fallible kernel's fwd+bwd
    "train_compile_s": 45.0,        # the deepseek3-test train step (one device)
    "train_eval_compile_s": 12.0,   # its eval step, compiled at the last step
    "train_step_s": 0.1,
    "info_s": 6.0,                  # torch import and nvidia-smi
}
# grouped-matmul shapes of the gmm section's moe cases: gate/up [N, D] x [E, D, F] and down
# [N, F] x [E, F, D]: the shapes probed when tokamax is auto's choice (fallback.py)
MOE_GMM_SHAPES = 2
TRAIN_GMM_SHAPES = 2    # deepseek3-test: the same two, once (one MoE layer shape)

# the gmm section's units, most informative first: (shape label, backend); the first unit of a
# shape also times XLA's dense matmul there (dense_xla, the baseline every backend of the shape
# is divided by); "torch" is the peer's four timings
GMM_PRIORITY = (
    ("G8", "pallas_gpu"), ("G64", "pallas_gpu"), ("G8", "tokamax"), ("G8", "torch"),
    ("G64", "torch"), ("G64", "tokamax"), ("dsv3_ep", "pallas_gpu"), ("dsv3_ep", "torch"),
    ("G8", "ragged_dot"), ("G64", "ragged_dot"), ("G256", "pallas_gpu"), ("G256", "torch"),
    ("G256", "ragged_dot"), ("dsv3_ep", "ragged_dot"),
    # the dry run's shapes
    ("G2", "pallas_gpu"), ("G2", "tokamax"), ("G2", "torch"), ("G2", "ragged_dot"),
    ("G4", "pallas_gpu"), ("G4", "torch"), ("G4", "ragged_dot"),
)
# the moe section's units: (case index in MOE_CASES, mode); fwd+bwd is the target's mode
MOE_PRIORITY = ((0, "fwd+bwd"), (1, "fwd+bwd"), (0, "fwd"), (1, "fwd"))


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


def _unit_s(s: Shape, backend: str, routings, torch: bool) -> float:
    """Assumed seconds of one gmm unit: both modes' compiles and timings, every routing."""
    a = ASSUMED_H200
    if backend == "torch":
        return a["torch_peer_s"] * len(routings) if torch else 0.0
    sec = 0.0
    for mode in MODES:
        sec += a["compile_s"][backend]
        call = flops(s, mode) / (a["tflops"][backend] * 1e12)
        sec += len(routings) * _measure_s(call * (s.g if backend == "ragged_dot" else 1), TIMING)
    return sec


def gmm_units(shapes, routings, tokamax: bool, torch: bool = True) -> list[dict]:
    """The gmm section's units in GMM_PRIORITY order: {"shape", "backend", "seconds"} and, for
    a unit not measured at all (ragged_dot where it is expensive), "skipped"."""
    by = {s.label: s for s in shapes}
    units, with_dense = [], set()
    for label, b in GMM_PRIORITY:
        s = by.get(label)
        if s is None or (b != "torch" and b not in backends_at(s, tokamax)):
            continue
        why = skip_reason(s, b)
        if why:
            units.append({"shape": label, "backend": b, "seconds": 0.0, "skipped": why})
            continue
        sec = _unit_s(s, b, routings, torch)
        if b != "torch" and label not in with_dense:   # the shape's baseline comes first
            with_dense.add(label)
            sec += _unit_s(s, "dense_xla", routings, torch)
        units.append({"shape": label, "backend": b, "seconds": sec})
    return units


def moe_units(tokamax: bool, cases=MOE_CASES) -> list[dict]:
    """The moe section's units in MOE_PRIORITY order: {"case", "mode", "seconds"} (case: an
    index into `cases`); a case's first unit carries its kernel probes (tokamax as auto's
    choice only)."""
    a, probed, units = ASSUMED_H200, set(), []
    for case, mode in MOE_PRIORITY:
        if case >= len(cases):
            continue
        sec = 2 * a["moe_compile_s"] + a["moe_timing_s"]
        if tokamax and case not in probed:
            sec += MOE_GMM_SHAPES * a["probe_s"]
            probed.add(case)
        units.append({"case": case, "mode": mode, "seconds": sec})
    return units


def fit(units: list[dict], budget_s: float) -> tuple[list[dict], list[dict]]:
    """(kept, dropped): the longest head of `units` whose seconds sum to at most `budget_s`
    (units skipped for their own reason are dropped wherever they stand); each dropped unit
    gets its "skipped" reason."""
    total, kept, pre = 0.0, [], [u for u in units if u.get("skipped")]
    units = [u for u in units if not u.get("skipped")]
    for i, u in enumerate(units):
        if total + u["seconds"] > budget_s:
            dropped = [dict(d, skipped=d.get("skipped") or (
                f"dropped to fit the cap: the section's estimate up to this unit is "
                f"{total + d['seconds']:.0f} s of {budget_s:.0f} s (cap / {MARGIN})"))
                for d in units[i:]]
            return kept, dropped + pre
        total += u["seconds"]
        kept.append(u)
    return kept, pre


def _fixed_s(section: str, tokamax: bool, torch: bool, train_steps: int) -> float:
    """A section's seconds outside its units: process start, torch, the trainer's compiles."""
    a = ASSUMED_H200
    start = a["process_start_s"]
    if section == "info":
        return start + a["info_s"]
    if section == "gmm":
        return start + (a["torch_start_s"] if torch else 0.0)
    if section == "moe":
        return start
    if section == "train":
        return (start + a["train_compile_s"] + a["train_eval_compile_s"]
                + (TRAIN_GMM_SHAPES * a["probe_s"] if tokamax else 0.0)
                + train_steps * a["train_step_s"])
    return float(CAPS_S[section])


def section_plan(section: str, *, tokamax: bool, torch: bool = True,
                 train_steps: int = TRAIN_STEPS, shapes=SHAPES, routings=ROUTINGS,
                 moe_cases=MOE_CASES, cap_s: float | None = None) -> dict:
    """{"seconds", "cap_s", "kept", "dropped"} of one section on one H200: its fixed cost
    plus the head of its units that fits (cap - fixed) / MARGIN."""
    cap = CAPS_S[section] if cap_s is None else cap_s
    fixed = _fixed_s(section, tokamax, torch, train_steps)
    units = (gmm_units(shapes, routings, tokamax, torch) if section == "gmm"
             else moe_units(tokamax, moe_cases) if section == "moe" else [])
    kept, dropped = fit(units, cap / MARGIN - fixed)
    out = {"seconds": fixed + sum(u["seconds"] for u in kept), "cap_s": cap}
    if units:
        out.update(kept=kept, dropped=dropped)
    if section in TIME_BOXED:
        out["time_boxed"] = True
    return out


def estimate(*, tokamax: bool, torch: bool = True, train_steps: int = TRAIN_STEPS,
             caps: dict | None = None) -> dict:
    """{section: section_plan(...)} for the full check on one H200, and "total"."""
    caps = caps or CAPS_S
    out = {name: section_plan(name, tokamax=tokamax, torch=torch, train_steps=train_steps,
                              cap_s=caps.get(name, CAPS_S[name]))
           for name in SECTIONS}
    out["total"] = {"seconds": sum(r["seconds"] for r in out.values()),
                    "cap_s": min(BUDGET_S, sum(CAPS_S.values()))}
    return out


def format_estimate(est: dict) -> str:
    """One line per section: estimated seconds, the cap, compiles where counted."""
    lines = ["# estimated time on one H200 (assumed costs, see bench/gpu_plan.py):"]
    for name, r in est.items():
        extra = (f", {len(r['kept'])} units, {len(r['dropped'])} dropped" if "kept" in r
                 else "") + (" (time-boxed)" if r.get("time_boxed") else "")
        lines.append(f"#   {name:<6} {r['seconds']:6.0f} s  (cap {r['cap_s']:g} s{extra})")
    return "\n".join(lines)
