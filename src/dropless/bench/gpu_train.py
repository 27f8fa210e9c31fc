"""The train section of `dropless bench gpu`: `dropless train --preset deepseek3-1gpu` at its
run settings (`presets.RUN_SETTINGS`: sequence 4096, batch 2, remat=minimal; bfloat16 compute
on float32 weights) for `train_steps` steps on the GPU, with a profiler trace of `PROFILE_STEPS`
of them.

Records (JSON lines, through the runner's Emitter): one per step as it completes, then a
summary: median step time, tokens/s, TFLOPS and MFU (against the device's bfloat16 peak) over
the steps that were neither the first (its dispatch follows the compile) nor traced (the
profiler slows them), peak device memory, the compile's seconds apart from the steps, the
memory pre-flight's verdict and method, and the per-kernel table's groups (the run's
profile_kernels.jsonl, train/profile.py). The dry run trains the same preset shrunk to
`DRY_MODEL` on the CPU for 2 steps: the loop, the trace and the table, not the model.

MaxText is not run beside it: the device has no network, and its wheel's imports (jax-free
pins of tensorflow, tensorflow-text, grain, orbax, ...) are far above what may travel with a
device run (docs/training.md "One GPU" gives the sizes and the MaxText YAML of this model).
"""
from __future__ import annotations

import json
from pathlib import Path

PRESET = "deepseek3-1gpu"
PROFILE_STEPS = 3
# the dry run's model: the preset's features (MLA with q low-rank, a dense first layer, routed +
# shared experts, grouped sigmoid routing with the bias, the scan layout, bf16 on f32) at a size
# a CPU compiles in seconds
DRY_MODEL = {"model.vocab_size": 256, "model.d_model": 64, "model.moe.d_model": 64,
             "model.d_ff": 128, "model.moe.d_ff": 32, "model.num_layers": 3,
             "model.num_heads": 4, "model.q_lora_rank": 32, "model.kv_lora_rank": 32,
             "model.qk_nope_head_dim": 16, "model.qk_rope_head_dim": 8,
             "model.v_head_dim": 16, "model.moe.num_experts": 8, "model.moe.top_k": 2,
             "model.moe.n_groups": 4, "model.moe.topk_groups": 2}


def _items(spec: dict, out_dir: Path) -> list[tuple[str, object]]:
    from dropless.presets import RUN_SETTINGS
    items = [("preset", PRESET), *RUN_SETTINGS[PRESET].items(),
             ("steps", spec["train_steps"]), ("run_dir", str(out_dir)), ("run_name", "train"),
             ("checkpoint_every", 0), ("eval_every", 10**6), ("eval_batches", 1),
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
    return {"steps": len(steps), "timed_steps": len(clean),
            "median_step_time_s": med("step_time_s"), "median_tokens_per_s": med("tokens_per_s"),
            "median_tflops_per_device": med("tflops_per_device"), "median_mfu": med("mfu"),
            "compile_s": start.get("compile_s"), "peak_source": start.get("peak_source"),
            "params": start.get("params"),
            "kernel_groups": {g["group"]: round(g["share"], 4) for g in groups
                              if g.get("event") == "group"},
            "final_loss": later[-1].get("loss") if later else None,
            "gmm": {"gmm_backend_ran": start.get("gmm_backend_ran"),
                    "gmm_ran": start.get("gmm_ran") or [],
                    "gmm_fallbacks": start.get("gmm_fallbacks") or []}}


def train_section(emit, spec: dict) -> None:
    """Train the preset (module docstring): a JSON line per step as it completes, then the
    summary record."""
    import jax

    from dropless.bench.gpu_common import ran as _ran
    from dropless.config_file import build_config
    from dropless.runtime.xla_flags import apply_recipe
    from dropless.train import preflight
    from dropless.train.loop import train
    from dropless.train.profile import window
    from dropless.train.progress import Progress
    out_dir = Path(spec["out_dir"]) / "train_run"
    cfg = build_config(_items(spec, out_dir))
    apply_recipe(cfg.xla_recipe)
    class Steps(Progress):
        def step(self, n, *, loss, tokens_per_s, text):
            emit({"event": "step", "step": n, "loss": loss, "tokens_per_s": tokens_per_s})

    result = train(cfg, progress=Steps(print, bar=False))
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
           "gmm_backend": cfg.model.moe.gmm_backend, **s,
           "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
           "preflight_bytes": fit["total"], "preflight_method": fit["method"],
           "device": jax.devices()[0].device_kind}
    emit(_ran(rec, cfg.model.moe.gmm_backend, gmm))
