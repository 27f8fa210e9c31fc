"""`dropless bench gpu`: the one prepared device check for an NVIDIA GPU (sized for one H200).

Legend: M routed rows, K contraction dim, N output dim, G groups (experts).

Sections, each appending JSON lines (key "section") to OUT_DIR/gpu_bench.jsonl:
  info    versions (jax, jaxlib, torch, triton, tokamax) and the device
  tests   the GPU-relevant tests under JAX_PLATFORMS=cuda (Triton kernels, not interpret mode)
  gmm     bf16 grouped matmul, fwd and fwd+bwd, every GPU backend (pallas_gpu, tokamax when
          installed, ragged_dot) and torch._grouped_mm as the peer, against a cuBLAS dense matmul
          of equal FLOPs timed in the same run (XLA's dense dot and torch.mm), on G=8/64/256 with
          M=8192, K=N=1024 and the DeepSeek-V3 expert-parallel shape (M=24576, K=7168, N=2048,
          G=32), uniform and Zipf routing
  moe     the MoE layer fwd+bwd against a dense SwiGLU over the same rows (`bench moe`)
  train   `dropless train --preset deepseek3-test` for a few steps: step time, TFLOPS, MFU,
          peak device memory (in a child process, so the peak is the training run's own)
`--dry-run` runs every section end to end on CPU with tiny shapes (pallas_gpu in interpret mode,
the tests section skipped) so the script is never first run on a GPU. Nothing here asserts a
speed: the numbers are for benchmarks/results/gpu_h200.jsonl and docs/gpu.md.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dropless.bench import gpu_timing, harness
from dropless.bench.gmm import group_sizes_for
from dropless.ops import grouped_matmul, resolve_backend
from dropless.ops.gmm.registry import tokamax_available

SECTIONS = ("info", "tests", "gmm", "moe", "train")
# (label, M, K, N, G): the shapes; the dry run's tiny stand-ins
SHAPES = (("G8", 8192, 1024, 1024, 8), ("G64", 8192, 1024, 1024, 64),
          ("G256", 8192, 1024, 1024, 256), ("dsv3_ep", 24576, 7168, 2048, 32))
DRY_SHAPES = (("G2", 64, 32, 32, 2), ("G4", 64, 32, 32, 4), ("dsv3_ep", 96, 48, 32, 4))
TESTS = ("tests/test_gmm_pallas_gpu.py", "tests/test_gmm.py", "tests/test_cuda_lowering.py")
# the G-fold ragged_dot of CUDA is skipped when its padded [G, M, max(K, N)] operands exceed this
RAGGED_DOT_BYTES_LIMIT = 40 * 2**30


def _emit(path: Path, records: list[dict]) -> None:
    harness.write_jsonl(str(path), records)
    for r in records:
        keys = ("section", "shape", "routing", "mode", "backend", "median_ms", "tflops",
                "fraction_of_dense", "skipped", "error")
        print("  ".join(f"{k}={r[k]}" for k in keys if k in r), flush=True)


def info_section() -> list[dict]:
    """Versions and the device."""
    rec = {"section": "info", **harness.machine_info(), **gpu_timing.torch_info()}
    for mod in ("triton", "tokamax"):
        try:
            rec[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 (absent or broken: recorded as None)
            rec[mod] = None
    rec["auto_on_this_platform"] = resolve_backend("auto")
    try:
        rec["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,clocks.max.sm,driver_version",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        rec["nvidia_smi"] = None
    return [rec]


def tests_section(out_dir: Path, timeout_s: int) -> list[dict]:
    """pytest of the GPU-relevant tests on the device (JAX_PLATFORMS=cuda); log to OUT_DIR."""
    # f32 reference comparisons at 1e-5 need f32 dots, not XLA's TF32 default on NVIDIA GPUs
    env = dict(os.environ, JAX_PLATFORMS="cuda", PYTHONUNBUFFERED="1",
               JAX_DEFAULT_MATMUL_PRECISION="highest")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, ["src", env.get("PYTHONPATH")]))
    # the hypothesis soak and the 1,600-row tiled case test CPU code paths: not the GPU's
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS,
           "-k", "not property and not default_tiles", "--durations=10"]
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        rc, log = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        out = e.stdout or ""
        rc, log = "timeout", out.decode(errors="replace") if isinstance(out, bytes) else out
    (out_dir / "gpu_tests.log").write_text(log)
    tail = [ln for ln in log.splitlines() if ln.strip()][-3:]
    return [{"section": "tests", "returncode": rc, "seconds": time.perf_counter() - t,
             "command": " ".join(cmd), "summary": tail}]


def _dense_jax(x_MK, w_KN, dy_MN):
    """XLA's dense bf16 dot (cuBLAS on CUDA), output in bf16, autodiff's bf16 backward."""
    fwd = jax.jit(lambda a, b: a @ b)
    fb = jax.jit(lambda a, b, d: jax.vjp(lambda p, q: p @ q, a, b)[1](d))
    return (lambda: fwd(x_MK, w_KN)), (lambda: fb(x_MK, w_KN, dy_MN))


def _grouped_jax(backend, x_MK, w_GKN, sizes_G, dy_MN):
    def f(a, b):
        return grouped_matmul(a, b, sizes_G, backend=backend)
    fwd = jax.jit(f)
    fb = jax.jit(lambda a, b, d: jax.vjp(f, a, b)[1](d))
    return (lambda: fwd(x_MK, w_GKN)), (lambda: fb(x_MK, w_GKN, dy_MN))


def gmm_backends() -> list[str]:
    """The GPU backends measured: ours, tokamax where installed, and ragged_dot (by name)."""
    return ["pallas_gpu"] + (["tokamax"] if tokamax_available() else []) + ["ragged_dot"]


def gmm_section(shapes, routings, timing: dict) -> list[dict]:
    """Every GPU backend and the torch peer against dense matmuls of equal FLOPs."""
    records = []
    for label, m, k, n, g in shapes:
        rng = np.random.default_rng(g)
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((g, k, n)) / math.sqrt(k), jnp.bfloat16)
        dy = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
        dense_f, dense_fb = _dense_jax(x, w[0], dy)
        for routing in routings:
            sizes = group_sizes_for(routing, m, g, seed=g)
            gs = jnp.asarray(sizes)
            base = {"section": "gmm", "shape": label, "m": m, "k": k, "n": n, "groups": g,
                    "routing": routing, "dtype": "bfloat16", "max_group": int(sizes.max()),
                    "empty_groups": int((sizes == 0).sum())}
            fns = {}
            for b in gmm_backends():
                if b == "ragged_dot" and g * m * max(k, n) * 2 * 3 > RAGGED_DOT_BYTES_LIMIT:
                    fns[b] = None  # the padded product would not fit: recorded as skipped
                else:
                    fns[b] = _grouped_jax(b, x, w, gs, dy)
            peer = gpu_timing.torch_peer(sizes, m, k, n, **timing)
            for mi, mode in enumerate(("fwd", "fwd+bwd")):
                flops = 2 * m * k * n * (1 if mode == "fwd" else 3)
                dense = gpu_timing.time_jax((dense_f, dense_fb)[mi], **timing)
                rows = [dict(backend="dense_xla", **dense)]
                for b, pair in fns.items():
                    if pair is None:
                        rows.append({"backend": b, "skipped": "padded [G, M, max(K,N)] operands "
                                     f"exceed {RAGGED_DOT_BYTES_LIMIT >> 30} GiB"})
                        continue
                    try:
                        rows.append(dict(backend=b, resolved=resolve_backend(b),
                                         **gpu_timing.time_jax(pair[mi], **timing)))
                    except Exception as e:  # noqa: BLE001 (one backend's failure is a result)
                        rows.append({"backend": b, "error": f"{type(e).__name__}: "
                                     f"{str(e)[:300]}"})
                for name in ("torch_dense", "torch_grouped_mm"):
                    rows.append(dict(backend=name, **peer[f"{name}/{mode}"]))
                for r in rows:
                    r.update(base, mode=mode, useful_flops=flops, dense_xla_ms=dense["median_ms"])
                    if "median_ms" in r:
                        r["tflops"] = flops / (r["median_ms"] * 1e-3) / 1e12
                        r["fraction_of_dense"] = dense["median_ms"] / r["median_ms"]
                records += rows
    return records


def moe_section(out_path: Path, dry_run: bool) -> list[dict]:
    """`bench moe` on bf16 (the layer vs a dense SwiGLU of the same rows), JSON to out_path."""
    from dropless.bench import moe as bench_moe
    p = argparse.ArgumentParser()
    bench_moe.add_arguments(p)
    args = p.parse_args([])
    args.dtypes, args.capacity_factors, args.out = "bfloat16", "", str(out_path)
    args.backends = "auto" if dry_run else "auto,pallas_gpu"
    if dry_run:
        args.rows, args.d_model, args.d_ff, args.experts = 64, 32, 32, "4:2"
        args.routings, args.repeats = "uniform", 1
    else:
        args.rows, args.d_model, args.d_ff, args.experts = 16384, 2048, 1024, "8:2,64:8"
        args.repeats = 10
    t = time.perf_counter()
    bench_moe.run(args)
    return [{"section": "moe", "seconds": time.perf_counter() - t,
             "note": "records with bench=moe in this file"}]


def train_child(out_dir: str, steps: int, dry_run: bool) -> None:
    """Run in a child process: train a few steps, then print one JSON line of results."""
    from dropless.config_file import build_config
    from dropless.train.xla_flags import apply_recipe
    items = [("preset", "deepseek3-test"), ("steps", steps), ("run_dir", out_dir),
             ("run_name", "train"), ("checkpoint_every", 0), ("eval_every", 10**6)]
    if dry_run:  # a small corpus and one dense + one MoE layer: the loop, not the model, is tested
        corpus = Path(out_dir) / "corpus.txt"
        corpus.parent.mkdir(parents=True, exist_ok=True)
        corpus.write_text("def add(a, b):\n    return a + b\n\n" * 200)
        items += [("per_device_batch_size", 1), ("seq_len", 16), ("model.num_layers", 2),
                  ("model.mtp_depth", 0), ("data", str(corpus)), ("eval_fraction", 0.1)]
    cfg = build_config(items)
    apply_recipe(cfg.xla_recipe)
    from dropless.train.loop import train
    result = train(cfg)
    steps_ = [json.loads(ln) for ln in (Path(result.run_dir) / "metrics.jsonl").open()
              if '"event": "step"' in ln]
    later = steps_[1:] or steps_   # step 1 includes compilation
    med = lambda key: (float(np.median([r[key] for r in later if r.get(key) is not None]))
                       if any(r.get(key) is not None for r in later) else None)
    stats = jax.devices()[0].memory_stats() or {}
    print("TRAIN_RESULT " + json.dumps({
        "section": "train", "preset": "deepseek3-test", "steps": steps,
        "gmm_backend": cfg.model.moe.gmm_backend, "resolved": resolve_backend("auto"),
        "median_step_time_s": med("step_time_s"), "median_tflops_per_device":
        med("tflops_per_device"), "median_mfu": med("mfu"),
        "peak_bytes_in_use": stats.get("peak_bytes_in_use"), "device":
        jax.devices()[0].device_kind, "final_loss": later[-1].get("loss") if later else None}))


def train_section(out_dir: Path, steps: int, dry_run: bool, timeout_s: int) -> list[dict]:
    """`train_child` in a fresh process (its peak memory is the training run's alone)."""
    code = ("from dropless.bench.gpu import train_child; "
            f"train_child({str(out_dir / 'train_run')!r}, {steps}, {dry_run})")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=timeout_s)
        log = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired:
        return [{"section": "train", "error": f"timed out after {timeout_s} s"}]
    (out_dir / "train.log").write_text(log)
    lines = [ln for ln in log.splitlines() if ln.startswith("TRAIN_RESULT ")]
    if proc.returncode or not lines:
        return [{"section": "train", "error": f"exit {proc.returncode}",
                 "tail": log.splitlines()[-5:]}]
    return [json.loads(lines[-1].split(" ", 1)[1])]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out-dir", default=os.environ.get("OUT", "gpu_bench_out"),
                   help="where gpu_bench.jsonl and the logs go (default $OUT, else ./gpu_bench_out)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {SECTIONS}")
    p.add_argument("--routings", default="uniform,zipf", help="grouped-matmul routings")
    p.add_argument("--shapes", default=None,
                   help="comma list of shape labels (default all: "
                        f"{','.join(s[0] for s in SHAPES)}; dry run: "
                        f"{','.join(s[0] for s in DRY_SHAPES)})")
    p.add_argument("--train-steps", type=int, default=8)
    p.add_argument("--tests-timeout-s", type=int, default=180)
    p.add_argument("--dry-run", action="store_true",
                   help="every section on CPU with tiny shapes (pallas_gpu in interpret mode); "
                        "skips the tests section")


def _shapes(args) -> tuple:
    table = DRY_SHAPES if args.dry_run else SHAPES
    if not args.shapes:
        return table
    want = args.shapes.split(",")
    bad = sorted(set(want) - {s[0] for s in table})
    if bad:
        raise ValueError(f"--shapes: unknown {bad}; known: {[s[0] for s in table]}")
    return tuple(s for s in table if s[0] in want)


def run(args: argparse.Namespace) -> int:
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "gpu_bench.jsonl"
    sections = [s for s in args.sections.split(",") if s]
    bad = sorted(set(sections) - set(SECTIONS))
    if bad:
        raise ValueError(f"--sections: unknown {bad}; known: {list(SECTIONS)}")
    if not args.dry_run and jax.default_backend() != "gpu":
        raise ValueError(f"bench gpu needs a GPU (jax's default backend is "
                         f"{jax.default_backend()!r}); use --dry-run to check it on CPU")
    timing = dict(samples=1, min_sample_s=0.0) if args.dry_run else dict(samples=5)
    routings = args.routings.split(",")
    for section in sections:
        t = time.perf_counter()
        print(f"# section {section}", flush=True)
        if section == "info":
            recs = info_section()
        elif section == "tests":
            recs = ([{"section": "tests", "skipped": "dry run (no GPU)"}] if args.dry_run
                    else tests_section(out_dir, args.tests_timeout_s))
        elif section == "gmm":
            recs = gmm_section(_shapes(args), routings, timing)
        elif section == "moe":
            recs = moe_section(path, args.dry_run)
        else:
            recs = train_section(out_dir, 2 if args.dry_run else args.train_steps, args.dry_run,
                                 timeout_s=600)
        for r in recs:
            r.setdefault("section_seconds", time.perf_counter() - t)
            r["dry_run"] = bool(args.dry_run)
        _emit(path, recs)
    print(f"# wrote {path}")
    return 0
