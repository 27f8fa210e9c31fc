"""The sections of `dropless bench gpu`, each run in its own process by the runner (bench/gpu.py).

Legend: M routed rows, K contraction dim, N output dim, G groups (experts).

`python -m dropless.bench.gpu_sections SPEC_JSON` runs one section: info, gmm and moe (with
its per-kernel profile) are here, autotune in bench/gpu_autotune.py, train in bench/gpu_train.py,
maxtext in bench/gpu_maxtext.py, what they share in bench/gpu_common.py. Every measurement is
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
import sys
import time
from pathlib import Path

from dropless.bench import gpu_plan as plan
from dropless.bench.gpu_autotune import autotune_section
from dropless.bench.gpu_common import compiled as _compiled
from dropless.bench.gpu_common import error as _error
from dropless.bench.gpu_common import fault
from dropless.bench.gpu_common import gmm_fn as _gmm_fn
from dropless.bench.gpu_common import late as _late
from dropless.bench.gpu_common import no_compile as _no_compile
from dropless.bench.gpu_common import operands as _operands
from dropless.bench.gpu_common import ran as _ran
from dropless.bench.gpu_maxtext import maxtext_section
from dropless.bench.gpu_train import train_section
from dropless.ops.gmm import shapes as gmm_shapes
from dropless.ops.gmm.shapes import GmmShape


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
    keys = ("shape", "model", "aligned", "routing", "mode", "modes", "backend", "ran",
            "median_ms", "tflops", "fraction_of_dense", "variant", "ratio_to_dense", "step", "loss",
            "median_step_time_s", "median_tflops_per_device", "median_mfu", "peak_bytes_in_use",
            "skipped", "error", "ran_because")
    return "  ".join(f"{k}={_fmt(rec[k])}" for k in keys if k in rec)


def _fmt(v):
    return f"{v:.4g}" if isinstance(v, float) else v


def _attention_info() -> dict:
    """What the one-GPU preset's attention runs as here (`auto` at its run settings, packed
    rows) and, where cuDNN's flash attention cannot run through jax's public call
    (`cudnn`) or through its own binding (`cudnn_thd`), why not."""
    import jax

    from dropless.config_file import build_config
    from dropless.ops.gpu import cudnn_attention, cudnn_thd
    from dropless.train.step import attention_kernel
    cfg = build_config([("preset", "deepseek3-1gpu")])
    m, s = cfg.model, cfg.seq_len
    shape = (1, s, m.num_heads, m.qk_head_dim)
    q = jax.ShapeDtypeStruct(shape, m.dtype)
    v = jax.ShapeDtypeStruct(shape[:3] + (m.v_dim,), m.dtype)
    return {"attention_kernel_1gpu": attention_kernel(cfg),
            "cudnn_attention_problem": cudnn_attention.problem(q, q, v, True),
            "cudnn_thd_problem": cudnn_thd.problem(q, q, v, True, m.max_segments_per_seq)}


def info_section(emit: Emitter, spec: dict) -> None:
    """Versions (jax, jaxlib, torch, triton, tokamax), the device and its kind, cuDNN and
    cuBLAS as jax loaded them and cuDNN as torch did, the grouped-matmul backends usable here
    (and why each other is not), what `auto` resolves to, and the attention the one-GPU preset
    runs (and why not cuDNN's where it is not)."""
    import subprocess

    import jax

    from dropless import machine
    from dropless.bench import gpu_timing
    from dropless.ops import resolve_backend
    from dropless.ops.gmm import registry
    rec = {**machine.machine_info(), **gpu_timing.torch_info(), **cuda_versions()}
    rec["device_kind"] = jax.devices()[0].device_kind
    for mod in ("triton", "tokamax"):
        try:
            rec[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 (absent or broken: recorded as None)
            rec[mod] = None
    names = [b for b in registry.grouped_matmul_backends() if b != "auto"]
    rec["gmm_unusable"] = {b: why for b in names if (why := registry.unusable(b))}
    rec["gmm_usable"] = [b for b in names if b not in rec["gmm_unusable"]]
    rec["gmm_measured"] = plan.measured_backends(rec["gmm_usable"])
    rec["auto_on_this_platform"] = resolve_backend("auto")
    rec.update(_attention_info())
    try:
        rec["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,clocks.max.sm,driver_version",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        rec["nvidia_smi"] = None
    emit(rec, f"{rec['device_kind']}: jax {rec.get('jax')}, cuDNN {rec['cudnn_jax']} (torch's "
              f"{rec['cudnn_torch']}), torch {rec['torch']}, tokamax {rec['tokamax']}, "
              f"measured {rec['gmm_measured']}, auto -> {rec['auto_on_this_platform']}, "
              f"attention -> {rec['attention_kernel_1gpu']}")


def cuda_versions() -> dict:
    """cuDNN and cuBLAS as jax's CUDA plugin loaded them (runtime and build versions, the int
    CUDA libraries report: 92200 is 9.22.0) and cuDNN as torch loaded it; None where absent (a
    CPU-only jax, no torch)."""
    out: dict = {"cudnn_jax": None, "cudnn_jax_build": None, "cublas_jax": None,
                 "cudnn_torch": None, "jax_cuda_plugin": jax_cuda_plugin()}
    try:
        from jax._src.lib import cuda_versions as cv   # the plugin's _versions, or None
        if cv is not None:
            out.update(cudnn_jax=cv.cudnn_get_version(), cudnn_jax_build=cv.cudnn_build_version(),
                       cublas_jax=cv.cublas_get_version())
    except Exception as e:  # noqa: BLE001 (recorded: a version that cannot be read)
        out["cuda_versions_error"] = _error(e)
    try:
        import torch
        out["cudnn_torch"] = torch.backends.cudnn.version()
    except Exception:  # noqa: BLE001 (no torch, or no cuDNN in it: None)
        pass
    return out


def jax_cuda_plugin() -> str | None:
    """The jax CUDA plugin distributions installed here ("jax-cuda13-plugin 0.11.2", and
    the others found, comma-separated), None without one: which CUDA build jax runs, and so
    which build the compile-only tests (`train/compile_only.py`) should match."""
    from importlib import metadata
    found = []
    for name in ("jax-cuda13-plugin", "jax-cuda12-plugin"):
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    return ", ".join(found) or None


def _unit_late(spec: dict, u: dict) -> str | None:
    """Why gmm unit `u` is not started now (None: it is): its estimate, times the plan's margin
    for a unit the plan dropped to fit the cap, no longer fits before the section's deadline."""
    why = _late(spec, u["seconds"] * spec["est"] * (plan.MARGIN if u.get("extra") else 1))
    return f"{u['skipped']}; at run time {why}" if why and u.get("extra") else why


def gmm_section(emit: Emitter, spec: dict) -> None:
    """The plan's gmm units, shape by shape in the plan's order: each backend usable here
    against XLA's dense matmul of equal useful FLOPs at the shape (same run), and the torch
    peer; per unit's part (plan.PARTS) fwd and fwd+bwd, dlhs and drhs alone, or fwd and fwd+bwd
    on aligned segments; every routing. The units the plan dropped to fit the cap follow in
    their order, each run only if its estimate, with the plan's margin, still fits before the
    cap (the estimates are the slowest seen, so time is often left). A unit dropped for its own
    reason, one whose backend cannot run here, or one the deadline does not allow is a
    "skipped" record with the reason; one measurement's failure is an "error" record."""
    from dropless.ops.gmm import registry

    def key(u):
        return u["shape"], u["backend"], u.get("part", "modes")
    units = {key(u): u for u in spec["gmm_units"]}
    for u in spec["gmm_dropped"]:
        if u["skipped"].startswith("dropped to fit"):
            units[key(u)] = dict(u, extra=True)
        else:
            part = u.get("part", "modes")
            emit({"shape": u["shape"], "backend": u["backend"], **_part(part),
                  "modes": list(plan.PARTS[part]), "skipped": u["skipped"]})
    for s in plan.shape_order(GmmShape(**d) for d in spec["shapes"]):
        mine = [(b, part) for (label, b, part) in units if label == s.label]
        if not mine:
            continue
        why = _unit_late(spec, units[(s.label, *mine[0])])
        if why:
            emit({"shape": s.label, "skipped": why})
            continue
        runs = []
        for b, part in mine:
            why = None if b == "torch" else registry.unusable(b)
            if why:
                emit({"shape": s.label, "backend": b, **_part(part),
                      "modes": list(plan.PARTS[part]), "skipped": f"not usable here: {why}"})
            elif b != "torch":
                runs.append((b, part))
        try:
            x, w, dy = _operands(s)
        except Exception as e:  # noqa: BLE001 (e.g. out of memory: the next shape runs)
            emit({"shape": s.label, "error": f"operands: {_error(e)}"})
            continue
        # the dense baseline of each part the shape runs (aligned: the modes' dense)
        parts = {"modes" if part == "aligned" else part for _, part in runs}
        dense = [("dense_xla", p) for p in ("modes", "dirs") if p in parts]
        _gmm_shape(emit, spec, s, dense + runs, ("torch", "modes") in mine, (x, w, dy), units)
        del x, w, dy


def _part(part: str) -> dict:
    """The record fields of a unit's part: aligned segments say so (and their alignment)."""
    return {"aligned": True, "group_alignment": plan.ALIGN_ROWS} if part == "aligned" else {}


def _gmm_shape(emit: Emitter, spec: dict, s: GmmShape, runs: list[tuple[str, str]],
               torch: bool, ops: tuple, units: dict) -> None:
    """One shape's measurements: each (backend, part) of `runs` compiled once per mode of its
    part (through the fallback, so the record says what ran), timed per routing, then the
    torch peer. Aligned parts run on operands of the aligned layout's rows (plan.aligned_m;
    random rows, padding included: a kernel's time does not depend on the values), each
    group's rows rounded up to plan.ALIGN_ROWS; their records keep the unaligned rows' useful
    FLOPs and are divided by the same dense time."""
    import jax.numpy as jnp

    from dropless.bench import gpu_timing
    from dropless.bench.gpu_common import aligned_sizes
    timing = spec["timing"]
    x, w, dy = ops
    fns: dict = {}
    sizes_of = {r: gmm_shapes.group_sizes(r, s.m, s.g) for r in spec["routings"]}
    dims = {"shape": s.label, "model": s.model, "m": s.m, "k": s.k, "n": s.n, "groups": s.g,
            "dtype": "bfloat16"}
    rows_al = plan.aligned_m(s)
    al_ops = None
    for b, part in runs:
        if b != "dense_xla":
            why = _unit_late(spec, units[(s.label, b, part)])
            if why:
                emit({"shape": s.label, "backend": b, **_part(part),
                      "modes": list(plan.PARTS[part]), "skipped": why})
                continue
        if part == "aligned" and al_ops is None:
            try:
                xa, _, dya = _operands(s, rows_al)
                al_ops = (xa, dya)
            except Exception as e:  # noqa: BLE001 (e.g. out of memory: recorded)
                emit(dict(dims, backend=b, **_part(part), error=f"operands: {_error(e)}"))
                continue
        for mode in plan.PARTS[part]:
            wb = w[0] if b == "dense_xla" else w
            r0 = spec["routings"][0]
            if part == "aligned":
                gs0 = jnp.asarray(aligned_sizes(sizes_of[r0], plan.ALIGN_ROWS))
                args = (al_ops[0], wb, gs0, al_ops[1])
                fn = _gmm_fn(b, mode, plan.ALIGN_ROWS)
            else:
                args = (x, wb, jnp.asarray(sizes_of[r0], jnp.int32), dy)
                fn = _gmm_fn(b, mode)
            base = dict(dims, mode=mode, backend=b, **_part(part),
                        useful_flops=plan.flops(s, mode))
            try:
                fault(spec, f"gmm:{b}")
                fns[(b, part, mode)] = _compiled(fn, args, f"gmm {s.label} {b} {part} {mode}")
            except Exception as e:  # noqa: BLE001 (one backend's failure is a result)
                for routing in spec["routings"]:
                    emit(dict(base, routing=routing, error=_error(e)))
                continue
    modes = [m for m in plan.MODES + plan.DIRECTION_MODES
             if any(k[2] == m for k in fns)]
    for routing in spec["routings"]:
        sizes = sizes_of[routing]
        gs = jnp.asarray(sizes, jnp.int32)
        gs_al = jnp.asarray(aligned_sizes(sizes, plan.ALIGN_ROWS))
        base = dict(dims, routing=routing, max_group=int(sizes.max()),
                    empty_groups=int((sizes == 0).sum()))
        for mode in modes:
            dense_ms = None
            for b, part in runs:
                if (b, part, mode) not in fns:
                    continue
                fn, gmm, compile_ms = fns[(b, part, mode)]
                extra = _part(part)
                if part == "aligned":
                    extra["aligned_rows"] = rows_al
                rec = _ran(dict(base, mode=mode, backend=b, **extra,
                                useful_flops=plan.flops(s, mode), compile_ms=compile_ms),
                           "dense" if b == "dense_xla" else b, gmm)
                try:
                    wb = w[0] if b == "dense_xla" else w
                    args = ((al_ops[0], wb, gs_al, al_ops[1]) if part == "aligned"
                            else (x, wb, gs, dy))
                    stats = gpu_timing.time_jax(lambda: fn(*args), **timing)
                except Exception as e:  # noqa: BLE001 (one backend's failure is a result)
                    emit(dict(rec, error=_error(e)))
                    continue
                rec.update(_no_compile(stats))
                dense_ms = rec["median_ms"] if b == "dense_xla" else dense_ms
                rec["tflops"] = rec["useful_flops"] / (rec["median_ms"] * 1e-3) / 1e12
                if dense_ms is not None:
                    rec["dense_xla_ms"] = dense_ms
                    rec["fraction_of_dense"] = dense_ms / rec["median_ms"]
                emit(rec)
        why = _unit_late(spec, units[(s.label, "torch", "modes")]) if torch else None
        if why:
            emit(dict(base, backend="torch", skipped=why))
        elif torch:
            try:
                peer = gpu_timing.torch_peer(sizes, s.m, s.k, s.n, **timing)
            except Exception as e:  # noqa: BLE001 (the peer's setup failed: recorded)
                peer = {f"torch/{m}": {"error": _error(e)} for m in plan.MODES}
            for name, r in peer.items():
                backend, mode = name.split("/")
                emit(dict(base, mode=mode, backend=backend, useful_flops=plan.flops(s, mode),
                          **({"ran": backend} if "median_ms" in r else {}), **r))


def _moe_case(case: dict, option: dict):
    """(MoEConfig, params, x_TD, dy_TD, x_ND, dy_ND, dense weights) of one moe case (a
    plan.moe_case dict), with `option` ({field: value}, the aligned-segments option or none)."""
    import jax
    import jax.numpy as jnp

    from dropless import moe
    from dropless.bench.moe import _router_bias
    from dropless.config import MoEConfig
    e, k, t, d = case["experts"], case["top_k"], case["tokens"], case["d_model"]
    cfg = MoEConfig(num_experts=e, top_k=k, d_model=d, d_ff=case["d_ff"], dtype="bfloat16",
                    weight_dtype="bfloat16", score_func="softmax", **option)
    params = moe.init_params(jax.random.key(e), cfg)
    params["router"]["bias_E"] = jnp.asarray(_router_bias(case["routing"], e, e)) * 0.1
    keys = jax.random.split(jax.random.key(1), 4)
    x, dy = (jax.random.normal(kk, (t, d), jnp.bfloat16) for kk in keys[:2])
    xd, dyd = (jax.random.normal(kk, (t * k, d), jnp.bfloat16) for kk in keys[2:])
    ex = params["experts"]
    wd = (ex["w_gate_EDF"][0], ex["w_up_EDF"][0], ex["w_down_EFD"][0])
    return cfg, params, x, dy, xd, dyd, wd


def _case_rec(case: dict, mode: str, aligned: bool, spec: dict) -> dict:
    out = {"model": case["model"], "experts": case["experts"], "top_k": case["top_k"],
           "routing": case["routing"], "mode": mode, "dtype": "bfloat16"}
    if spec["align_option"]:
        out["aligned"] = aligned
    return out


def moe_section(emit: Emitter, spec: dict) -> None:
    """The plan's moe units (case, mode, aligned): the MoE layer (gmm_backend auto, bf16)
    against a dense SwiGLU over the same rows, each compiled through the fallback and timed
    back to back; one record per measurement (dense, then the layer with the backend that ran;
    the layer is dropless, so no rows are dropped); "aligned" units set MoEConfig's
    aligned-segments option. A "profile" unit traces calls of its case's fwd+bwd layer
    (compiled by an earlier unit) and writes the per-kernel table (`_profile`). A unit dropped
    by the plan or the deadline is a "skipped" record."""
    from dropless import moe
    from dropless.bench import dense, gpu_timing
    cases = spec["moe_cases"]
    for u in spec["moe_dropped"]:
        emit(dict(_case_rec(cases[u["case"]], u["mode"], u["aligned"], spec),
                  skipped=u["skipped"]))
    made: dict = {}
    layers: dict = {}
    for u in spec["moe_units"]:
        case = cases[u["case"]]
        base = _case_rec(case, u["mode"], u["aligned"], spec)
        why = _late(spec, u["seconds"] * spec["est"])
        if why:
            emit(dict(base, skipped=why))
            continue
        if u["mode"] == "profile":
            _profile(emit, spec, base, layers.get(u["case"]))
            continue
        option = {}
        if u["aligned"]:
            field, value = spec["align_option"]
            option = {field: value}
        key = (u["case"], u["aligned"])
        try:
            fault(spec, f"moe:{case['experts']}:{case['top_k']}")
            if key not in made:
                made[key] = _moe_case(case, option)
            cfg, params, x, dy, xd, dyd, wd = made[key]
            dense_fns = dense.fwd_and_fwd_bwd(dense.swiglu)
            layer_fns = dense.fwd_and_fwd_bwd(lambda p, x: moe.apply(p, x, cfg)[0])
            i = 0 if u["mode"] == "fwd" else 1
            d_args = (xd, *wd) + ((dyd,) if i else ())
            l_args = (params, x) + ((dy,) if i else ())
            dense_c, _, dense_ms = _compiled(dense_fns[i], d_args, "dense swiglu", probe=False)
            layer_c, gmm, layer_ms = _compiled(layer_fns[i], l_args,
                                               f"moe layer {case['model']}", run_once=True)
        except Exception as ex:  # noqa: BLE001 (recorded; the next unit runs)
            emit(dict(base, error=_error(ex)))
            continue
        if i and not u["aligned"]:
            layers[u["case"]] = (lambda c=layer_c, a=l_args: c(*a), gmm)
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


def _profile(emit: Emitter, spec: dict, base: dict, layer) -> None:
    """Trace `profile_calls` calls of a compiled MoE layer fwd+bwd (`layer`: (call, its
    fallback record)) with jax.profiler and write the per-kernel table, runtime.kernel_table's
    reading of the trace in train/profile.py's records (per call: "us_per_step"), to
    BENCH_DIR/moe_kernels.jsonl; one record with the groups' shares and the file's name."""
    import jax

    from dropless.runtime import kernel_table
    from dropless.train import profile as train_profile
    if layer is None:
        emit(dict(base, skipped="no compiled fwd+bwd layer of this case to trace (its unit "
                                "failed or was not run)"))
        return
    call, gmm = layer
    trace_dir = Path(spec["bench_dir"]) / "moe_trace"
    try:
        jax.block_until_ready(call())           # warm: the trace holds only steady calls
        with jax.profiler.trace(str(trace_dir)):
            for _ in range(spec["profile_calls"]):
                jax.block_until_ready(call())
        rows = kernel_table.kernel_table(trace_dir)
        recs = train_profile.table_records(rows, steps=spec["profile_calls"])
    except Exception as ex:  # noqa: BLE001 (recorded; the section goes on)
        emit(dict(base, error=_error(ex)))
        return
    path = Path(spec["bench_dir"]) / "moe_kernels.jsonl"
    head = dict(base, event="profile_header", device=jax.devices()[0].device_kind,
                calls=spec["profile_calls"], **{k: gmm[k] for k in ("gmm_backend_ran",)})
    from dropless.runtime import files
    files.write_text(path, "".join(json.dumps(r, sort_keys=True, default=str) + "\n"
                                   for r in [head, *recs]))
    groups = {r["group"]: round(r["share"], 4) for r in recs if r["event"] == "group"}
    emit(dict(base, kernels=len(rows), table=path.name, group_share=groups),
         f"{len(rows)} kernels -> {path.name}: " + ", ".join(
             f"{g} {100 * v:.1f}%" for g, v in groups.items() if v))


SECTION_FNS = {"info": info_section, "gmm": gmm_section, "moe": moe_section,
               "autotune": autotune_section, "train": train_section,
               "maxtext": maxtext_section}


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
