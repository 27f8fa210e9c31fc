"""MaxText's training step and dropless's, compiled for a compile-only H100 or H200 (no GPU).

    MAXTEXT_SRC=/tmp/maxtext-src MAXTEXT_SITE=/tmp/maxtext-site MAXTEXT_EXTRA=DIR \
    .venv-jax011/bin/python benchmarks/gpu/maxtext_compile.py --target h100 \
        [--systems maxtext,dropless] [--set key=value ...] \
        [--out benchmarks/results/maxtext_compile.jsonl] [--hlo-dir DIR] [--verbose]

The interpreter: one with jax, the jax CUDA plugin of its version (a compile-only device) and
dropless, e.g. .venv-jax011 (`make setup-gpu-lowering`); the children run with
JAX_PLATFORMS=cpu. MaxText's imports on top of it, as benchmarks/gpu/maxtext.sh lays them out:
MAXTEXT_SRC the unpacked .maxtext/maxtext-src.tar.gz (--strip-components=1), MAXTEXT_SITE
`pip install --no-deps --target` of .whl/*.whl and .maxtext/whl/*.whl, and MAXTEXT_EXTRA a
folder of what the image has and .venv-jax011 lacks (chex, einops, jaxtyping, transformers
5.17.0 with huggingface_hub 1.x, sentencepiece, tiktoken, regex, requests, ...: e.g. links to
the packages of fetch_maxtext.sh's check venv that .venv-jax011 does not hold).

Each system is compiled in a fresh subprocess (no cache or jax config shared):
  * maxtext: MaxText's own train step (`trainers/pre_train/train.py`'s `train_step`, through
    `train_compile.py`'s `get_shaped_inputs` and `maxtext_utils.get_functional_train_with_
    signature`, MaxText's AOT path) for examples/deepseek3_1gpu_maxtext.yml over its base.yml,
    with `hardware=gpu dataset_type=synthetic use_tokamax_gmm=true` and then --set's overrides
    (MaxText's flag names; the last of a key wins). Only the mesh differs from
    train_compile.py: MaxText builds a GPU target from `jax.devices()` with mock processes,
    here the mesh is MaxText's `create_device_mesh` over dropless's compile-only devices
    (`dropless.train.compile_only.devices`). Two contexts make tokamax lower for the named GPU
    in a CPU process, as it would on the GPU: `tokamax.config.cross_compile(True)` (tokamax's
    own switch for compiling on another machine: it skips its has-a-GPU checks) and, while
    the step is traced, `jax.default_device(<the compile-only GPU>)` (tokamax's
    `implementation="mosaic"`, which MaxText passes, picks Mosaic GPU or TPU by the default
    device's kind).
  * dropless: `dropless.train.preflight.check(cfg, target=...)` for the preset deepseek3-1gpu
    at its run settings (`presets.RUN_SETTINGS`: sequence 4096, batch 4, remat minimal), the
    settings the MaxText yml says in MaxText's flags (its header). --set does not apply here.

One JSON line a compile (printed, and appended to --out): whether it compiled (else the first
line of the error and the stage: config, trace+lower or compile), seconds (trace+lower and
compile; the dropless record has its pre-flight's one figure, trace+lower+compile),
`memory_analysis()`'s bytes and the total dropless's pre-flight compares (`preflight.analysis`:
arguments + outputs - aliased + temp + code) against each kind's usable memory
(`preflight.target_limit`), the custom-call targets in the optimized HLO (static counts) and
the kernels one step launches by kind (`runtime.hlo_kernels`; launches inside loops counted per
trip), the settings, and the machine (commit, versions, CPU, whether the other core was busy).
Compile seconds are only comparable between records of the same machine with busy_before ~0.
Environment: MAXTEXT_SRC (the unpacked MaxText source: holds src/maxtext), MAXTEXT_SITE
(the MaxText wheels, `pip install --target`), MAXTEXT_EXTRA (more site folders, ':'-separated)
are put on the MaxText child's sys.path after the source; .maxtext/COMMIT names the commit.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import time
import traceback

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
EXAMPLE = os.path.join(ROOT, "examples", "deepseek3_1gpu_maxtext.yml")
PRESET = "deepseek3-1gpu"
# what benchmarks/gpu/maxtext.sh passes MaxText on a GPU, less the run's outputs, plus the kernel
# MaxText offers for the grouped matmul on a GPU (the example yml says ragged_dot: its flags
# default): the comparison's settings; --set comes after these
MAXTEXT_RUN = ("run_name=maxtext_compile", "base_output_directory=/tmp/maxtext-compile-runs",
               "hardware=gpu", "dataset_type=synthetic", "enable_checkpointing=false",
               "skip_jax_distributed_system=true", "use_tokamax_gmm=true")
# MaxText's settings read back from its config into the record
MAXTEXT_KEYS = ("attention", "use_tokamax_gmm", "megablox", "sparse_matmul", "use_gmm_v2",
                "capacity_factor", "remat_policy", "per_device_batch_size", "max_target_length",
                "dtype", "weight_dtype", "scan_layers", "base_num_decoder_layers",
                "num_experts", "num_experts_per_tok", "shared_experts", "decoder_block",
                "attention_type", "shard_mode", "pure_nnx", "opt_type")
MARK = "MAXTEXT_COMPILE_RECORD "


def _first_line(e: BaseException) -> str:
    lines = [ln for ln in f"{type(e).__name__}: {e}".splitlines() if ln.strip()]
    return lines[0][:500] if lines else type(e).__name__


def _versions(names) -> dict:
    from importlib.metadata import PackageNotFoundError, version
    out = {}
    for n in names:
        try:
            out[n] = version(n)
        except PackageNotFoundError:
            out[n] = None
    return out


def _hlo_summary(text: str) -> dict:
    """Custom-call targets (static count of instructions in the optimized HLO, every
    computation), and the kernels one step launches by kind (hlo_kernels: fusion kinds other
    than plain kLoop/kInput, custom calls, sorts...), each with its kernel group and the jax
    function the custom calls came from (the scope's element before pallas_call/mpmd_map)."""
    from dropless.runtime import hlo_kernels
    static = collections.Counter(re.findall(r'custom_call_target="([^"]+)"', text))
    launches, groups, sources = collections.Counter(), {}, collections.Counter()
    for r in hlo_kernels.kernels(text):
        launches[r["kind"]] += r["count"]
        groups.setdefault(r["kind"], set()).add(r["group"])
        if r["kind"] in static:
            parts = [p for p in (r["scope"] or "").split("/")
                     if p and not p.startswith(("jvp", "transpose", "eval_jaxpr", "jit("))]
            fn = parts[-2] if len(parts) >= 2 else (parts[-1] if parts else "?")
            sources[f"{r['kind']} <- {re.sub(r'[.][0-9]+$', '', fn)}"] += r["count"]
    return {"custom_calls": dict(static.most_common()),
            "launches_by_kind": dict(launches.most_common()),
            "kind_groups": {k: sorted(v) for k, v in groups.items()},
            "custom_call_sources": dict(sources.most_common()),
            "hlo_lines": text.count("\n")}


def _memory(an: dict) -> dict:
    """preflight.analysis' bytes and the fit verdict against each kind's usable memory."""
    from dropless.train.preflight import target_limit
    fits = {}
    for kind in ("h100", "h200"):
        limit, source = target_limit(kind)
        fits[kind] = {"fits": an["total"] < limit, "limit": limit, "source": source}
    return {"memory": {k: an[k] for k in ("arguments", "outputs", "aliased", "temp", "code",
                                          "total")}, "fit": fits}


def _save_hlo(text: str, hlo_dir: str | None, name: str) -> str | None:
    if not hlo_dir:
        return None
    os.makedirs(hlo_dir, exist_ok=True)
    path = os.path.join(hlo_dir, name + ".hlo.txt")
    with open(path, "w") as f:
        f.write(text)
    return path


def child_maxtext(target: str, sets: list[str], hlo_dir: str | None) -> dict:
    """MaxText's train step for `target`'s compile-only GPU (module docstring)."""
    for p in reversed([os.path.join(os.environ.get("MAXTEXT_SRC", "/tmp/maxtext-src"), "src"),
                       os.environ.get("MAXTEXT_SITE", "/tmp/maxtext-site"),
                       *filter(None, os.environ.get("MAXTEXT_EXTRA", "").split(":"))]):
        sys.path.insert(0, p)
    import tempfile
    rec: dict = {"system": "maxtext", "target": target, "compiled": False, "stage": "config",
                 "maxtext_commit": None}
    commit = os.path.join(ROOT, ".maxtext", "COMMIT")
    if os.path.exists(commit):
        with open(commit) as f:
            rec["maxtext_commit"] = f.read().strip()
    yml = tempfile.NamedTemporaryFile("w", suffix=".yml", delete=False)
    with open(EXAMPLE) as f:
        yml.write("base_config: base.yml\n" + "".join(ln for ln in f if not ln.startswith("#")))
    yml.close()
    overrides = [*MAXTEXT_RUN, *sets]
    rec["maxtext_overrides"] = overrides
    rec["maxtext_config"] = os.path.relpath(EXAMPLE, ROOT)
    rec["versions"] = _versions(["jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt",
                                 "flax", "optax", "orbax-checkpoint", "tokamax", "qwix",
                                 "transformers"])
    try:
        import jax
        import tokamax
        from flax.linen import partitioning as nn_partitioning
        from jax.sharding import AxisType, Mesh

        from dropless.train.compile_only import devices
        from dropless.train.preflight import analysis
        from maxtext.common.common_types import ShardMode
        from maxtext.configs import pyconfig
        from maxtext.trainers.pre_train import train, train_compile
        from maxtext.utils import maxtext_utils, sharding
        config = pyconfig.initialize(["maxtext_compile", yml.name, *overrides])
        rec["maxtext_settings"] = {k: getattr(config, k, None) for k in MAXTEXT_KEYS}
        rec["maxtext_settings"] = json.loads(json.dumps(rec["maxtext_settings"], default=str))
        # train.py's and train_compile.py's main do this before anything else
        jax.config.update("jax_default_prng_impl", "unsafe_rbg")
        jax.config.update("jax_remove_size_one_mesh_axis_from_type",
                          config.remove_size_one_mesh_axis_from_type)
        devs = devices(target, 1)
        # train_compile.get_topology_mesh, over the compile-only devices
        axis = AxisType.Explicit if config.shard_mode == ShardMode.EXPLICIT else AxisType.Auto
        mesh = Mesh(maxtext_utils.create_device_mesh(config, list(devs)), config.mesh_axes,
                    axis_types=(axis,) * len(config.mesh_axes))
        rec["stage"] = "trace+lower"
        t0 = time.perf_counter()
        with tokamax.config.cross_compile(True):
            args, kwargs, state_sh, _, model = train_compile.get_shaped_inputs(mesh, config)
        params_sh, state_sh = sharding.maybe_update_params_sharding_with_opt(config, state_sh)
        in_state_sh = sharding.build_zero1_input_state_mesh_shardings(config, state_sh,
                                                                      params_sh)
        data_sh = sharding.get_input_data_sharding(config, mesh)
        fn, in_sh, out_sh, static, donate = maxtext_utils.get_functional_train_with_signature(
            train.train_step, data_sh, in_state_sh, model, config, params_sh)
        # train_compile.jit_and_compile, with the two contexts of the module docstring
        with tokamax.config.cross_compile(True), jax.default_device(devs[0]), \
                jax.set_mesh(mesh), mesh, nn_partitioning.axis_rules(config.logical_axis_rules):
            jitted = jax.jit(fn, in_shardings=in_sh, out_shardings=out_sh,
                             static_argnums=static, donate_argnums=donate)
            lowered = jitted.lower(*args, **kwargs)
        t1 = time.perf_counter()
        rec["lower_s"] = t1 - t0
        rec["stage"] = "compile"
        compiled = lowered.compile(
            compiler_options=train_compile.max_utils.parse_libtpu_flags_to_dict(
                config.compile_xla_flags))
        rec["compile_s"] = time.perf_counter() - t1
        rec.update(compiled=True, stage="done", **_memory(analysis(compiled)))
        text = compiled.as_text()
        rec.update(_hlo_summary(text))
        rec["hlo_file"] = _save_hlo(text, hlo_dir, f"maxtext_{target}")
    except Exception as e:   # noqa: BLE001 (the record says what failed, and where)
        rec["error"] = _first_line(e)
        traceback.print_exc()
    finally:
        os.unlink(yml.name)
    return rec


def child_dropless(target: str, hlo_dir: str | None) -> dict:
    """dropless's train step for `target`'s compile-only GPU, by its own pre-flight."""
    from dropless.config import TrainConfig
    from dropless.presets import RUN_SETTINGS, get_preset
    from dropless.train import preflight
    settings = RUN_SETTINGS[PRESET]
    cfg = TrainConfig(model=get_preset(PRESET), preset=PRESET, **settings)
    m = cfg.model
    rec: dict = {"system": "dropless", "target": target, "compiled": False, "stage": "compile",
                 "preset": PRESET, "dropless_settings": {
                     **settings, "dtype": m.dtype, "weight_dtype": m.weight_dtype,
                     "scan_layers": m.scan_layers, "num_layers": m.num_layers,
                     "experts": m.moe.num_experts, "top_k": m.moe.top_k,
                     "gmm_backend": getattr(m.moe, "gmm_backend", None),
                     "dispatcher": m.moe.dispatcher},
                 "versions": _versions(["jax", "jaxlib", "jax-cuda13-plugin",
                                        "jax-cuda13-pjrt", "flax", "optax"])}
    texts: list[str] = []
    try:
        fit = preflight.check(cfg, target=target, on_compiled=lambda e: texts.append(e.as_text()))
        c = fit["compiled"]
        rec.update(compiled=True, stage="done", lower_s=None, compile_s=c["compile_s"],
                   compile_s_includes_trace=True, **_memory(c),
                   preflight={"total": fit["total"], "limit": fit["limit"],
                              "source": fit["source"], "model_total": fit["model_total"]})
        rec.update(_hlo_summary(texts[0]))
        rec["hlo_file"] = _save_hlo(texts[0], hlo_dir, f"dropless_{target}")
    except Exception as e:   # noqa: BLE001 (a DoesNotFit too: the record says so)
        rec["error"] = _first_line(e)
        traceback.print_exc()
    return rec


def run_child(system: str, args) -> dict:
    """One compile in a fresh process; its record (a failed child's exit status if none)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "DECOUPLE_GCLOUD": "TRUE",
           "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "1")}
    # with XLA_FLAGS unset MaxText dumps the step's HLO to /tmp/xla_dump (maxtext.sh says why)
    env.setdefault("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", system, "--target",
           args.target, *sum((["--set", s] for s in args.set), [])]
    if args.hlo_dir:
        cmd += ["--hlo-dir", args.hlo_dir]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    rec = None
    for line in proc.stdout:
        if line.startswith(MARK):
            rec = json.loads(line[len(MARK):])
        elif args.verbose:
            sys.stderr.write(line)
    rc = proc.wait()
    if rec is None:
        rec = {"system": system, "target": args.target, "compiled": False,
               "error": f"the child exited {rc} with no record (killed for memory?)"}
    return rec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", choices=("h100", "h200"), default="h100")
    p.add_argument("--systems", default="maxtext,dropless",
                   help="comma-separated, in this order: maxtext, dropless")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a MaxText override (its flag names), after the comparison's settings")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                 "maxtext_compile.jsonl"))
    p.add_argument("--hlo-dir", default=None, help="write each optimized HLO text here")
    p.add_argument("--verbose", action="store_true", help="pass the children's logs through")
    p.add_argument("--child", choices=("maxtext", "dropless"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        rec = (child_maxtext(args.target, args.set, args.hlo_dir) if args.child == "maxtext"
               else child_dropless(args.target, args.hlo_dir))
        print(MARK + json.dumps(rec), flush=True)
        return 0
    os.environ["JAX_PLATFORMS"] = "cpu"
    from dropless.machine import busy_fraction, machine_info
    machine = machine_info()
    for system in args.systems.split(","):
        if system not in ("maxtext", "dropless"):
            p.error(f"--systems: unknown system {system!r}; known: maxtext, dropless")
        busy = busy_fraction()
        rec = {"bench": "maxtext_compile", **run_child(system, args), "busy_before": busy,
               "unix_time": time.time(), "machine": machine}
        print(json.dumps(rec), flush=True)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(rec) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
