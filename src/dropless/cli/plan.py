"""`dropless plan`: memory, FLOPs, bytes and step time for a model on a cluster, a scaling
sweep, a layout search, and the calibration of the model against this machine."""
from __future__ import annotations

import argparse
import math
import os

from dropless.config import GMM_QUANTIZATIONS, REMAT_POLICIES
from dropless.machine import PRECISIONS, PROFILES
from dropless.plan import report
from dropless.plan.from_train import MESH_KEYS, build_plan
from dropless.plan.layout import ATTENTION_IMPLS, MAX_DEVICES, MODELLED_DISPATCHERS, OVERLAPS
from dropless.plan.model import predict
from dropless.plan.sweep import SWEEP_AXES, suggest, sweep_gpus
from dropless.presets import PRESETS
from dropless.runtime import files
from dropless.train.compile_only import TARGETS as _TARGETS

COMPILE_TARGETS = tuple(sorted(_TARGETS))
# the most cluster sizes --sweep-gpus plans (a row each, one plan a row): a list of hundreds of
# thousands fits on a command line and would take an hour
MAX_SWEEP_SIZES = 1000

# flag dest -> the setting it gives: the trainer's key, or a planner knob (flags default to None
# so a config file can set them; they come after the file and before key=value).
_FLAG_KEYS = {"gpus": "gpus", "fsdp": MESH_KEYS["fsdp"], "ep": MESH_KEYS["ep"],
              "data": MESH_KEYS["data"], "per_device_batch": "per_device_batch_size",
              "seq": "seq_len", "remat": "remat",
              "gmm_quantization": "model.moe.gmm_quantization",
              "dispatcher": "model.moe.dispatcher",
              "ragged_buffer_factor": "model.moe.ragged_buffer_factor", "overlap": "overlap",
              "weight_dtype": "weight_dtype", "optimizer_dtype": "optimizer_dtype",
              "devices_per_node": "devices_per_node", "attention_impl": "attention_impl",
              "offload": "offload", "preset": "preset", "hardware": "hardware"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="the trainer's keys or MaxText's (per_device_batch_size=6, "
                        "ici_expert_parallelism=8, model.moe.top_k=4, num_experts=64 ...) "
                        "and the planner's own (gpus, overlap, offload, ...)")
    p.add_argument("--preset", default=None, help=f"model: {', '.join(PRESETS)} "
                   "(default deepseek3-671b)")
    p.add_argument("--hardware", default=None, help=f"profile: {', '.join(PROFILES)} "
                   "(default h200)")
    p.add_argument("--config", default=None, help="YAML file of KEY: VALUE settings")
    p.add_argument("--gpus", type=int, default=None, help="devices (default fsdp x ep x data)")
    p.add_argument("--fsdp", type=int, default=None)
    p.add_argument("--ep", type=int, default=None, help="expert parallelism")
    p.add_argument("--data", type=int, default=None, help="data-parallel replicas "
                   "(default gpus / (fsdp x ep))")
    p.add_argument("--per-device-batch", type=int, default=None)
    p.add_argument("--seq", type=int, default=None, help="sequence length")
    p.add_argument("--remat", choices=REMAT_POLICIES, default=None)
    p.add_argument("--offload", default=None, help="activations kept in host memory, comma "
                   "separated from query,key,value, or 'none' (default query,value with "
                   "--remat offload)")
    p.add_argument("--gmm-quantization", choices=GMM_QUANTIZATIONS, default=None)
    p.add_argument("--dispatcher", choices=MODELLED_DISPATCHERS, default=None)
    p.add_argument("--no-dedup", action="store_true", help="EP rows per (token, expert)")
    p.add_argument("--ragged-buffer-factor", type=float, default=None)
    p.add_argument("--overlap", choices=OVERLAPS, default=None)
    p.add_argument("--weight-dtype", default=None)
    p.add_argument("--optimizer-dtype", default=None)
    p.add_argument("--devices-per-node", type=int, default=None)
    p.add_argument("--attention-impl", choices=ATTENTION_IMPLS, default=None,
                   help="flash (default) or naive (S x S scores materialised)")
    p.add_argument("--sweep-gpus", default=None, help="comma-separated cluster sizes")
    p.add_argument("--sweep-axis", choices=SWEEP_AXES, default="data",
                   help="the axis that grows in the sweep")
    p.add_argument("--suggest", action="store_true",
                   help="rank the layouts that fit by predicted throughput")
    p.add_argument("--top", type=int, default=10, help="rows of --suggest")
    p.add_argument("--min-buffer-factor", type=float, default=1.5,
                   help="--suggest skips buffer factors below this (expected max/mean load)")
    p.add_argument("--calibrate", action="store_true",
                   help="measure this machine's profile, predict a `dropless train` step (or "
                        "an MoE layer) with it and time the real thing, on 1 and "
                        "--calibrate-devices host devices")
    p.add_argument("--calibrate-devices", type=int, default=8)
    p.add_argument("--calibrate-workload", choices=("train_step", "moe_layer"),
                   default="train_step", help="what --calibrate times and predicts")
    p.add_argument("--reference", action="store_true",
                   help="the planner beside the reference's DeepSeek-V3 671B / GB300 figures")
    p.add_argument("--compile-for", choices=COMPILE_TARGETS, default=None,
                   help="also compile the train step for compile-only H100s or H200s (the "
                        "jax CUDA plugin; no GPU needed), one or the plan's mesh on one host, "
                        "and print the bytes per device XLA's memory analysis says it holds "
                        "beside the planner's estimate; a config that does not fit is "
                        "refused (exit 2)")
    p.add_argument("--kernels", action="store_true",
                   help="with --compile-for: list the compiled step's kernels with a predicted "
                        "(roofline, not measured) time each and by group; --out then writes "
                        "them as JSON lines")
    p.add_argument("--out", default=None, help="write the result as JSON here (with --kernels: "
                   "the kernel table as JSON lines)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def _sweep_sizes(text: str) -> list[int]:
    """--sweep-gpus '8,16,32' -> [8, 16, 32]; ValueError naming the argument and the bad item."""
    sizes = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        if not item.isdigit() or int(item) < 1:
            raise ValueError(f"--sweep-gpus {text!r}: {item!r} is not a positive number of GPUs")
        if int(item) > MAX_DEVICES:
            raise ValueError(f"--sweep-gpus {text!r}: {item} is more GPUs than the planner plans "
                             f"({MAX_DEVICES}); sweep fewer")
        sizes.append(int(item))
    if not sizes:
        raise ValueError(f"--sweep-gpus {text!r} names no cluster size (e.g. 8,16,32)")
    if len(sizes) > MAX_SWEEP_SIZES:
        raise ValueError(f"--sweep-gpus names {len(sizes)} cluster sizes, more than a sweep "
                         f"plans ({MAX_SWEEP_SIZES}, a row each); name fewer")
    return sizes


def check_arguments(args) -> None:
    """The flags that are not settings of the plan, checked before anything is computed (the
    settings are checked by `build_plan`, naming the key or field). Raises ValueError naming
    the flag."""
    if args.top < 1:
        raise ValueError(f"--top {args.top} must be >= 1 (rows of --suggest)")
    if not (math.isfinite(args.min_buffer_factor) and args.min_buffer_factor >= 1):
        raise ValueError(f"--min-buffer-factor {args.min_buffer_factor} must be a number >= 1 "
                         "(the expected max/mean expert load)")
    if args.calibrate_devices < 1:
        raise ValueError(f"--calibrate-devices {args.calibrate_devices} must be >= 1")
    if args.sweep_gpus is not None:
        _sweep_sizes(args.sweep_gpus)
    if args.kernels and args.compile_for is None:
        raise ValueError("--kernels lists the kernels of the compiled step: give --compile-for "
                         "h100 or h200 with it")
    if args.kernels and os.environ.get("DROPLESS_NO_PREFLIGHT") == "1":
        raise ValueError("--kernels needs the step compiled, which DROPLESS_NO_PREFLIGHT=1 "
                         "skips: unset it or leave --kernels out")
    if args.compile_for is not None:
        if args.reference or args.calibrate:
            raise ValueError(f"--compile-for {args.compile_for} compiles a planned train step; "
                             "it does not go with --reference or --calibrate")
        _check_plugin(args.compile_for)


def settings(args) -> list[tuple[str, object]]:
    """The flags that were given and the key=value overrides, as (key, value) pairs in that
    order (the --config file's settings come before them, in `plan.from_train.build_plan`)."""
    from dropless.config_file import parse_override
    out = [(key, getattr(args, dest)) for dest, key in _FLAG_KEYS.items()
           if getattr(args, dest) is not None]
    if args.no_dedup:
        out.append(("dedup", False))
    return out + [parse_override(item) for item in args.overrides]


def _compute(args) -> tuple[dict, str]:
    check_arguments(args)
    if args.out:
        from dropless.runtime.environment import check_output_file
        check_output_file(args.out, "--out")
    if args.reference:
        from dropless.plan.reference import comparison, format_markdown
        result = comparison()
        text = format_markdown(result)
    elif args.calibrate:
        from dropless.runtime.xla_flags import ask_host_devices
        ask_host_devices(args.calibrate_devices)   # on a CPU, before JAX starts
        from dropless.bench.calibrate import run_calibration
        result = run_calibration(devices=args.calibrate_devices,
                                 workload=args.calibrate_workload)
        text = result.pop("text")
    else:
        notes: list[str] = []
        cfg, hw, name = build_plan(settings(args), config_path=args.config, notes=notes)
        result = predict(cfg, hw, name=name)
        text = report.format_plan(result)
        if notes:   # under the layout lines: the settings the preset's run settings gave
            result["notes"] = notes
            lines = text.split("\n")
            text = "\n".join(lines[:2] + [f"  {n}" for n in notes] + lines[2:])
        if args.sweep_gpus:
            result["sweep"] = sweep_gpus(cfg, hw, _sweep_sizes(args.sweep_gpus),
                                         axis=args.sweep_axis)
            text += "\n\nScaling sweep (growing " + args.sweep_axis + "):\n" + \
                report.format_sweep(result["sweep"])
        if args.compile_for:
            hlo: list[str] = []
            keep = (lambda exe: hlo.append(exe.as_text())) if args.kernels else None
            result["compiled_memory"] = compiled_memory(cfg, name, args.compile_for,
                                                        on_compiled=keep)
            text = _with_compiled_line(text, result["compiled_memory"])
            if args.kernels:
                result["kernel_table"] = kernel_records(hlo[0], hw, args, name)
                text += "\n\n" + format_kernels(result["kernel_table"])
        if args.suggest:
            result["suggest"] = suggest(cfg, hw, top=args.top,
                                        min_factor=args.min_buffer_factor)
            text += (f"\n\nLayouts that fit on {cfg.mesh.num_devices} x {hw.name}, fastest "
                     "first:\n" + report.format_suggest(result["suggest"]))
    return result, text


def _check_plugin(kind: str) -> None:
    """ValueError saying what to install when no compile-only device of `kind` can be made."""
    from dropless.train.compile_only import unavailable
    why = unavailable()
    if why:
        import jaxlib
        v = jaxlib.__version__
        raise ValueError(f"--compile-for {kind}: {why}: pip install --no-deps "
                         f"jax-cuda13-plugin=={v} jax-cuda13-pjrt=={v} (the GPU test leg's "
                         ".venv-jax011 and .venv-jaxnew have it), or leave --compile-for out")


def compiled_memory(cfg, name: str, kind: str, on_compiled=None) -> dict:
    """The planned run's train step compiled for compile-only `kind` devices by the trainer's
    pre-flight (`train.preflight.check(run, target=kind)`: one device, or the run's mesh on one
    host): its dict, one device's bytes, plus "target", "devices" (the mesh's device count)
    and "jax". Raises ValueError naming the model for a mesh the pre-flight does not compile
    (several nodes: `preflight.target_devices`) and when the step does not fit
    (`preflight.DoesNotFit`). `on_compiled(executable)`: see `preflight.compiled`."""
    import jax
    from dropless.train import preflight
    # the compile-only devices come from the CUDA plugin's topology factory, which is not
    # registered once the CUDA platform has been started (train/compile_only.py); nothing of
    # the plan runs on a device, so the process keeps to the CPU platform
    jax.config.update("jax_platforms", "cpu")
    try:
        fit = preflight.check(cfg.run, target=kind, on_compiled=on_compiled)
    except ValueError as e:     # preflight.DoesNotFit, or a mesh it does not compile
        raise ValueError(f"--compile-for {kind}: {name}: {e}") from None
    return {**fit, "target": kind, "devices": cfg.run.mesh.num_devices, "jax": jax.__version__}


def _with_compiled_line(text: str, fit: dict) -> str:
    """The plan's text with the compiled step's memory under the planner's verdict."""
    from dropless.train import preflight
    n = fit.get("devices", 1)
    target = fit["target"] if n == 1 else f"{n} x {fit['target']}"
    if fit.get("method") == "skipped":
        line = f"  not compiled for {target}: DROPLESS_NO_PREFLIGHT=1 skips the check"
    else:
        line = (f"  compiled for {target} (jax {fit['jax']}):"
                + preflight.summary(fit)[len("  memory:"):])
    lines = text.split("\n")
    at = next((i + 1 for i, ln in enumerate(lines) if ln.startswith("  verdict:")), len(lines))
    return "\n".join(lines[:at] + [line] + lines[at:])


def run(args) -> int:
    """Print (and with --out write) the plan. A bad argument, setting or file raises ValueError
    naming it before anything is computed (cli/main prints it as one line, exit 2)."""
    result, text = _compute(args)
    from dropless import json_out   # never a NaN token: null plus `<key>_nonfinite`
    table = result.pop("kernel_table", None)
    if table is not None:     # in the JSON: the header and the groups; all rows in --out
        result["kernels"] = [r for r in table if r["event"] in ("header", "group")]
    print(json_out.dumps(result, indent=1, default=_jsonable) if args.json else text)
    if args.out and table is not None:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        files.write_text(args.out, "".join(json_out.dumps(r, default=_jsonable) + "\n"
                                           for r in table))
    elif args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        files.write_text(args.out, json_out.dumps(result, indent=1, default=_jsonable))
    return 0


def kernel_records(hlo_text: str, hw, args, name: str) -> list[dict]:
    """The predicted kernel table of the compiled step's HLO (`runtime.hlo_kernels`) on the
    plan's hardware profile `hw`: a "header" record (the command, jax, the machine and commit
    it was compiled on, the date, the target, the profile, the predicted step) and then
    `hlo_kernels.predict`'s records."""
    import datetime

    import jax

    from dropless.machine import machine_info, peak_for
    from dropless.runtime import hlo_kernels
    recs = hlo_kernels.predict(hlo_kernels.kernels(hlo_text), hw,
                               peak=lambda p: peak_for(hw, p) if p in PRECISIONS else None)
    total = sum(r["total_us"] for r in recs if r["event"] == "kernel")
    words = [f"{k}={v}" for k, v in settings(args)]
    command = " ".join(["dropless plan", *([f"--config {args.config}"] if args.config else []),
                        *words, f"--compile-for {args.compile_for}", "--kernels"])
    header = {"event": "header", "command": command, "jax": jax.__version__,
              "machine": machine_info(),
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
              "model": name, "target": args.compile_for, "hardware": hw.name,
              "hbm_bw": hw.hbm_bw, "hbm_efficiency": hw.hbm_efficiency,
              "gemm_efficiency": hw.gemm_efficiency, "predicted_step_us": total,
              "kernels": sum(r["event"] == "kernel" for r in recs),
              "what": "predicted per kernel from the compiled step's optimized HLO: "
                      "max(bytes / (hbm_bw x hbm_efficiency), FLOPs / (peak x "
                      "gemm_efficiency)) x launches, summed with no overlap; not measured. "
                      "The compile-only step runs XLA's attention (cuDNN's needs its "
                      "library, which a compile-only process lacks) and the grouped-matmul "
                      "kernels auto picks for the target GPU in this process"}
    return [header, *recs]


def format_kernels(table: list[dict], top: int = 15) -> str:
    """The top `top` kernels and the groups of a `kernel_records` table as text."""
    from dropless.text_table import format_table
    head = table[0]
    kern = [r for r in table if r["event"] == "kernel"]
    groups = [r for r in table if r["event"] == "group"]

    def row(r: dict, label: str) -> dict:
        return {label: r.get("name", r["group"]), "kind": r.get("kind"),
                "group": r["group"], "count": r.get("count"), "ms/step": r["total_us"] / 1e3,
                "share": f"{100 * r['share']:.1f}%", "GB": r["bytes"] / 1e9,
                "TFLOP": r["flops"] / 1e12, "bound": r.get("bound")}
    return (f"Kernels of the step compiled for {head['target']} ({len(kern)} kernels; "
            f"predicted on the {head['hardware']} profile, not measured):\n"
            + format_table([row(r, "kernel") for r in kern[:top]],
                           ["kernel", "kind", "group", "count", "ms/step", "share", "GB",
                            "TFLOP", "bound"])
            + "\n\nBy group:\n"
            + format_table([row(g, "group") for g in groups],
                           ["group", "ms/step", "share", "GB", "TFLOP"])
            + f"\n  predicted step: {head['predicted_step_us'] / 1e3:.1f} ms (the kernels' "
              "sum, no overlap; the XLA attention, not cuDNN's, as compiled without a GPU)")


def _jsonable(x):
    if isinstance(x, (tuple, set)):
        return list(x)
    return str(x)
