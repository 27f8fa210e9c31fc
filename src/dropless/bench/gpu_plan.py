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
an H200 (`H200_COSTS`) are what the first device run measured (2026-12-04, jax 0.11.2, tokamax
0.0.17: benchmarks/results/gpu_h200.jsonl), the slowest seen where it measured several (the
longest compile, the lowest rate); the rest (marked "assumed") are guesses, for what that run
did not reach.
"""
from __future__ import annotations

import dataclasses

# run order: measurements first, then the GPU tests, which are time-boxed and take what is left
SECTIONS = ("info", "gmm", "moe", "train", "tests")
# seconds a section's process may run (process start included); their sum is the whole check's
# bound: 330 s, leaving 30 s of the 6 minutes for run.sh (wheels, nvidia-smi) and the runner.
# Set from the 2026-12-04 run (seconds taken / cap): info 11.1 / 18, gmm 32.4 / 127 (6 units),
# moe 65.2 / 65 (cut: the layer's compile under tokamax took 30.6 s), train 48.1 / 96,
# tests 24 / 24 (60 of 124 tests reached): moe gets room for both fwd+bwd cases, gmm for the
# shapes it dropped, the tests what is left
CAPS_S = {"info": 15, "gmm": 75, "moe": 95, "train": 62, "tests": 83}
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


# the shapes measured, the targets (G8, G64) first (a section cut at its cap loses the last);
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

# Costs on one H200, from the 2026-12-04 run (benchmarks/results/gpu_h200.jsonl: record times
# `t_s` and `compile_ms`); "assumed": not reached by that run. A compile through
# fallback.compile_auto includes its kernel probes, so they are not counted apart.
H200_COSTS = {
    # a section's python, jax and dropless imports (1.7 s to its first record), the CUDA client
    # and its first operands on the device (4.8 s), and its exit (1.7 s): the gmm section's
    "process_start_s": 8.2,
    # one compile (s), the largest seen over G8, G64 and both modes (dense_xla 0.07-1.05,
    # pallas_gpu 0.50-0.83, tokamax 2.05-2.42); ragged_dot assumed
    "compile_s": {"dense_xla": 1.05, "pallas_gpu": 0.83, "tokamax": 2.42, "ragged_dot": 3.0},
    # the lowest rate seen (dense 274-675, pallas_gpu 72-253, tokamax 163-332); ragged_dot
    # (its padded product, G x the work) assumed
    "tflops": {"dense_xla": 274.0, "pallas_gpu": 72.0, "tokamax": 163.0, "ragged_dot": 150.0},
    "torch_peer_s": 0.5,            # the peer's four timings, one routing: 0.21-0.23 s at G8/G64
    "torch_start_s": 8.0,           # torch's import, CUDA context and first peer: 7.8 s
    "moe_dense_compile_s": 2.65,    # the dense SwiGLU, fwd+bwd (fwd assumed the same)
    # the MoE layer's fwd+bwd (E:K 8:2): tokamax 30.6 s (its kernel probes and 30 kernels on
    # tokamax's heuristic configs, none tuned for these shapes; 64:8 was still compiling when the
    # cap cut it 26.4 s in); pallas_gpu (tokamax absent) assumed
    "moe_layer_compile_s": {"tokamax": 30.6, "pallas_gpu": 5.0},
    "moe_fwd_compile_fraction": 0.5,    # assumed: a fwd layer compile against its fwd+bwd's
    "moe_timing_s": 0.5,            # one mode's timings of a case (layer and dense): < 0.5 s
    # deepseek3-test (float32: tokamax declines when traced, pallas_gpu runs, no probe):
    "train_compile_s": 30.5,        # the train step, as the trainer printed it
    "train_eval_s": 5.2,            # its eval step's compile (4.5 s) and run, at the last step
    "train_step_s": 0.07,           # the first step (2,048 tokens at 31,164 tok/s); median 4.6 ms
    "train_setup_s": 3.7,           # the rest of the section's 48.1 s: config, corpus, init
    "info_s": 2.9,                  # the rest of the info section's 11.1 s: torch, nvidia-smi
}

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
    return padded_bytes, s.g * flops(s, "fwd+bwd") / (H200_COSTS["tflops"]["ragged_dot"] * 1e12)


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
    """Estimated seconds of one gmm unit: both modes' compiles and timings, every routing."""
    a = H200_COSTS
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
    index into `cases`): the dense SwiGLU's compile, the layer's (tokamax's, with its kernel
    probes, where it is auto's choice) and both timings."""
    a, units = H200_COSTS, []
    layer_s = a["moe_layer_compile_s"]["tokamax" if tokamax else "pallas_gpu"]
    for case, mode in MOE_PRIORITY:
        if case >= len(cases):
            continue
        layer = layer_s * (1.0 if mode == "fwd+bwd" else a["moe_fwd_compile_fraction"])
        sec = a["moe_dense_compile_s"] + layer + a["moe_timing_s"]
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
    a = H200_COSTS
    start = a["process_start_s"]
    if section == "info":
        return start + a["info_s"]
    if section == "gmm":
        return start + (a["torch_start_s"] if torch else 0.0)
    if section == "moe":
        return start
    if section == "train":
        return (start + a["train_setup_s"] + a["train_compile_s"] + a["train_eval_s"]
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
    lines = ["# estimated time on one H200 (costs from the 2026-12-04 run, see bench/gpu_plan.py):"]
    for name, r in est.items():
        extra = (f", {len(r['kept'])} units, {len(r['dropped'])} dropped" if "kept" in r
                 else "") + (" (time-boxed)" if r.get("time_boxed") else "")
        lines.append(f"#   {name:<6} {r['seconds']:6.0f} s  (cap {r['cap_s']:g} s{extra})")
    return "\n".join(lines)
