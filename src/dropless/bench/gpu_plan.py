"""What `dropless bench gpu` runs, how long each part may take, and how long it should take.

Legend: M routed rows, K contraction dim, N output dim, G groups (experts), D d_model,
F an expert's hidden size, E experts, T tokens.

One table of sections with a hard time cap each (`CAPS_S`: the runner kills a section's process
group at its cap, so the whole check is bounded by their sum whatever the estimates say), the
grouped-matmul shapes (ops/gmm/shapes.py's table) and backends measured, the rule that skips
XLA's padded `ragged_dot` where it is expensive, and a cost model that turns the plan into an
estimated time per section, counting everything a section does (process start, every compile,
the kernel probes of a fallible `auto` choice, the trainer's compiles, the timings). The gmm,
moe and autotune sections are lists of units in the order of what they tell us
(`gmm_units`: `GMM_SHAPE_PRIORITY` x `BACKEND_PRIORITY` x `PARTS`, in tiers; `MOE_PRIORITY`;
`AUTOTUNE_SHAPES`): a
section keeps the longest head of its list whose estimate, times `MARGIN`, fits its cap; the
rest is recorded as skipped with the reason (least informative first). The backends measured
are the registry's that are usable in the section's process (`measured_backends`), in
`BACKEND_PRIORITY` order, any other after them. The model's figures for an H200 (`H200_COSTS`)
are what the first device run measured (2026-12-04, jax 0.11.2, tokamax 0.0.17:
benchmarks/results/gpu_h200.jsonl), the slowest seen where it measured several (the longest
compile, the lowest rate); the rest (marked "assumed") are guesses, for what that run did not
reach.
"""
from __future__ import annotations

import dataclasses

from dropless.ops.gmm import shapes as gmm_shapes
from dropless.ops.gmm.shapes import GmmShape

# run order: measurements first, then the GPU tests, which are time-boxed and take what is left
SECTIONS = ("info", "gmm", "moe", "autotune", "train", "maxtext", "tests")
# seconds a section's process may run (process start included); their sum is the whole check's
# bound: 550 s, leaving 25 s of run.sh's 575 s (HARD_S: under the device tool's 600 s a command)
# for run.sh (wheels, nvidia-smi) and the runner. 550 s, not 450: the maxtext section (100 s:
# MaxText training the train section's model beside it) came on top of the 8 minutes
# the rest had; a device session's 15 minutes then hold the machine's start and the check, and
# a rerun only of a few sections (--sections).
# Eight minutes for the rest, not six: the shapes users train (DeepSeek-V3 and Qwen3 per device:
# 30-200x the FLOPs of the first run's shapes), the MoE layer at two of them under tokamax's
# 30.6 s compile each plus its profile, and the tokamax autotune are each new. The 2026-12-04
# run (seconds taken / cap): info 11.1 / 18, gmm 32.4 / 127 (6 units), moe 65.2 / 65 (cut: the
# layer's compile under tokamax took 30.6 s), train 48.1 / 96, tests 24 / 24 (60 of 124 tests
# reached).
# train trains deepseek3-1gpu (bench/gpu_train.py): one compile of a 1.7B-parameter step (the
# trainer's, whose memory analysis is the pre-flight's) in 99 s, with room for a compile twice
# the estimate's; the time-boxed tests have the rest (36 s).
# maxtext (bench/gpu_maxtext.py): MaxText's wheels unpacked, its imports, one compile of the
# same model unscanned and MAXTEXT_STEPS steps, every figure assumed (never run on a GPU yet):
# its estimate times MARGIN.
# gmm's 144 s time the backward's directions alone (the winner table's dlhs and drhs rows) at
# Qwen3's gate_up beside both modes at Qwen3's and DeepSeek-V3's gate_up, every kernel planned,
# tokamax and cuDNN's included; the 29 s come from moe and autotune (each 25% over its estimate
# with tokamax, as every cap) and the time-boxed tests
CAPS_S = {"info": 15, "gmm": 144, "moe": 110, "autotune": 46, "train": 99, "maxtext": 100,
          "tests": 36}
MARGIN = 1.25           # a section's estimate times this must fit its cap
# the tests section is time-boxed: it runs until its cap and reports passed / failed / not
# reached; its cap is its estimate
TIME_BOXED = ("tests",)
BUDGET_S = 550          # the runner's own deadline: a section gets min(cap, what is left)
MIN_SECTION_S = 5       # a section is skipped (recorded) when less than this is left
SECTION_RESERVE_S = 2   # a section starts no unit that would end within this of its cap
# the dry run's caps and budget: a busy 2-core CI machine compiles far slower than the H200's
# host; the dry run checks the runner, not the time
DRY_CAP_SCALE = 5
MODES = ("fwd", "fwd+bwd")
# the backward's two products timed alone (`shapes.DIRECTIONS`' dlhs and drhs), for the winner
# table `auto` reads (ops/gmm/winners.from_records), which wants a time per direction
DIRECTION_MODES = ("dlhs", "drhs")
# what a gmm unit times at its shape ("part"): both modes on the table's layout, the backward's
# directions alone, or both modes on aligned segments (`ALIGN_ROWS`)
PARTS = {"modes": MODES, "dirs": DIRECTION_MODES, "aligned": MODES}
# aligned expert segments: each group's rows rounded up to a multiple of this (the layout of
# MoEConfig.align_expert_rows, moe/permute.aligned_rows), measured for the backends registered
# to use it; their useful FLOPs are those of the unaligned rows, so ratios compare like with like
ALIGN_ROWS = 128
ALIGNED_BACKENDS = ("pallas_gpu",)


# the shapes measured: the shapes table (ops/gmm/shapes.py); the dry run's are tiny
SHAPES: tuple[GmmShape, ...] = gmm_shapes.SHAPES
DRY_SHAPES = (GmmShape("dry/G2", "dry", 64, 32, 32, 2), GmmShape("dry/G4", "dry", 64, 32, 32, 4))
ROUTINGS = gmm_shapes.ROUTINGS
# the gmm section's order: the per-device shapes of the models users train, fwd+bwd and fwd
# each (the targets: DeepSeek-V3 and Qwen3), then the first run's small shapes (continuity),
# then Mixtral; a shape not named here (the dry run's) comes after, in its table's order. The
# parts (`PARTS`) in tiers (`gmm_units`): at the targets (`GMM_TARGETS` first shapes) both
# modes and then the directions alone (a winner-table row per direction), then aligned
# segments there, then the same tiers at the other shapes
GMM_TARGETS = 4
GMM_SHAPE_PRIORITY = ("qwen3_30b_a3b/gate_up", "deepseek_v3_ep8/gate_up", "qwen3_30b_a3b/down",
                      "deepseek_v3_ep8/down", "small/G64", "small/G8", "mixtral_8x7b/gate_up",
                      "mixtral_8x7b/down", "small/G256")
# the backends at each shape, most informative first ("torch": the peer, torch._grouped_mm and
# torch's dense mm timed in the same process; cudnn_ragged_dot runs only where the device's
# cuDNN has XLA's grouped GEMM); a usable backend not named comes after them
BACKEND_PRIORITY = ("mosaic_gpu", "tokamax", "cudnn_ragged_dot", "pallas_gpu", "torch",
                    "ragged_dot")
# registered backends never measured here: CPU kernels, the reference and naive baselines
NOT_MEASURED = ("reference", "tiled", "native", "padded", "loop")
# the dry run measures these (pallas_gpu in interpret mode; tokamax only as a stand-in)
DRY_BACKENDS = ("tokamax", "pallas_gpu", "ragged_dot")
# the MoE layer at the per-device shapes of the two target models (`moe_case`): E experts a
# device, top-k, D, F and T = M / top-k tokens from the shapes table, against a dense SwiGLU
# over the same rows. DeepSeek-V3 runs a third of its 24,576 tokens a device (65,536 routed
# rows, ~2k an expert): its full fwd+bwd call (~52 TFLOP) would take ~5 s a timing at the
# lowest rate seen, which the section's cap cannot hold beside tokamax's compiles.
MOE_MODELS = (("qwen3_30b_a3b", 8, 1), ("deepseek_v3_ep8", 8, 3))  # (model, top-k, T divisor)
DRY_MOE_CASES = ({"model": "dry", "experts": 4, "top_k": 2, "d_model": 32, "d_ff": 32,
                  "tokens": 32, "routing": "uniform"},)
# the traced calls of the profile unit (a per-kernel table of one layer fwd+bwd, per call)
PROFILE_CALLS = 3
TRAIN_STEPS = 20
# MaxText's steps (bench/gpu_maxtext.py): its summary drops the first 3, the rest are timed
MAXTEXT_STEPS = 10
TIMING = {"samples": 3, "min_sample_s": 0.02}
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
    # pallas_gpu 0.50-0.83, tokamax 2.05-2.42); assumed the same at the larger shapes (a kernel's
    # compile does not grow with M); ragged_dot, mosaic_gpu and a backend not named assumed
    "compile_s": {"dense_xla": 1.05, "pallas_gpu": 0.83, "tokamax": 2.42, "ragged_dot": 3.0,
                  "mosaic_gpu": 3.0, "other": 3.0},
    # the lowest rate seen (dense 274-675, pallas_gpu 72-253, tokamax 163-332), assumed to hold
    # at the larger shapes; ragged_dot (its padded product, G x the work), mosaic_gpu,
    # cudnn_ragged_dot (never run yet: "other") and a backend not named assumed at pallas_gpu's
    # or below; torch (both its grouped and its dense product) assumed at dense's lowest
    "tflops": {"dense_xla": 274.0, "pallas_gpu": 72.0, "tokamax": 163.0, "ragged_dot": 150.0,
               "mosaic_gpu": 72.0, "other": 72.0, "torch": 274.0},
    "operands_s": 0.5,              # assumed: a shape's bf16 operands drawn on the device
    "torch_peer_s": 0.5,            # the peer's four timings, one routing: 0.21-0.23 s at G8/G64
    "torch_start_s": 8.0,           # torch's import, CUDA context and first peer: 7.8 s
    "moe_dense_compile_s": 2.65,    # the dense SwiGLU, fwd+bwd (fwd assumed the same)
    # the MoE layer's fwd+bwd (E:K 8:2): tokamax 30.6 s (its kernel probes and 30 kernels on
    # tokamax's heuristic configs, none tuned for these shapes; 64:8 was still compiling when the
    # cap cut it 26.4 s in), assumed at the new shapes too; pallas_gpu (tokamax absent) assumed
    "moe_layer_compile_s": {"tokamax": 30.6, "pallas_gpu": 5.0},
    "moe_fwd_compile_fraction": 0.5,    # assumed: a fwd layer compile against its fwd+bwd's
    # assumed: the layer's useful rate (its expert matmuls' FLOPs over the whole layer's time),
    # below the lowest grouped-matmul rate seen, for the dispatch around it
    "moe_layer_tflops": 50.0,
    "moe_timing_s": 0.5,            # a case's timings beside its calls: < 0.5 s at E:K 8:2
    # assumed: jax.profiler's start and stop, and the trace's reading, for a few calls
    "profile_s": 8.0,
    # assumed: the autotune section's tokamax import and jax start (beyond process_start_s)
    "autotune_start_s": 5.0,
    # assumed: one config's compile (tokamax compiles configs in threads: 16 cores) and timing
    "autotune_config_s": 1.5,
    # the train section, measured on deepseek3-test (float32: tokamax declined, pallas_gpu ran):
    # step compile 30.5 s, eval 5.2 s (compile 4.5 s), setup 3.7 s; deepseek3-1gpu (16 layers
    # unrolled, bf16) is assumed to compile 1.65x as long (its compile for a compile-only H100
    # against the scanned layout's: 51 s against 31 on a 2-core CPU; once: the pre-flight reads
    # the step's own compile, train/loop.py), its eval compile longer, its step at 41 TFLOP
    # (16,384 tokens) and 29% MFU (the planner's), its setup 10 s (1.7B float32 weights and Adam
    # moments initialised on the device)
    "train_compile_s": 50.0,
    "train_eval_s": 8.0,            # assumed
    "train_step_s": 0.15,           # assumed
    "train_setup_s": 10.0,          # assumed
    "info_s": 2.9,                  # the rest of the info section's 11.1 s: torch, nvidia-smi
    # the maxtext section (MaxText e591f30 on jax 0.11.2, never run on a GPU yet): all assumed.
    # maxtext.sh's pip install of .whl and .maxtext/whl (~20 wheels, no network, no compile)
    # and unpacking the source
    "maxtext_install_s": 4.0,       # assumed
    # MaxText's imports (transformers, flax, orbax, tokamax), its config and the CUDA client
    "maxtext_start_s": 10.0,        # assumed
    # one compile of the train step, 16 layers unscanned with tokamax's kernels: the train
    # section's compile estimate for the same model, plus its model init on the device
    "maxtext_compile_s": 50.0,      # assumed
    # a step: ~41 TFLOP at a lower rate than dropless's assumed 0.15 s (MaxText's MLA and
    # routing around tokamax's grouped matmul)
    "maxtext_step_s": 0.5,          # assumed
}

# the moe section's units: (case index, mode, aligned), then the profile of the first case;
# fwd+bwd is the target's mode. "aligned" units run only where MoEConfig has an aligned-segments
# option (`align_option`).
MOE_PRIORITY = ((0, "fwd+bwd", False), (0, "profile", False), (1, "fwd+bwd", False),
                (0, "fwd+bwd", True), (1, "fwd+bwd", True), (0, "fwd", False),
                (1, "fwd", False))
# the autotune section: tokamax at these shapes (fwd+bwd: every tokamax op the products lower
# to), a handful of configs each (`AUTOTUNE_CONFIGS`, tokamax's heuristic one among them)
AUTOTUNE_SHAPES = ("qwen3_30b_a3b/gate_up", "deepseek_v3_ep8/gate_up", "qwen3_30b_a3b/down",
                   "deepseek_v3_ep8/down", "small/G64")
DRY_AUTOTUNE_SHAPES = ("dry/G2",)
AUTOTUNE_CONFIGS = 5
AUTOTUNE_OPS = 3        # assumed: the tokamax ops of one fwd+bwd product (fwd, dlhs, drhs)


def flops(s: GmmShape, mode: str) -> int:
    """Useful FLOPs of one call: 2MKN forward, dlhs or drhs alone, three such products
    forward+backward."""
    if mode not in MODES + DIRECTION_MODES:
        raise ValueError(f"mode={mode!r} is not one of {MODES + DIRECTION_MODES}")
    return s.flops() * (3 if mode == "fwd+bwd" else 1)


def aligned_m(s: GmmShape, align: int = ALIGN_ROWS) -> int:
    """Rows of the aligned layout of `s` (moe/permute.aligned_rows: room for every group
    rounded up to a multiple of `align`)."""
    from dropless.moe.permute import aligned_rows
    return aligned_rows(s.m, s.g, align)


def ragged_dot_cost(s: GmmShape) -> tuple[int, float]:
    """(bytes of the padded operands, assumed seconds of one fwd+bwd call) of CUDA ragged_dot."""
    padded_bytes = 2 * s.g * s.m * max(s.k, s.n) * 3
    return padded_bytes, s.g * flops(s, "fwd+bwd") / (H200_COSTS["tflops"]["ragged_dot"] * 1e12)


def _measure_s(call_s: float, timing: dict) -> float:
    """time_jax's cost for a call of call_s seconds: two warm-up calls, then `samples` samples
    of max(1, min_sample_s / call_s) calls."""
    per_sample = max(call_s, timing["min_sample_s"])
    return 2 * call_s + timing["samples"] * per_sample


def skip_reason(s: GmmShape, backend: str, timing: dict = TIMING) -> str | None:
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


def measured_backends(usable) -> list[str]:
    """The grouped-matmul backends measured, of those `usable` (registered and able to run in
    the section's process): BACKEND_PRIORITY's first, then any other, NOT_MEASURED left out."""
    usable = [b for b in usable if b not in NOT_MEASURED and b != "auto"]
    return ([b for b in BACKEND_PRIORITY if b in usable]
            + [b for b in usable if b not in BACKEND_PRIORITY])


def _rate(table: dict, backend: str) -> float:
    return table.get(backend, table["other"])


def _unit_s(s: GmmShape, backend: str, routings, torch: bool, part: str = "modes") -> float:
    """Estimated seconds of one gmm unit: its part's modes' compiles and timings, every
    routing (an aligned unit computes its aligned rows)."""
    a = H200_COSTS
    if backend == "torch":
        if not torch:
            return 0.0
        call = sum(flops(s, m) for m in MODES) / (a["tflops"]["torch"] * 1e12)
        return len(routings) * (a["torch_peer_s"] + 2 * _measure_s(call, TIMING))
    rows = aligned_m(s) / s.m if part == "aligned" else 1.0
    sec = 0.0
    for mode in PARTS[part]:
        sec += _rate(a["compile_s"], backend)
        call = rows * flops(s, mode) / (_rate(a["tflops"], backend) * 1e12)
        sec += len(routings) * _measure_s(call * (s.g if backend == "ragged_dot" else 1), TIMING)
    return sec


def shape_order(shapes) -> list[GmmShape]:
    rank = {label: i for i, label in enumerate(GMM_SHAPE_PRIORITY)}
    return sorted(shapes, key=lambda s: rank.get(s.label, len(rank)))   # stable: table order


def _shape_units(s: GmmShape, part: str, order: list[str], routings, torch: bool) -> list:
    """One shape's units of one part (`gmm_units`)."""
    units, first = [], True
    for b in order:
        if (b == "torch" and part != "modes") or (part == "aligned"
                                                  and b not in ALIGNED_BACKENDS):
            continue
        why = skip_reason(s, b)
        if why:
            units.append({"shape": s.label, "backend": b, "part": part, "seconds": 0.0,
                          "skipped": why})
            continue
        sec = _unit_s(s, b, routings, torch, part)
        if first and b != "torch":
            first = False
            # the part's baseline (dense_xla in its modes; aligned: the modes' dense) and its
            # operands come with its first kernel
            sec += H200_COSTS["operands_s"] + (
                _unit_s(s, "dense_xla", routings, torch, part) if part != "aligned" else 0.0)
        units.append({"shape": s.label, "backend": b, "part": part, "seconds": sec})
    return units


def gmm_units(shapes, routings, backends, torch: bool = True) -> list[dict]:
    """The gmm section's units: {"shape", "backend", "part" (of PARTS), "seconds"} and, for a
    unit not measured at all (ragged_dot where it is expensive), "skipped". In tiers: at the
    targets (the first GMM_TARGETS of GMM_SHAPE_PRIORITY), shape by shape, "modes" (fwd and
    fwd+bwd: the `backends` in `measured_backends`' order, the torch peer where
    BACKEND_PRIORITY puts it) then "dirs" (dlhs and drhs alone, the same backends); then
    "aligned" (ALIGNED_BACKENDS on aligned segments) at the targets; then the same two tiers at
    the other shapes. The first unit of a shape's part also times XLA's dense matmul there in
    the part's modes (dense_xla, the baseline every backend is divided by; aligned units are
    divided by the modes' dense of the same useful FLOPs) and draws its operands."""
    order = measured_backends(list(backends) + ["torch"])
    ranked = shape_order(shapes)
    targets = [s for s in ranked if s.label in GMM_SHAPE_PRIORITY[:GMM_TARGETS]]
    rest = [s for s in ranked if s not in targets]
    units = []
    for tier in (targets, rest):
        for s in tier:
            for part in ("modes", "dirs"):
                units += _shape_units(s, part, order, routings, torch)
        for s in tier:
            units += _shape_units(s, "aligned", order, routings, torch)
    return units


def moe_case(model: str) -> dict:
    """The MoE layer case of `model` (one of MOE_MODELS'): E experts a device, top-k, D, F and
    tokens from the shapes table's gate_up product (M = T x top-k; D = K, F = N / 2)."""
    _, top_k, divisor = next(m for m in MOE_MODELS if m[0] == model)
    s = gmm_shapes.shape(f"{model}/gate_up")
    return {"model": model, "experts": s.g, "top_k": top_k, "d_model": s.k, "d_ff": s.n // 2,
            "tokens": s.m // top_k // divisor, "routing": "uniform"}


MOE_CASES = tuple(moe_case(m) for m, _, _ in MOE_MODELS)


def align_option() -> tuple[str, object] | None:
    """(field, value) of MoEConfig's aligned-segments option, the value that turns it on (True,
    or 128 rows for an int field); None when MoEConfig has no such field."""
    from dropless.config import MoEConfig
    for f in dataclasses.fields(MoEConfig):
        if "align" in f.name:
            return (f.name, True) if isinstance(f.default, bool) or f.type in ("bool", bool) \
                else (f.name, 128)
    return None


def _moe_call_s(case: dict, mode: str, tflops: float) -> float:
    rows = case["tokens"] * case["top_k"]
    fwd = 6 * rows * case["d_model"] * case["d_ff"]   # gate and up (D -> 2F), down (F -> D)
    return fwd * (1 if mode == "fwd" else 3) / (tflops * 1e12)


def moe_units(tokamax: bool, cases=MOE_CASES, aligned: bool = False) -> list[dict]:
    """The moe section's units in MOE_PRIORITY order: {"case", "mode", "aligned", "seconds"}
    (case: an index into `cases`): the dense SwiGLU's compile, the layer's (tokamax's, with its
    kernel probes, where it is auto's choice) and both timings; "profile" units trace calls of
    the case's fwd+bwd layer already compiled. Aligned units only where `aligned`."""
    a, units = H200_COSTS, []
    layer_s = a["moe_layer_compile_s"]["tokamax" if tokamax else "pallas_gpu"]
    for case, mode, al in MOE_PRIORITY:
        if case >= len(cases) or (al and not aligned):
            continue
        c = cases[case]
        if mode == "profile":
            sec = a["profile_s"] + PROFILE_CALLS * _moe_call_s(c, "fwd+bwd",
                                                               a["moe_layer_tflops"])
        else:
            layer = layer_s * (1.0 if mode == "fwd+bwd" else a["moe_fwd_compile_fraction"])
            sec = (a["moe_dense_compile_s"] + layer + a["moe_timing_s"]
                   + _measure_s(_moe_call_s(c, mode, a["moe_layer_tflops"]), TIMING)
                   + _measure_s(_moe_call_s(c, mode, a["tflops"]["dense_xla"]), TIMING))
        units.append({"case": case, "mode": mode, "aligned": al, "seconds": sec})
    return units


def autotune_units(shapes=AUTOTUNE_SHAPES) -> list[dict]:
    """The autotune section's units: {"shape", "seconds"}: AUTOTUNE_CONFIGS configs of each of
    the product's tokamax ops, compiled and timed, and its operands."""
    a = H200_COSTS
    return [{"shape": label, "seconds": a["operands_s"] + AUTOTUNE_OPS * AUTOTUNE_CONFIGS
             * a["autotune_config_s"]} for label in shapes]


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
    if section == "autotune":
        return start + (a["autotune_start_s"] if tokamax else 0.0)
    if section == "train":
        return (start + a["train_setup_s"] + a["train_compile_s"]
                + a["train_eval_s"] + train_steps * a["train_step_s"])
    if section == "maxtext":
        return (start + a["maxtext_install_s"] + a["maxtext_start_s"] + a["maxtext_compile_s"]
                + MAXTEXT_STEPS * a["maxtext_step_s"])
    return float(CAPS_S[section])


def default_backends(tokamax: bool) -> tuple[str, ...]:
    """The backends a device run is planned with before its section process says what is
    usable there: BACKEND_PRIORITY's kernels (tokamax where installed)."""
    return tuple(b for b in BACKEND_PRIORITY if b != "torch" and (b != "tokamax" or tokamax))


def section_plan(section: str, *, tokamax: bool, torch: bool = True,
                 backends: tuple[str, ...] | None = None, aligned: bool = False,
                 train_steps: int = TRAIN_STEPS, shapes=SHAPES, routings=ROUTINGS,
                 moe_cases=MOE_CASES, autotune_shapes=AUTOTUNE_SHAPES,
                 cap_s: float | None = None) -> dict:
    """{"seconds", "cap_s", "kept", "dropped"} of one section on one H200: its fixed cost
    plus the head of its units that fits (cap - fixed) / MARGIN. `backends`: those measured by
    the gmm section (None: `default_backends`); `aligned`: MoEConfig has the aligned option."""
    cap = CAPS_S[section] if cap_s is None else cap_s
    fixed = _fixed_s(section, tokamax, torch, train_steps)
    backends = default_backends(tokamax) if backends is None else backends
    units = (gmm_units(shapes, routings, backends, torch) if section == "gmm"
             else moe_units(tokamax, moe_cases, aligned) if section == "moe"
             else autotune_units(autotune_shapes) if section == "autotune" and tokamax
             else [])
    kept, dropped = fit(units, cap / MARGIN - fixed)
    out = {"seconds": fixed + sum(u["seconds"] for u in kept), "cap_s": cap}
    if units:
        out.update(kept=kept, dropped=dropped)
    if section in TIME_BOXED:
        out["time_boxed"] = True
    return out


def estimate(*, tokamax: bool, torch: bool = True, backends: tuple[str, ...] | None = None,
             aligned: bool = False, train_steps: int = TRAIN_STEPS,
             caps: dict | None = None) -> dict:
    """{section: section_plan(...)} for the full check on one H200, and "total"."""
    caps = caps or CAPS_S
    out = {name: section_plan(name, tokamax=tokamax, torch=torch, backends=backends,
                              aligned=aligned, train_steps=train_steps,
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
        lines.append(f"#   {name:<8} {r['seconds']:6.0f} s  (cap {r['cap_s']:g} s{extra})")
    return "\n".join(lines)
