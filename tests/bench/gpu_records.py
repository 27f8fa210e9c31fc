"""Records shaped as `dropless bench gpu` writes them, with numbers a test chooses: the readers
of gpu_bench.jsonl (benchmarks/gpu/tables.py, ops/gmm/winners.from_records) are tested on them.

Legend: M routed rows, K contraction dim, N output dim, G groups.

The keys are those of a dry run's records (`dropless bench gpu --dry-run --sections info,gmm`);
tests/bench/test_gpu_tables.py runs one and checks that they still are. A device run writes
the same records with `dry_run` false and the GPU's device kind.
"""
from __future__ import annotations

from dropless.bench import gpu_plan
from dropless.ops.gmm import shapes

SHAPES = {s.label: s for s in (*shapes.SHAPES, *gpu_plan.DRY_SHAPES)}


def info(device_kind: str = "NVIDIA H200", *, dry_run: bool = False,
         commit: str = "abc1234") -> dict:
    return {"attention_kernel_1gpu": "cudnn", "auto_on_this_platform": "tokamax",
            "cores": 16, "cudnn_attention_problem": None, "cudnn_thd_problem": None,
            "cpu": "Intel(R) Xeon(R) Processor",
            "cublas_jax": 120900, "cudnn_jax": 91900, "cudnn_jax_build": 91900,
            "cudnn_torch": 91900, "device_count": 1, "device_kind": device_kind,
            "dry_run": dry_run, "git_commit": commit,
            "gmm_measured": ["mosaic_gpu", "tokamax", "pallas_gpu"],
            "gmm_unusable": {"cudnn_ragged_dot": "cuDNN 9.19 < 9.22"},
            "gmm_usable": ["reference", "ragged_dot", "tiled", "pallas_gpu", "tokamax",
                           "mosaic_gpu", "padded", "loop"],
            "host_malloc": "system", "jax": "0.11.2", "jax_cuda_plugin": "jax-cuda13-plugin 0.11.2",
            "jaxlib": "0.11.2",
            "nvidia_smi": "NVIDIA H200, 143771 MiB, 1980 MHz, 580.159.04", "platform": "gpu",
            "section": "info", "t_s": 2.9, "tokamax": "0.0.17", "torch": "2.11.0+cu130",
            "torch_cuda": True, "triton": "3.6.0"}


def gmm(shape: str, routing: str, mode: str, backend: str, ms: float, *,
        dense_ms: float = 1.0, ran: str | None = None, aligned: bool | None = None,
        dry_run: bool = False) -> dict:
    """One timed grouped-matmul record in `mode` (fwd, fwd+bwd, dlhs, drhs; `backend`
    "dense_xla" ran "dense"; a torch peer has no fallback fields); `aligned` True: on aligned
    segments (gpu_plan.ALIGN_ROWS)."""
    s = SHAPES[shape]
    flops = 2 * s.m * s.k * s.n * (3 if mode == "fwd+bwd" else 1)
    rec = {"backend": backend, "compile_ms": 800.0, "dry_run": dry_run, "dtype": "bfloat16",
           "empty_groups": 0, "groups": s.g, "k": s.k, "m": s.m, "max_group": s.m // s.g + 1,
           "median_ms": ms, "min_ms": ms, "mode": mode, "model": s.model, "n": s.n,
           "reps": 3, "routing": routing, "section": "gmm", "shape": shape, "t_s": 9.0,
           "tflops": flops / (ms * 1e-3) / 1e12, "useful_flops": flops}
    if backend.startswith("torch"):
        return dict(rec, ran=backend)
    rec.update(dense_xla_ms=dense_ms, fraction_of_dense=dense_ms / ms, gmm_fallbacks=[],
               ran=ran or ("dense" if backend == "dense_xla" else backend))
    if ran not in (None, backend):
        rec["ran_because"] = f"{backend} failed to compile: injected"
    if aligned:      # the aligned layout's rows; the useful FLOPs stay the unaligned rows'
        rec.update(aligned=True, group_alignment=gpu_plan.ALIGN_ROWS,
                   aligned_rows=gpu_plan.aligned_m(s))
    elif aligned is not None:
        rec["aligned"] = aligned
    return rec


def skipped(shape: str, backend: str, why: str = "not usable here: tokamax is not installed",
            *, modes: tuple[str, ...] = ("fwd", "fwd+bwd"), dry_run: bool = False) -> dict:
    """A backend the gmm section could not run at a shape, in `modes` (one unit's part:
    gpu_plan.PARTS)."""
    return {"backend": backend, "dry_run": dry_run, "section": "gmm", "shape": shape,
            "modes": list(modes), "skipped": why, "t_s": 4.8}


def run(gmm_records: list[dict], *, device_kind: str = "NVIDIA H200",
        dry_run: bool = False) -> list[dict]:
    """A whole gpu_bench.jsonl of sections info and gmm around `gmm_records`."""
    end = {"dry_run": dry_run, "estimated_h200_s": 11.1, "event": "section_end",
           "returncode": 0, "seconds": 3.5, "status": "ok", "t_s": 3.5, "timeout_s": 15}
    return [{"budget_s": 450, "caps_s": {"gmm": 115, "info": 15}, "dry_run": dry_run,
             "estimate_h200": {"gmm": {"cap_s": 115, "dropped": [], "kept": [],
                                       "seconds": 50.8}, "info": {"cap_s": 15, "seconds": 11.1}},
             "section": "plan", "sections": ["info", "gmm"], "t_s": 0.0},
            {"event": "section_start", "pid": 1, "section": "info", "t_s": 0.01},
            info(device_kind, dry_run=dry_run),
            dict(end, section="info", log="info.log"),
            {"event": "section_start", "pid": 2, "section": "gmm", "t_s": 3.55},
            *gmm_records,
            dict(end, section="gmm", log="gmm.log", seconds=9.7, timeout_s=115),
            {"event": "summary", "section": "summary", "t_s": 13.2, "rows": [
                {"section": name, "status": "ok", "seconds": 3.5, "estimated_h200_s": 11.1,
                 "cap_s": 15, "measurements": 1, "errors": 0, "skipped": 0, "fallbacks": 0}
                for name in ("info", "gmm")]}]


def train_summary(step_s: float, *, tokens: int = 16384, tflop: float = 40.555,
                  peak_tflops: float = 989.0, device_kind: str = "NVIDIA H200") -> dict:
    """The train section's summary of a run whose median step took `step_s` (the keys
    tables.py reads, with numbers a test chooses)."""
    return {"section": "train", "event": "summary", "preset": "deepseek3-1gpu", "steps": 20,
            "timed_steps": 16, "median_step_time_s": step_s, "median_tokens_per_s": tokens / step_s,
            "median_tflops_per_device": tflop / step_s,
            "median_mfu": tflop / step_s / peak_tflops, "compile_s": 60.0, "ran": "tokamax",
            "device": device_kind, "dry_run": False, "t_s": 300.0}


def maxtext_summary(step_s: float, *, train_step_s: float | None = None, tokens: int = 16384,
                    tflop: float = 40.555, peak_tflops: float = 989.0,
                    device_kind: str = "NVIDIA H200", dry_run: bool = False) -> dict:
    """The maxtext section's summary (bench/gpu_maxtext.py) of a run whose median step took
    `step_s`, beside a train section's of `train_step_s` (None: no train summary)."""
    rec = {"commit": "e591f30cbbf217ed67ef71263ec0538239f9c3b8", "compiled_estimate_gb": 60.1,
           "device": device_kind, "dropless_tflop_per_step": tflop, "dry_run": dry_run,
           "event": "summary", "final_loss": 7.1, "first_step_s": 70.0,
           "flags": {"skip_jax_distributed_system": True, "steps": 10, "use_tokamax_gmm": True},
           "launch_to_first_step_s": 80.0, "log": "maxtext/maxtext_train.log",
           "max_step_time_s": step_s * 1.1, "maxtext_tflop_per_step": 40.56,
           "maxtext_tokens_per_step": float(tokens),
           "median_logged_step_interval_s": step_s, "median_maxtext_tflops_per_device":
               40.56 / step_s, "median_mfu": tflop / step_s / peak_tflops,
           "median_step_time_s": step_s, "median_tflops_per_device": tflop / step_s,
           "median_tokens_per_s": tokens / step_s, "memory_in_use_gb": 20.5,
           "memory_limit_gb": 139.8, "min_step_time_s": step_s * 0.95,
           "moe_kernel": "tokamax.ragged_dot (implementation='mosaic'): use_tokamax_gmm=true",
           "peak_source": f"table: {device_kind}", "per_device_batch_size": 4,
           "preset": "deepseek3-1gpu", "python": "python3", "returncode": 0, "seconds": 95.0,
           "section": "maxtext", "seq_len": 4096, "skipped_first_steps": 3, "steps": 10,
           "t_s": 420.0, "timed_steps": 7, "tokens_per_step": tokens}
    if train_step_s is not None:
        rec.update(dropless_tokens_per_s=tokens / train_step_s,
                   dropless_median_step_time_s=train_step_s,
                   tokens_per_s_ratio=step_s / train_step_s)
    return rec


def maxtext_skipped(*, dry_run: bool = False) -> dict:
    """The maxtext section's record where .maxtext/ was not carried."""
    return {"carry": [".whl", ".maxtext"], "dry_run": dry_run, "event": "skipped",
            "fetch": "bash benchmarks/gpu/fetch_wheels.sh && bash benchmarks/gpu/fetch_maxtext.sh",
            "section": "maxtext", "t_s": 400.0,
            "skipped": ".maxtext/COMMIT is missing (MaxText is fetched with network, not here)"}
