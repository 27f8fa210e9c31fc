"""The train section of `dropless bench gpu`: `dropless train --preset deepseek3-1gpu` at its
run settings (`presets.RUN_SETTINGS`: sequence 4096, batch 4, remat=minimal; bfloat16 compute
on float32 weights) for `train_steps` steps on the GPU, with a profiler trace of `PROFILE_STEPS`
of them.

Records (JSON lines, through the runner's Emitter): one per step as it completes, then a
summary: median step time, tokens/s, TFLOPS and MFU (against the device's bfloat16 peak) over
the steps that were neither the first (its dispatch follows the compile) nor traced (the
profiler slows them), peak device memory, the compile's seconds apart from the steps, the
memory pre-flight's verdict and method, and the per-kernel table's groups (the run's
profile_kernels.jsonl, train/profile.py), and which attention ran (cuDNN's flash attention on
the GPU; where it fails naming cuDNN, an "attention_fallback" record says why and the preset is
trained again with the XLA attention). The dry run trains the same preset shrunk to
`DRY_MODEL` on the CPU for 2 steps: the loop, the trace and the table, not the model.
`--train-set KEY=VALUE` (`spec["train_set"]`) trains a variant: the keys over the preset's run
settings, recorded in the summary and planned with the run (`check_train_set` refuses, before
any section runs, a key the section sets itself or one the trainer refuses).

The planner is calibrated from it: a "plan_calibration" record holds, under "record",
`dropless plan`'s prediction of the same step on the detected GPU's profile (`plan.model.predict`
of the trained config, with the attention the run ran: `flash` for cuDNN's flash attention,
`naive` for the XLA one's materialised scores) beside
the measured median, in the schema of benchmarks/results/plan_calibration.jsonl (`error` =
predicted / measured - 1; `plan_calibration`); `append_calibration` copies the device's records
from a gpu_bench.jsonl into that file and refuses a dry run's. The dry run's device is the CPU,
which has no planner profile: its record predicts the step on the H200 the check is sized for,
says so (`platform` "cpu", `hardware_stand_in` true) and compares nothing real.

MaxText trains the same model beside it, on the same GPU, in the next section (bench/
gpu_maxtext.py: examples/deepseek3_1gpu_maxtext.yml, MaxText's source and the wheels its imports
need carried as .maxtext/), whose summary puts this summary's tokens/s over MaxText's.
"""
from __future__ import annotations

import json
from pathlib import Path

PRESET = "deepseek3-1gpu"
PROFILE_STEPS = 3
# the planner's profile a device without one (the dry run's CPU) is predicted on: the device
# check is sized for one H200
STAND_IN_PROFILE = "h200"
CALIBRATION_FILE = "benchmarks/results/plan_calibration.jsonl"
# the dry run's model: the preset's features (MLA with q low-rank, a dense first layer, routed +
# shared experts, grouped sigmoid routing with the bias, the layer layout, bf16 on f32) at a size
# a CPU compiles in seconds
DRY_MODEL = {"model.vocab_size": 256, "model.d_model": 64, "model.moe.d_model": 64,
             "model.d_ff": 128, "model.moe.d_ff": 32, "model.num_layers": 3,
             "model.num_heads": 4, "model.q_lora_rank": 32, "model.kv_lora_rank": 32,
             "model.qk_nope_head_dim": 16, "model.qk_rope_head_dim": 8,
             "model.v_head_dim": 16, "model.moe.num_experts": 8, "model.moe.top_k": 2,
             "model.moe.n_groups": 4, "model.moe.topk_groups": 2}


# what the section sets itself: a --train-set of these keys is refused
SECTION_KEYS = ("preset", "steps", "run_dir", "run_name", "checkpoint_every", "save_last_step",
                "eval_every", "eval_batches", "time_kernels", "profile_steps", "data", "resume")


def check_train_set(pairs) -> None:
    """Raise ValueError, in one line naming the option, for a `--train-set` key the section
    sets itself or that the trainer's config does not take (its own words), or a value it
    refuses; before any section runs."""
    from dropless.config_file import build_config
    for key, _ in pairs:
        if key in SECTION_KEYS:
            raise ValueError(f"--train-set {key}=...: the train section sets {key} itself "
                             "(--train-steps sets the steps)")
    try:
        build_config([("preset", PRESET), *pairs])
    except (ValueError, TypeError) as e:
        raise ValueError(f"--train-set: {e}") from None


def _items(spec: dict, out_dir: Path) -> list[tuple[str, object]]:
    from dropless.presets import RUN_SETTINGS
    items = [("preset", PRESET), *RUN_SETTINGS[PRESET].items(),
             *[tuple(kv) for kv in spec.get("train_set", [])],   # a variant: --train-set
             ("steps", spec["train_steps"]), ("run_dir", str(out_dir)), ("run_name", "train"),
             # no checkpoint: the preset's state (~20 GB of float32 weights and Adam moments)
             # is not written to the GPU machine's disk inside the section's time
             ("checkpoint_every", 0), ("save_last_step", False),
             ("eval_every", 10**6), ("eval_batches", 1),
             ("time_kernels", False),   # the moe section times kernels
             ("profile_steps", PROFILE_STEPS)]
    if spec["dry_run"]:
        corpus = out_dir / "corpus.txt"
        corpus.parent.mkdir(parents=True, exist_ok=True)
        corpus.write_text("def add(a, b):\n    return a + b\n\n" * 200)
        items += [*DRY_MODEL.items(), ("per_device_batch_size", 1), ("seq_len", 16),
                  ("profile_steps", 1), ("data", str(corpus)), ("eval_fraction", 0.1)]
    return items


def _summary(run_dir: Path, traced: range) -> dict:
    """Medians over the steps after the first that the profiler did not trace (all steps after
    the first when every one was traced), the start record's compile and pre-flight, and the
    kernel table's groups."""
    import numpy as np
    recs = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").open()]
    steps = [r for r in recs if r.get("event") == "step"]
    start = next((r for r in recs if r.get("event") == "start"), {})
    later = steps[1:] or steps
    clean = [r for r in later if r["step"] - 1 not in traced] or later

    def med(key):
        vals = [r[key] for r in clean if r.get(key) is not None]
        return float(np.median(vals)) if vals else None

    table = run_dir / "profile_kernels.jsonl"
    groups = ([json.loads(ln) for ln in table.open()] if table.exists() else [])
    times = [r["step_time_s"] for r in clean if r.get("step_time_s") is not None]
    return {"steps": len(steps), "timed_steps": len(clean),
            "median_step_time_s": med("step_time_s"),
            "min_step_time_s": min(times, default=None),
            "max_step_time_s": max(times, default=None), "median_tokens_per_s": med("tokens_per_s"),
            "median_tflops_per_device": med("tflops_per_device"), "median_mfu": med("mfu"),
            "compile_s": start.get("compile_s"), "peak_source": start.get("peak_source"),
            "params": start.get("params"), "attention_kernel": start.get("attention_kernel"),
            "kernel_groups": {g["group"]: round(g["share"], 4) for g in groups
                              if g.get("event") == "group"},
            "final_loss": later[-1].get("loss") if later else None,
            "gmm": {"gmm_backend_ran": start.get("gmm_backend_ran"),
                    "gmm_ran": start.get("gmm_ran") or [],
                    "gmm_fallbacks": start.get("gmm_fallbacks") or []}}


def plan_calibration(cfg, summary: dict, device_kind: str, *, dry_run: bool,
                     train_set=()) -> dict:
    """The planner's prediction of one step of `cfg` (`dropless plan`'s `plan.model.predict`, on
    the profile of `device_kind`, with the attention the run ran: `flash` for cuDNN's, `naive`
    for the XLA one's materialised scores) beside `summary`'s
    measured median step: a record of plan_calibration.jsonl's schema (workload, devices,
    predicted_s, measured_s, error = predicted / measured - 1, the predicted parts, the
    machine), plus the preset, the profile and the settings as `dropless plan` flags (a
    `--train-set` key the flags do not name as `key=value` after them). A device
    with no profile is predicted on `STAND_IN_PROFILE` in a dry run (`hardware_stand_in`), and
    otherwise gets {"skipped": why}. Raises ValueError without a measured step."""
    from dropless.machine import PROFILES, machine_info, profile_for_device
    from dropless.plan.layout import PlanConfig
    from dropless.plan.model import predict
    measured = summary.get("median_step_time_s")
    if not measured or measured <= 0:
        raise ValueError(f"no measured step to calibrate against (median_step_time_s="
                         f"{measured!r})")
    hw = profile_for_device(device_kind)
    stand_in = hw is None
    if stand_in and not dry_run:
        return {"skipped": f"the planner has no profile for {device_kind!r} (known: "
                           f"{sorted(PROFILES)})"}
    hw = PROFILES[STAND_IN_PROFILE] if stand_in else hw
    impl = "flash" if summary.get("attention_kernel") in ("cudnn", "cudnn_thd") else "naive"
    plan = predict(PlanConfig(run=cfg, attention_impl=impl), hw, name=cfg.preset)
    predicted = plan["time"]["step_s"]
    flags = (f"--preset {cfg.preset} --hardware {hw.name} --seq {cfg.seq_len} "
             f"--per-device-batch {cfg.per_device_batch_size} --remat {cfg.remat} "
             f"--attention-impl {impl}"
             + (f" gradient_accumulation_steps={cfg.gradient_accumulation_steps}"
                if cfg.gradient_accumulation_steps > 1 else "")
             + "".join(f" {k}={v if isinstance(v, str) else json.dumps(v)}"
                       for k, v in train_set
                       if k not in ("seq_len", "per_device_batch_size", "remat",
                                    "gradient_accumulation_steps")))
    return {"workload": "train_step", "devices": 1,
            "preset": cfg.preset, "hardware": hw.name, "hardware_stand_in": stand_in,
            "plan_flags": flags, "predicted_s": predicted, "measured_s": measured,
            "error": predicted / measured - 1.0,
            "parts_s": {k: v for k, v in plan["time"]["exposed_s"].items() if v},
            "predicted_tflops_per_device": plan["tflops_per_device"],
            "predicted_memory_bytes": plan["memory"]["total"],
            "measured_min_s": summary.get("min_step_time_s"),
            "measured_max_s": summary.get("max_step_time_s"),
            "compile_s": summary.get("compile_s"), **machine_info(),
            "device_kind": device_kind, "dry_run": dry_run}


def committable(rec: dict) -> str:
    """Why the calibration record `rec` may not go into plan_calibration.jsonl ('' when it may):
    it must be measured on a GPU, not a dry run's or a stand-in's."""
    if rec.get("dry_run") or rec.get("hardware_stand_in") or rec.get("platform") != "gpu":
        return (f"it is a dry run's (platform {rec.get('platform')!r}, "
                f"dry_run {rec.get('dry_run')!r}): its device is not the one predicted")
    return ""


def append_calibration(bench_jsonl: str | Path, out: str | Path = CALIBRATION_FILE) -> int:
    """Append the calibration records of a device check's gpu_bench.jsonl (its
    "plan_calibration" records' "record") to `out`, written whole or not at all, returning how
    many. Raises ValueError naming the file when it holds none, or when one of them may not be
    committed (`committable`): a dry run's never mixes with the device's."""
    from dropless.runtime import files
    recs = [json.loads(ln) for ln in Path(bench_jsonl).read_text().splitlines() if ln.strip()]
    cal = [r["record"] for r in recs if r.get("event") == "plan_calibration" and "record" in r]
    if not cal:
        raise ValueError(f"{bench_jsonl}: no plan_calibration record (the train section's)")
    for r in cal:
        why = committable(r)
        if why:
            raise ValueError(f"{bench_jsonl}: a plan_calibration record cannot go into {out}: "
                             f"{why}")
    old = Path(out).read_text() if Path(out).exists() else ""
    new = [json.dumps(r, sort_keys=True) for r in cal]
    files.write_text(out, old + ("" if not old or old.endswith("\n") else "\n")
                     + "\n".join(new) + "\n")
    return len(new)


def _train_or_fall_back(emit, cfg, progress):
    """(train(cfg)'s result, the config that ran). Where cuDNN's flash attention ran and the
    run failed naming cuDNN, the failure is recorded ("attention_fallback") and the preset
    trained again with the XLA attention (run name "train-xla"): the section still measures
    the model. Any other failure raises."""
    from dropless.train.loop import train
    from dropless.train.step import attention_kernel
    try:
        return train(cfg, progress=progress), cfg
    except Exception as e:  # noqa: BLE001 (re-raised unless it is cuDNN's attention)
        text = f"{type(e).__name__}: {e}"
        ran = attention_kernel(cfg)
        if ran not in ("cudnn", "cudnn_thd") or not any(
                w in text.lower() for w in ("cudnn", "fmha")):
            raise
        emit({"event": "attention_fallback", "from": ran, "to": "xla",
              "reason": text[:2000]},
             f"cuDNN's flash attention failed ({text[:200]}); training again with the XLA one")
    cfg = cfg.replace(run_name="train-xla",
                      model=cfg.model.replace(attention_kernel="xla"))
    return train(cfg, progress=progress), cfg


def train_section(emit, spec: dict) -> None:
    """Train the preset (module docstring): a JSON line per step as it completes, then the
    summary record."""
    import jax

    from dropless.bench.gpu_common import ran as _ran
    from dropless.config_file import build_config
    from dropless.runtime.xla_flags import apply_recipe
    from dropless.train import preflight
    from dropless.train.profile import window
    from dropless.train.progress import Progress
    out_dir = Path(spec["out_dir"]) / "train_run"
    cfg = build_config(_items(spec, out_dir))
    apply_recipe(cfg.xla_recipe)
    class Steps(Progress):
        def step(self, n, *, loss, tokens_per_s, text):
            emit({"event": "step", "step": n, "loss": loss, "tokens_per_s": tokens_per_s})

    result, cfg = _train_or_fall_back(emit, cfg, Steps(print, bar=False))
    fit = result.preflight     # the trainer's pre-flight, before it allocated anything
    emit({"event": "preflight", "method": fit["method"], "bytes": fit["total"],
          "limit_bytes": fit.get("limit"), "source": fit.get("source"),
          "compile_s": (fit.get("compiled") or {}).get("compile_s")},
         preflight.summary(fit).strip())
    s = _summary(Path(result.run_dir), window(0, cfg.steps, cfg.profile_steps))
    gmm = s.pop("gmm")
    stats = jax.devices()[0].memory_stats() or {}
    rec = {"event": "summary", "preset": PRESET, "seq_len": cfg.seq_len,
           "per_device_batch_size": cfg.per_device_batch_size, "remat": cfg.remat,
           "train_set": dict(spec.get("train_set", [])),
           "gmm_backend": cfg.model.moe.gmm_backend, **s,
           "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
           "preflight_bytes": fit["total"], "preflight_method": fit["method"],
           "device": jax.devices()[0].device_kind}
    emit(_ran(rec, cfg.model.moe.gmm_backend, gmm))
    cal = plan_calibration(cfg, s, rec["device"], dry_run=bool(spec["dry_run"]),
                           train_set=spec.get("train_set", []))
    if "skipped" in cal:   # a record of its own: the runner's table counts its keys
        emit({"event": "plan_calibration", **cal}, cal["skipped"])
        return
    emit({"event": "plan_calibration", "record": cal},
         f"planner on {cal['hardware']}{' (stand-in)' * cal['hardware_stand_in']}: "
         f"{cal['predicted_s']:.4g} s a step predicted, {cal['measured_s']:.4g} s measured, "
         f"error {100 * cal['error']:+.0f}%")
