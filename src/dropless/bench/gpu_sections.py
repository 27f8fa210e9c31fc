"""The sections of `dropless bench gpu`, each run in its own process by the runner (bench/gpu.py).

Legend: M routed rows, K contraction dim, N output dim, G groups (experts).

`python -m dropless.bench.gpu_sections SPEC_JSON` runs one section. Every measurement is
appended to the results file as one JSON line the moment it is taken, with a progress line on
stdout beside it, so a section cut off at its cap keeps what it measured. Inside a section each
measurement is isolated too: a backend that fails to compile or run is recorded as an error and
the next one runs. SPEC_JSON carries "fault" ({"gmm": "raise" | "hang" | "exit",
"gmm:pallas_gpu": "raise", ...}) so the dry run can show that isolation on CPU.
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

from dropless.bench import gpu_plan as plan


class Emitter:
    """Appends records to the results file (one line each, flushed at once) and prints each
    one's progress line, stamped with the seconds since the whole check started."""

    def __init__(self, path: str, section: str, t0: float, dry_run: bool):
        self.path, self.section, self.t0, self.dry_run = Path(path), section, t0, dry_run

    def __call__(self, rec: dict, line: str | None = None) -> None:
        rec = {"section": self.section, **rec, "dry_run": self.dry_run,
               "t_s": round(time.time() - self.t0, 2)}
        with self.path.open("a") as fh:
            fh.write(json.dumps(rec, sort_keys=True, default=str) + "\n")
        print(f"[{rec['t_s']:6.1f} s] {self.section}: {line or _line(rec)}", flush=True)


def _line(rec: dict) -> str:
    keys = ("shape", "routing", "mode", "backend", "median_ms", "tflops", "fraction_of_dense",
            "variant", "ratio_to_dense", "step", "loss", "median_step_time_s",
            "median_tflops_per_device", "median_mfu", "peak_bytes_in_use", "skipped", "error")
    return "  ".join(f"{k}={_fmt(rec[k])}" for k in keys if k in rec)


def _fmt(v):
    return f"{v:.4g}" if isinstance(v, float) else v


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[:300]}"


def fault(spec: dict, key: str) -> None:
    """Do the fault the spec injects at `key` (none: nothing)."""
    kind = spec.get("fault", {}).get(key)
    if kind == "raise":
        raise RuntimeError(f"injected fault at {key}")
    if kind == "hang":
        time.sleep(10**6)
    if kind == "exit":
        import os
        os._exit(3)


def info_section(emit: Emitter, spec: dict) -> None:
    """Versions (jax, jaxlib, torch, triton, tokamax), the device, and what `auto` resolves to."""
    import subprocess

    from dropless import machine
    from dropless.bench import gpu_timing
    from dropless.ops import resolve_backend
    rec = {**machine.machine_info(), **gpu_timing.torch_info()}
    for mod in ("triton", "tokamax"):
        try:
            rec[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 (absent or broken: recorded as None)
            rec[mod] = None
    rec["auto_on_this_platform"] = resolve_backend("auto")
    try:
        rec["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,clocks.max.sm,driver_version",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        rec["nvidia_smi"] = None
    emit(rec, f"jax {rec.get('jax')}, torch {rec['torch']}, triton {rec['triton']}, "
              f"tokamax {rec['tokamax']}, auto -> {rec['auto_on_this_platform']}")


def _gmm_fns(backend: str):
    """(fwd, fwd+bwd) jitted once per shape: group sizes are an argument, so one compile serves
    every routing. Signature (x_MK, w, sizes_G, dy_MN); w is w_GKN, or for dense_xla one
    group's w_KN (one bf16 cuBLAS matmul of the same FLOPs; sizes_G unused)."""
    import jax

    from dropless.ops import grouped_matmul
    if backend == "dense_xla":
        def f(a, b, s):
            return a @ b
    else:
        def f(a, b, s):
            return grouped_matmul(a, b, s, backend=backend)
    fwd = jax.jit(lambda a, b, s, d: f(a, b, s))
    fb = jax.jit(lambda a, b, s, d: jax.vjp(lambda p, q: f(p, q, s), a, b)[1](d))
    return {"fwd": fwd, "fwd+bwd": fb}


def _operands(s: plan.Shape):
    """bf16 x_MK, w_GKN (scaled by 1/sqrt(K)) and dy_MN, drawn on the device: host-side
    random numbers at the DeepSeek-V3 shape would be ~650 M draws."""
    import jax
    import jax.numpy as jnp
    kx, kw, kd = jax.random.split(jax.random.key(s.g), 3)
    x = jax.random.normal(kx, (s.m, s.k), jnp.bfloat16)
    w = jax.random.normal(kw, (s.g, s.k, s.n), jnp.bfloat16) * jnp.bfloat16(1 / math.sqrt(s.k))
    dy = jax.random.normal(kd, (s.m, s.n), jnp.bfloat16)
    return jax.block_until_ready((x, w, dy))


def gmm_section(emit: Emitter, spec: dict) -> None:
    """Each shape's backends against XLA's dense matmul of equal FLOPs (same run), then the torch
    peer; fwd and fwd+bwd, every routing. One measurement's failure is recorded, not raised."""
    import jax.numpy as jnp

    from dropless.bench import gpu_timing
    from dropless.bench.gmm import group_sizes_for
    from dropless.ops import resolve_backend
    from dropless.ops.gmm.registry import tokamax_available
    timing = spec["timing"]
    for s in (plan.Shape(*row[:5], tuple(row[5])) for row in spec["shapes"]):
        try:
            x, w, dy = _operands(s)
        except Exception as e:  # noqa: BLE001 (e.g. out of memory: the next shape runs)
            emit({"shape": s.label, "error": f"operands: {_error(e)}"})
            continue
        backends = plan.backends_at(s, tokamax_available())
        fns = {b: _gmm_fns(b) for b in backends}
        for routing in spec["routings"]:
            sizes = group_sizes_for(routing, s.m, s.g, seed=s.g)
            gs = jnp.asarray(sizes, jnp.int32)
            base = {"shape": s.label, "m": s.m, "k": s.k, "n": s.n, "groups": s.g,
                    "routing": routing, "dtype": "bfloat16", "max_group": int(sizes.max()),
                    "empty_groups": int((sizes == 0).sum())}
            for mode in plan.MODES:
                dense_ms = None
                for b in backends:
                    rec = dict(base, mode=mode, backend=b, useful_flops=plan.flops(s, mode),
                               resolved=resolve_backend(b) if b != "dense_xla" else "dense")
                    why = plan.skip_reason(s, b, timing)
                    if why:
                        emit(dict(rec, skipped=why))
                        continue
                    try:
                        fault(spec, f"gmm:{b}")
                        fn, wb = fns[b][mode], (w[0] if b == "dense_xla" else w)
                        rec.update(gpu_timing.time_jax(lambda: fn(x, wb, gs, dy), **timing))
                    except Exception as e:  # noqa: BLE001 (one backend's failure is a result)
                        emit(dict(rec, error=_error(e)))
                        continue
                    dense_ms = rec["median_ms"] if b == "dense_xla" else dense_ms
                    rec["tflops"] = rec["useful_flops"] / (rec["median_ms"] * 1e-3) / 1e12
                    if dense_ms is not None:
                        rec["dense_xla_ms"] = dense_ms
                        rec["fraction_of_dense"] = dense_ms / rec["median_ms"]
                    emit(rec)
            peer = gpu_timing.torch_peer(sizes, s.m, s.k, s.n, **timing)
            for name, r in peer.items():
                backend, mode = name.split("/")
                emit(dict(base, mode=mode, backend=backend, useful_flops=plan.flops(s, mode),
                          **r))
        del x, w, dy, fns


def moe_section(emit: Emitter, spec: dict) -> None:
    """The MoE layer (gmm_backend auto) against a dense SwiGLU over the same rows, bf16, fwd
    and fwd+bwd (`bench moe`'s cases); one case's failure is recorded and the next runs."""
    from dropless.bench import moe as bench_moe
    shape = spec["moe_shape"]
    for e, k, routing in spec["moe_cases"]:
        t = math.ceil(shape["rows"] / k)
        try:
            fault(spec, f"moe:{e}:{k}")
            recs = bench_moe._case(t, shape["d_model"], shape["d_ff"], e, k, routing,
                                   "bfloat16", ["auto"], [], shape["repeats"],
                                   budget_s=60.0, fused=False)
        except Exception as ex:  # noqa: BLE001 (recorded; the next case runs)
            emit({"experts": e, "top_k": k, "routing": routing, "error": _error(ex)})
            continue
        for r in recs:
            emit(r)


def train_section(emit: Emitter, spec: dict) -> None:
    """`dropless train --preset deepseek3-test` for a few steps: a JSON line per step as it
    completes, then the run's medians (step time, TFLOPS, MFU) and peak device memory."""
    import jax
    import numpy as np

    from dropless.config_file import build_config
    from dropless.ops import resolve_backend
    from dropless.train.loop import train
    from dropless.train.progress import Progress
    from dropless.runtime.xla_flags import apply_recipe
    out_dir = Path(spec["out_dir"]) / "train_run"
    items = [("preset", "deepseek3-test"), ("steps", spec["train_steps"]),
             ("run_dir", str(out_dir)), ("run_name", "train"), ("checkpoint_every", 0),
             ("eval_every", 10**6)]
    if spec["dry_run"]:  # a small corpus, one dense + one MoE layer: the loop, not the model
        corpus = out_dir / "corpus.txt"
        corpus.parent.mkdir(parents=True, exist_ok=True)
        corpus.write_text("def add(a, b):\n    return a + b\n\n" * 200)
        items += [("per_device_batch_size", 1), ("seq_len", 16), ("model.num_layers", 2),
                  ("model.mtp_depth", 0), ("data", str(corpus)), ("eval_fraction", 0.1)]
    cfg = build_config(items)
    apply_recipe(cfg.xla_recipe)

    class Steps(Progress):
        def step(self, n, *, loss, tokens_per_s, text):
            emit({"event": "step", "step": n, "loss": loss, "tokens_per_s": tokens_per_s})

    result = train(cfg, progress=Steps(print, bar=False))
    steps = [json.loads(ln) for ln in (Path(result.run_dir) / "metrics.jsonl").open()
             if '"event": "step"' in ln]
    later = steps[1:] or steps   # the first step's time includes its dispatch after compile

    def med(key):
        vals = [r[key] for r in later if r.get(key) is not None]
        return float(np.median(vals)) if vals else None

    stats = jax.devices()[0].memory_stats() or {}
    emit({"event": "summary", "preset": "deepseek3-test", "steps": len(steps),
          "gmm_backend": cfg.model.moe.gmm_backend, "resolved": resolve_backend("auto"),
          "median_step_time_s": med("step_time_s"), "median_tflops_per_device":
          med("tflops_per_device"), "median_mfu": med("mfu"),
          "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
          "device": jax.devices()[0].device_kind,
          "final_loss": later[-1].get("loss") if later else None})


SECTION_FNS = {"info": info_section, "gmm": gmm_section, "moe": moe_section,
               "train": train_section}


def main(argv: list[str]) -> None:
    """Run the section SPEC_JSON (`argv[0]`) names (see the module docstring); exceptions
    propagate, so the process exits 1 with the trace (the runner records the exit status and the
    last lines of output)."""
    spec = json.loads(argv[0])
    fault(spec, spec["section"])
    emit = Emitter(spec["results"], spec["section"], spec["t0"], spec["dry_run"])
    SECTION_FNS[spec["section"]](emit, spec)


if __name__ == "__main__":
    main(sys.argv[1:])
