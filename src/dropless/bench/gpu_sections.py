"""The sections of `dropless bench gpu`, each run in its own process by the runner (bench/gpu.py).

Legend: M routed rows, K contraction dim, N output dim, G groups (experts).

`python -m dropless.bench.gpu_sections SPEC_JSON` runs one section. Every measurement is
appended to the results file as one JSON line the moment it is taken, with a progress line on
stdout beside it, so a section cut off at its cap keeps what it measured. Inside a section each
measurement is isolated too: a backend that fails to compile or run is recorded as an error and
the next one runs. Every grouped-matmul function is compiled through ops/gmm/fallback.py, so
a kernel `auto` chose that fails to compile or run falls back, and each record names the
backend that ran ("ran", and "ran_because" when it is not the one asked for). SPEC_JSON
carries the plan's units and the section's deadline (units that no longer fit are recorded as
skipped), and "fault" ({"gmm": "raise" | "hang" | "exit", "gmm:pallas_gpu": "raise",
"moe:tokamax": "compile" | "run", ...}) so the dry run can show that isolation, and the
fallback from a stand-in tokamax, on CPU.
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
    keys = ("shape", "routing", "mode", "backend", "ran", "median_ms", "tflops",
            "fraction_of_dense", "variant", "ratio_to_dense", "step", "loss", "median_step_time_s",
            "median_tflops_per_device", "median_mfu", "peak_bytes_in_use", "skipped", "error",
            "ran_because")
    return "  ".join(f"{k}={_fmt(rec[k])}" for k in keys if k in rec)


def _fmt(v):
    return f"{v:.4g}" if isinstance(v, float) else v


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[:300]}"


def fault(spec: dict, key: str) -> None:
    """Do the fault the spec injects at `key` (none: nothing)."""
    kind = spec.get("fault", {}).get(key)
    if kind in ("compile", "run"):     # a stand-in kernel's failure (`_stand_in`), not here
        return
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


def _gmm_fn(backend: str, mode: str):
    """The function timed for (backend, mode), signature (x_MK, w, sizes_G, dy_MN); w is w_GKN,
    or for dense_xla one group's w_KN (one bf16 cuBLAS matmul of the same FLOPs; sizes_G
    unused). Group sizes are an argument, so one compile serves every routing."""
    import jax

    from dropless.ops import grouped_matmul
    if backend == "dense_xla":
        def f(a, b, s):
            return a @ b
    else:
        def f(a, b, s):
            return grouped_matmul(a, b, s, backend=backend)
    if mode == "fwd":
        return lambda a, b, s, d: f(a, b, s)
    return lambda a, b, s, d: jax.vjp(lambda p, q: f(p, q, s), a, b)[1](d)


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


def _compiled(fn, args, what: str, **kw) -> tuple:
    """(compiled fn, the fallback Outcome's record, compile ms) via ops/gmm/fallback.py."""
    from dropless.ops.gmm.fallback import compile_auto
    t = time.perf_counter()
    compiled, outcome = compile_auto(fn, *args, what=what, **kw)
    return compiled, outcome.record(), (time.perf_counter() - t) * 1e3


def _ran(rec: dict, asked: str, gmm: dict) -> dict:
    """`rec` with the backend that ran ("ran") and, when it is not the one asked for, why."""
    ran = gmm["gmm_backend_ran"] or asked
    out = dict(rec, ran=ran, gmm_fallbacks=gmm["gmm_fallbacks"])
    why = [r["reason"] for r in gmm["gmm_ran"] if r.get("reason")]
    why += [f"{f['from']} failed to {f['stage']}: {f['reason']}" for f in gmm["gmm_fallbacks"]]
    why = list(dict.fromkeys(why))
    if ran != asked and asked != "auto" or why:
        out["ran_because"] = "; ".join(why)[:600] or f"auto on this platform is {ran}"
    return out


def _late(spec: dict, est_s: float) -> str | None:
    """Why a unit estimated at est_s seconds is not started (None: it fits the deadline)."""
    left = spec["deadline_t"] - time.time()
    if left < est_s:
        return (f"{max(left, 0):.0f} s left before the section's cap, the unit is estimated at "
                f"{est_s:.0f} s")
    return None


def gmm_section(emit: Emitter, spec: dict) -> None:
    """The plan's gmm units in table order (shapes, then backends), each against XLA's dense
    matmul of equal FLOPs at its shape (same run), and the torch peer; fwd and fwd+bwd, every
    routing. A unit the plan dropped, or one the deadline no longer allows, is a "skipped"
    record with the reason; one measurement's failure is an "error" record, not raised."""
    from dropless.ops.gmm import registry
    units = {(u["shape"], u["backend"]): u for u in spec["gmm_units"]}
    for u in spec["gmm_dropped"]:
        emit({"shape": u["shape"], "backend": u["backend"], "skipped": u["skipped"]})
    for s in (plan.Shape(*row[:5], tuple(row[5])) for row in spec["shapes"]):
        tokamax = registry.unusable("tokamax") is None   # installed, or a stand-in
        mine = [b for b in plan.backends_at(s, tokamax) + ["torch"] if (s.label, b) in units]
        if not mine:
            continue
        why = _late(spec, sum(units[(s.label, b)]["seconds"] for b in mine[:1]) * spec["est"])
        if why:
            emit({"shape": s.label, "skipped": why})
            continue
        try:
            x, w, dy = _operands(s)
        except Exception as e:  # noqa: BLE001 (e.g. out of memory: the next shape runs)
            emit({"shape": s.label, "error": f"operands: {_error(e)}"})
            continue
        backends = ["dense_xla"] + [b for b in mine if b != "torch"]
        _gmm_shape(emit, spec, s, backends, "torch" in mine, (x, w, dy), units)
        del x, w, dy


def _gmm_shape(emit: Emitter, spec: dict, s: plan.Shape, backends: list[str], torch: bool,
               ops: tuple, units: dict) -> None:
    """One shape's measurements: each backend compiled once per mode (through the fallback, so
    the record says what ran), timed per routing, then the torch peer."""
    import jax.numpy as jnp

    from dropless.bench import gpu_timing
    from dropless.bench.gmm import group_sizes_for
    timing = spec["timing"]
    x, w, dy = ops
    fns: dict = {}
    sizes_of = {r: group_sizes_for(r, s.m, s.g, seed=s.g) for r in spec["routings"]}
    for b in backends:
        if b != "dense_xla":
            why = _late(spec, units[(s.label, b)]["seconds"] * spec["est"])
            if why:
                emit({"shape": s.label, "backend": b, "skipped": why})
                continue
        for mode in plan.MODES:
            wb = w[0] if b == "dense_xla" else w
            gs0 = jnp.asarray(sizes_of[spec["routings"][0]], jnp.int32)
            base = {"shape": s.label, "m": s.m, "k": s.k, "n": s.n, "groups": s.g,
                    "dtype": "bfloat16", "mode": mode, "backend": b,
                    "useful_flops": plan.flops(s, mode)}
            try:
                fault(spec, f"gmm:{b}")
                fns[(b, mode)] = _compiled(_gmm_fn(b, mode), (x, wb, gs0, dy),
                                           f"gmm {s.label} {b} {mode}")
            except Exception as e:  # noqa: BLE001 (one backend's failure is a result)
                for routing in spec["routings"]:
                    emit(dict(base, routing=routing, error=_error(e)))
                continue
    for routing in spec["routings"]:
        sizes = sizes_of[routing]
        gs = jnp.asarray(sizes, jnp.int32)
        base = {"shape": s.label, "m": s.m, "k": s.k, "n": s.n, "groups": s.g,
                "routing": routing, "dtype": "bfloat16", "max_group": int(sizes.max()),
                "empty_groups": int((sizes == 0).sum())}
        for mode in plan.MODES:
            dense_ms = None
            for b in backends:
                if (b, mode) not in fns:
                    continue
                fn, gmm, compile_ms = fns[(b, mode)]
                rec = _ran(dict(base, mode=mode, backend=b, useful_flops=plan.flops(s, mode),
                                compile_ms=compile_ms), "dense" if b == "dense_xla" else b, gmm)
                try:
                    wb = w[0] if b == "dense_xla" else w
                    stats = gpu_timing.time_jax(lambda: fn(x, wb, gs, dy), **timing)
                except Exception as e:  # noqa: BLE001 (one backend's failure is a result)
                    emit(dict(rec, error=_error(e)))
                    continue
                rec.update({k: v for k, v in stats.items() if k != "compile_ms"})
                dense_ms = rec["median_ms"] if b == "dense_xla" else dense_ms
                rec["tflops"] = rec["useful_flops"] / (rec["median_ms"] * 1e-3) / 1e12
                if dense_ms is not None:
                    rec["dense_xla_ms"] = dense_ms
                    rec["fraction_of_dense"] = dense_ms / rec["median_ms"]
                emit(rec)
        if torch:
            try:
                peer = gpu_timing.torch_peer(sizes, s.m, s.k, s.n, **timing)
            except Exception as e:  # noqa: BLE001 (the peer's setup failed: recorded)
                peer = {f"torch/{m}": {"error": _error(e)} for m in plan.MODES}
            for name, r in peer.items():
                backend, mode = name.split("/")
                emit(dict(base, mode=mode, backend=backend, useful_flops=plan.flops(s, mode),
                          **({"ran": backend} if "median_ms" in r else {}), **r))


def _moe_case(e: int, k: int, routing: str, shape: dict):
    """(MoEConfig, params, x_TD, dy_TD, x_ND, dy_ND, dense weights) of one `bench moe` case."""
    import jax
    import jax.numpy as jnp

    from dropless import moe
    from dropless.bench.moe import _router_bias
    from dropless.config import MoEConfig
    t, d, f = math.ceil(shape["rows"] / k), shape["d_model"], shape["d_ff"]
    cfg = MoEConfig(num_experts=e, top_k=k, d_model=d, d_ff=f, dtype="bfloat16",
                    weight_dtype="bfloat16", score_func="softmax")
    params = moe.init_params(jax.random.key(e), cfg)
    params["router"]["bias_E"] = jnp.asarray(_router_bias(routing, e, e)) * 0.1
    keys = jax.random.split(jax.random.key(1), 4)
    x, dy = (jax.random.normal(kk, (t, d), jnp.bfloat16) for kk in keys[:2])
    xd, dyd = (jax.random.normal(kk, (t * k, d), jnp.bfloat16) for kk in keys[2:])
    ex = params["experts"]
    wd = (ex["w_gate_EDF"][0], ex["w_up_EDF"][0], ex["w_down_EFD"][0])
    return cfg, params, x, dy, xd, dyd, wd


def moe_section(emit: Emitter, spec: dict) -> None:
    """The plan's moe units (case, mode): the MoE layer (gmm_backend auto, bf16) against a
    dense SwiGLU over the same rows, each compiled through the fallback and timed back to back;
    one record per measurement (dense, then the layer with the backend that ran; the layer is
    dropless, so no rows are dropped); a unit dropped by the plan or the deadline is a
    "skipped" record."""
    from dropless import moe
    from dropless.bench import dense, gpu_timing
    cases = spec["moe_cases"]
    for u in spec["moe_dropped"]:
        e, k, routing = cases[u["case"]]
        emit({"experts": e, "top_k": k, "routing": routing, "mode": u["mode"],
              "skipped": u["skipped"]})
    made: dict = {}
    for u in spec["moe_units"]:
        e, k, routing = cases[u["case"]]
        base = {"experts": e, "top_k": k, "routing": routing, "mode": u["mode"],
                "dtype": "bfloat16"}
        why = _late(spec, u["seconds"] * spec["est"])
        if why:
            emit(dict(base, skipped=why))
            continue
        try:
            fault(spec, f"moe:{e}:{k}")
            if u["case"] not in made:
                made[u["case"]] = _moe_case(e, k, routing, spec["moe_shape"])
            cfg, params, x, dy, xd, dyd, wd = made[u["case"]]
            dense_fns = dense.fwd_and_fwd_bwd(dense.swiglu)
            layer_fns = dense.fwd_and_fwd_bwd(lambda p, x: moe.apply(p, x, cfg)[0])
            i = 0 if u["mode"] == "fwd" else 1
            d_args = (xd, *wd) + ((dyd,) if i else ())
            l_args = (params, x) + ((dy,) if i else ())
            dense_c, _, dense_ms = _compiled(dense_fns[i], d_args, "dense swiglu", probe=False)
            layer_c, gmm, layer_ms = _compiled(layer_fns[i], l_args, f"moe layer E{e} K{k}",
                                               run_once=True)
        except Exception as ex:  # noqa: BLE001 (recorded; the next unit runs)
            emit(dict(base, error=_error(ex)))
            continue
        rows = {"tokens": x.shape[0], "routed_rows": xd.shape[0], "d_model": cfg.d_model,
                "d_ff": cfg.d_ff}
        try:
            d = gpu_timing.time_jax(lambda: dense_c(*d_args), **spec["timing"])
            emit(dict(base, **rows, variant="dense", compile_ms=dense_ms, **_no_compile(d)))
            lt = gpu_timing.time_jax(lambda: layer_c(*l_args), **spec["timing"])
            rec = _ran(dict(base, **rows, variant="dropless/auto", compile_ms=layer_ms,
                            **_no_compile(lt), dense_ms=d["median_ms"],
                            ratio_to_dense=lt["median_ms"] / d["median_ms"]), "auto", gmm)
            emit(rec)
        except Exception as ex:  # noqa: BLE001
            emit(dict(base, error=_error(ex)))


def _no_compile(stats: dict) -> dict:
    return {k: v for k, v in stats.items() if k != "compile_ms"}


def train_section(emit: Emitter, spec: dict) -> None:
    """`dropless train --preset deepseek3-test` for a few steps: a JSON line per step as it
    completes, then the run's medians (step time, TFLOPS, MFU) and peak device memory."""
    import jax
    import numpy as np

    from dropless.config_file import build_config
    from dropless.train.loop import train
    from dropless.train.progress import Progress
    from dropless.runtime.xla_flags import apply_recipe
    out_dir = Path(spec["out_dir"]) / "train_run"
    items = [("preset", "deepseek3-test"), ("steps", spec["train_steps"]),
             ("run_dir", str(out_dir)), ("run_name", "train"), ("checkpoint_every", 0),
             ("eval_every", 10**6), ("time_kernels", False)]   # the moe section times kernels
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
    metrics = [json.loads(ln) for ln in (Path(result.run_dir) / "metrics.jsonl").open()]
    steps = [r for r in metrics if r.get("event") == "step"]
    start = next((r for r in metrics if r.get("event") == "start"), {})
    later = steps[1:] or steps   # the first step's time includes its dispatch after compile

    def med(key):
        vals = [r[key] for r in later if r.get(key) is not None]
        return float(np.median(vals)) if vals else None

    stats = jax.devices()[0].memory_stats() or {}
    gmm = {"gmm_backend_ran": start.get("gmm_backend_ran"), "gmm_ran": start.get("gmm_ran") or [],
           "gmm_fallbacks": start.get("gmm_fallbacks") or []}
    rec = {"event": "summary", "preset": "deepseek3-test", "steps": len(steps),
           "gmm_backend": cfg.model.moe.gmm_backend, "median_step_time_s": med("step_time_s"),
           "median_tflops_per_device": med("tflops_per_device"), "median_mfu": med("mfu"),
           "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
           "device": jax.devices()[0].device_kind,
           "final_loss": later[-1].get("loss") if later else None}
    emit(_ran(rec, cfg.model.moe.gmm_backend, gmm))


SECTION_FNS = {"info": info_section, "gmm": gmm_section, "moe": moe_section,
               "train": train_section}


def _stand_in(spec: dict):
    """The stand-in tokamax the spec injects into this section ("SECTION:tokamax" -> "compile" |
    "run": a kernel that fails there, tried first by `auto`), or a null context."""
    import contextlib
    kind = spec.get("fault", {}).get(f"{spec['section']}:tokamax")
    if kind is None:
        return contextlib.nullcontext()
    from dropless.ops.gmm import registry, standins
    return registry.stand_in("tokamax", standins.failing_gmm(kind),
                             first_on=registry.current_platform(),
                             description=f"stand-in tokamax that fails to {kind}")


def main(argv: list[str]) -> None:
    """Run the section SPEC_JSON (`argv[0]`) names (see the module docstring); exceptions
    propagate, so the process exits 1 with the trace (the runner records the exit status and the
    last lines of output)."""
    spec = json.loads(argv[0])
    fault(spec, spec["section"])
    emit = Emitter(spec["results"], spec["section"], spec["t0"], spec["dry_run"])
    with _stand_in(spec):
        SECTION_FNS[spec["section"]](emit, spec)


if __name__ == "__main__":
    main(sys.argv[1:])
