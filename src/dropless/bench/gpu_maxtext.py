"""The maxtext section of `dropless bench gpu`: the train section's model (deepseek3-1gpu,
sequence 4096, batch 4, bfloat16 on float32 weights, remat minimal) trained by MaxText on the
same GPU, so the two runs' tokens/s stand side by side.

MaxText (the commit compat/maxtext*.py read) travels as data: benchmarks/gpu/fetch_maxtext.sh
writes .maxtext/ (the source and the wheels its imports need, beside .whl/) and
benchmarks/gpu/maxtext.sh trains examples/deepseek3_1gpu_maxtext.yml (the preset in MaxText's
flags) over MaxText's base.yml on synthetic data. The section adds `run_flags`: `steps`,
skip_jax_distributed_system (one process, one GPU) and `use_tokamax_gmm=true`, MaxText's
fastest grouped matmul on a GPU (tokamax's Mosaic kernel; the example's `megablox: false,
use_tokamax_gmm: false` make MaxText run jax.lax.ragged_dot, which XLA:GPU computes as a
zero-padded dense product: 64x the work here, not what a MaxText GPU user runs; docs/gpu.md).

Records: one per step of MaxText's metrics file (its step time, its tokens/s and TFLOP/s per
device, the loss), then a summary (`summarize`): the median step time over the steps after the
first `SKIP_STEPS` (MaxText's step time is the host's time between dispatches, a step behind the
device: the first ones hold the compile and the queue filling), tokens/s = the global tokens of
a step over that median, MaxText's own TFLOP/s beside TFLOPS and MFU by dropless's FLOP count of
the same config (`dropless_config`: the YAML and flags MaxText ran, through compat/maxtext, and
`flops_per_token` as the trainer counts it: what the train section's summary reports), the
seconds to the first completed step (set-up and compile), MaxText's compiled memory estimate and
the device memory it logged after initialising (it reports no peak), the exit status and, on
failure, the log's tail; and, when this run's train section wrote its summary, dropless's
tokens/s over MaxText's (`tokens_per_s_ratio`: above 1, dropless is faster).

Where MaxText cannot run, one "skipped" record says why and how to fetch it, never a number:
no .maxtext/ (a clean checkout, CI), or, in a dry run, no Python here with MaxText's image
packages (flax, optax, orbax). The dry run trains `DRY_MODEL` (fetch_maxtext.sh's check's
model) on the CPU for 2 steps with the ragged_dot path (tokamax's Mosaic kernel needs a GPU).
"""
from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from dropless.bench.gpu_train import PRESET

ROOT = Path(__file__).resolve().parents[3]        # the checkout (this file: src/dropless/bench)
SCRIPT = "benchmarks/gpu/maxtext.sh"
EXAMPLE = "examples/deepseek3_1gpu_maxtext.yml"
FETCH = "bash benchmarks/gpu/fetch_wheels.sh && bash benchmarks/gpu/fetch_maxtext.sh"
SKIP_STEPS = 3
# fetch_maxtext.sh's check venv (CHECK_VENV there): the image's packages on CPU, which the dry run
# runs MaxText with where it exists (MAXTEXT_PYTHON, when set, is used instead)
CHECK_VENV = "/tmp/dropless-maxtext-check-venv"
# some of what MaxText imports from the device's image (not carried): a Python without them
# cannot run it
IMAGE_NEEDS = ("flax", "optax", "orbax.checkpoint", "tensorstore", "transformers",
               "annotated_doc")
# fetch_maxtext.sh's check's model: the preset's features (MLA, routed + shared experts, grouped
# routing, a dense first layer) at a size a CPU compiles in seconds
DRY_MODEL = {"per_device_batch_size": 1, "max_target_length": 128, "base_emb_dim": 64,
             "base_num_query_heads": 4, "base_num_kv_heads": 4, "base_mlp_dim": 128,
             "base_moe_mlp_dim": 32, "base_num_decoder_layers": 2, "num_experts": 8,
             "num_experts_per_tok": 2, "shared_experts": 1, "n_routing_groups": 4,
             "topk_routing_group": 2, "q_lora_rank": 32, "kv_lora_rank": 16,
             "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
             "vocab_size": 1024}
DRY_STEPS = 2
# MaxText's step line and its start-up lines (MaxText e591f30: metric_logger.py,
# maxtext_utils.py, max_utils.py)
_GLOG = re.compile(r"^[IWEF](\d{4} \d\d:\d\d:\d\d\.\d+) ")
_STEP = re.compile(r"completed step: (\d+), seconds: ([\d.]+)")
_TFLOPS = re.compile(r"^\s*Total TFLOPs: ([\d.]+)")
_ESTIMATE = re.compile(r"Total estimated memory size: ([\d.]+) GB")
_USING = re.compile(r"Using \(GB\) ([\d.]+) / ([\d.]+)")


def missing(maxtext_dir: Path) -> str | None:
    """Why MaxText cannot run from `maxtext_dir` (None: it holds what fetch_maxtext.sh writes)."""
    for name in ("COMMIT", "maxtext-src.tar.gz", "whl"):
        if not (maxtext_dir / name).exists():
            return f"{maxtext_dir}/{name} is missing (MaxText is fetched with network, not here)"
    return None


def run_flags(*, dry_run: bool, steps: int) -> dict:
    """The flags the section gives maxtext.sh over the example: the run's steps, one process,
    MaxText's best GPU grouped matmul (tokamax's Mosaic kernel; the dry run keeps the example's
    ragged_dot: Mosaic needs a GPU) and, in a dry run, `DRY_MODEL`."""
    flags = {"skip_jax_distributed_system": True, "steps": steps}
    if dry_run:
        return {**flags, **DRY_MODEL}
    return {**flags, "use_tokamax_gmm": True}


def moe_kernel(flags: dict) -> str:
    """The grouped matmul MaxText runs under `flags` over the example (layers/moe.py)."""
    if flags.get("use_tokamax_gmm"):
        return "tokamax.ragged_dot (implementation='mosaic'): use_tokamax_gmm=true"
    return "jax.lax.ragged_dot (a zero-padded dense product on GPU): the example's flags"


# the flags of a run, not of the model: dropless's config does not take them
_RUN_ONLY = ("skip_jax_distributed_system", "hardware")


def dropless_config(flags: dict, example: Path = ROOT / EXAMPLE):
    """dropless's TrainConfig of the MaxText config `flags` run over `example` (their keys
    translated by compat/maxtext, the last of a key winning as in MaxText): the model and the
    tokens whose FLOPs dropless counts. Raises ValueError for a flag dropless cannot honour."""
    from dropless.config_file import build_config, load_yaml
    keys = {**(load_yaml(str(example)) or {}),
            **{k: v for k, v in flags.items() if k not in _RUN_ONLY}}
    return build_config(mapping=keys, notes=[])


def dropless_flops_per_step(cfg) -> tuple[int, float]:
    """(tokens, model FLOPs) of one step of `cfg`, counted as the trainer counts them
    (train/loop.py, train/step_metrics.py: global batch x seq_len positions times
    `flops_per_token`'s "model")."""
    from dropless.models.arithmetic import flops_per_token
    moe = cfg.model.moe
    fpt = flops_per_token(cfg.model, cfg.seq_len,
                          capacity_factor=moe.capacity_factor if moe else None)
    tokens = cfg.global_batch_size * cfg.seq_len
    return tokens, tokens * fpt["model"]


def _glog_time(line: str) -> float | None:
    m = _GLOG.match(line)
    if not m:
        return None
    # glog stamps month and day, no year: a leap year, so 0229 parses; runs span minutes
    t = datetime.datetime.strptime("2000" + m.group(1), "%Y%m%d %H:%M:%S.%f")
    return t.timestamp()


def parse_log(lines: list[str]) -> dict:
    """What MaxText's log says beside its metrics file: its FLOP count of a step ("Total
    TFLOPs"), its compiled memory estimate (GB), the device memory in use it logged ("Using
    (GB) used / limit" after initialising; absent on CPU), the seconds from its first log line
    to "completed step: 0" (config, model init, compile, step 0), and each completed step's log
    time (s since the first log line)."""
    out: dict = {"total_tflops": None, "compiled_estimate_gb": None, "memory_in_use_gb": None,
                 "memory_limit_gb": None, "first_step_s": None, "step_log_s": {}}
    first = None
    for ln in lines:
        t = _glog_time(ln)
        if t is not None and first is None:
            first = t
        if m := _TFLOPS.match(ln):
            out["total_tflops"] = float(m.group(1))
        elif m := _ESTIMATE.search(ln):
            out["compiled_estimate_gb"] = float(m.group(1))
        elif m := _USING.search(ln):
            out["memory_in_use_gb"], out["memory_limit_gb"] = map(float, m.groups())
        elif (m := _STEP.search(ln)) and t is not None and first is not None:
            out["step_log_s"][int(m.group(1))] = round(t - first, 6)
    if 0 in out["step_log_s"]:
        out["first_step_s"] = out["step_log_s"][0]
    return out


def step_records(metrics: list[dict]) -> list[dict]:
    """One record per line of MaxText's metrics file (step, its step time, tokens/s and
    TFLOP/s per device, the loss), in step order."""
    out = []
    for r in sorted(metrics, key=lambda r: r["step"]):
        out.append({"event": "step", "step": int(r["step"]),
                    "step_time_s": r["perf/step_time_seconds"],
                    "maxtext_tokens_per_s": r["perf/per_device_tokens_per_sec"],
                    "maxtext_tflops_per_device": r["perf/per_device_tflops_per_sec"],
                    "loss": r["learning/loss"]})
    return out


def summarize(metrics: list[dict], log: dict, *, tokens: int, flops: float,
              peak: float | None, train: dict | None = None) -> dict:
    """The summary of a MaxText run (module docstring) from its metrics file's lines, the
    `parse_log` of its log, the `tokens` and dropless-counted `flops` of one step, the device's
    bfloat16 `peak` (None: no MFU) and this run's train-section summary (None: no ratio).
    Medians are over the steps after the first SKIP_STEPS (all but the first when there are
    fewer; all of one)."""
    import numpy as np
    steps = step_records(metrics)
    timed = steps[SKIP_STEPS:] or steps[1:] or steps
    out: dict = {"steps": len(steps), "timed_steps": len(timed),
                 "skipped_first_steps": len(steps) - len(timed)}
    if not timed:
        return out
    times = [r["step_time_s"] for r in timed]
    med = float(np.median(times))
    tflops = flops / med / 1e12
    logged = log["step_log_s"]
    gaps = [logged[r["step"]] - logged[r["step"] - 1] for r in timed
            if r["step"] in logged and r["step"] - 1 in logged]
    out.update({
        "median_step_time_s": med, "min_step_time_s": min(times), "max_step_time_s": max(times),
        # the log's own clock between completed steps: the host's view, a check on the above
        "median_logged_step_interval_s": float(np.median(gaps)) if gaps else None,
        "tokens_per_step": tokens, "median_tokens_per_s": tokens / med,
        "maxtext_tokens_per_step": metrics[0].get("perf/per_device_tokens"),
        "maxtext_tflop_per_step": log["total_tflops"],
        "median_maxtext_tflops_per_device": float(np.median(
            [r["maxtext_tflops_per_device"] for r in timed])),
        "dropless_tflop_per_step": flops / 1e12,
        "median_tflops_per_device": tflops, "median_mfu": tflops * 1e12 / peak if peak else None,
        "first_step_s": log["first_step_s"], "compiled_estimate_gb": log["compiled_estimate_gb"],
        "memory_in_use_gb": log["memory_in_use_gb"], "memory_limit_gb": log["memory_limit_gb"],
        "final_loss": steps[-1]["loss"]})
    if train and train.get("median_tokens_per_s"):
        out.update(dropless_tokens_per_s=train["median_tokens_per_s"],
                   dropless_median_step_time_s=train.get("median_step_time_s"),
                   tokens_per_s_ratio=train["median_tokens_per_s"] / out["median_tokens_per_s"])
    return out


def _python(dry_run: bool) -> tuple[str | None, str]:
    """(the Python that runs MaxText, or None, and why): MAXTEXT_PYTHON when set; else, in a
    dry run, fetch_maxtext.sh's check venv (the image's packages, as verified there); else
    this one (the device's image Python) when it has MaxText's image packages
    (`IMAGE_NEEDS`)."""
    given = os.environ.get("MAXTEXT_PYTHON")
    cands = [given] if given else (
        [f"{CHECK_VENV}/bin/python"] if dry_run else []) + [sys.executable]
    probe = ("import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in "
             f"{IMAGE_NEEDS!r}))")
    for py in cands:
        if Path(py).exists() and subprocess.run([py, "-c", probe],
                                                capture_output=True).returncode == 0:
            return py, ""
    return None, (f"no Python with MaxText's image packages {list(IMAGE_NEEDS)} among "
                  f"{cands} (set MAXTEXT_PYTHON; fetch_maxtext.sh makes {CHECK_VENV})")


def _results(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def _device_peak(recs: list[dict], dry_run: bool) -> tuple[str, float | None, str]:
    """(device kind, bfloat16 peak FLOP/s or None, where it came from): the device kind of this
    run's info record, else its train summary's, else nvidia-smi's name (this process starts no
    device client: MaxText has the GPU); the peak from machine's table, as the trainer's MFU."""
    from dropless.machine import device_peak_flops
    kind = next((r.get("device_kind") or r.get("device") for r in recs
                 if (r.get("section"), r.get("event")) in (("info", None), ("train", "summary"))
                 and (r.get("device_kind") or r.get("device"))), None)
    if kind is None and not dry_run and shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True)
        kind = (out.stdout.strip().splitlines() or [None])[0]
    if dry_run or kind is None:
        return kind or "unknown", None, ("no MFU in a dry run (CPU)" if dry_run
                                         else "no info record: the device kind is unknown")
    return kind, device_peak_flops(kind, "bfloat16"), f"table: {kind}"


def _run(cmd: list[str], env: dict, timeout_s: float) -> tuple[int | str, float | None, float]:
    """Run maxtext.sh in this process's group (the runner kills the group at the cap), echoing
    its output; (exit status or "timeout", seconds to its "completed step: 0" line, seconds)."""
    t0 = time.perf_counter()
    first = None
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace")

    def pump():
        nonlocal first
        for ln in proc.stdout:
            if "] Config param " not in ln:   # ~770 lines; all in maxtext_train.log
                print(ln, end="", flush=True)
            if first is None and "completed step: 0," in ln:
                first = time.perf_counter() - t0
    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        status: int | str = proc.wait(timeout=max(timeout_s, 1.0))
    except subprocess.TimeoutExpired:
        _kill_tree(proc.pid)
        proc.wait()
        status = "timeout"
    reader.join(timeout=5)
    return status, first, time.perf_counter() - t0


def _kill_tree(pid: int) -> None:
    """SIGKILL `pid` and its descendants (maxtext.sh's pipeline and MaxText's Python), which
    share this section's process group: the group itself is the runner's to kill."""
    import signal
    kids: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        kids.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    todo, tree = [pid], []
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += kids.get(p, [])
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def maxtext_section(emit, spec: dict) -> None:
    """Run MaxText on the train section's model (module docstring): the step records, then the
    summary; or one "skipped" record saying why it cannot run here. Ends by raising
    RuntimeError (the section's status "error") when MaxText failed or ran no step."""
    dry, mdir = bool(spec["dry_run"]), Path(spec.get("maxtext_dir") or ROOT / ".maxtext")
    why = missing(mdir)
    py, py_why = (None, "") if why else _python(dry)
    if why or py is None:
        emit({"event": "skipped", "skipped": why or py_why, "fetch": FETCH,
              "carry": [".whl", ".maxtext"]},
             f"skipped: {why or py_why}; fetch it with `{FETCH}` and carry .whl and .maxtext")
        return
    flags = run_flags(dry_run=dry, steps=DRY_STEPS if dry else spec["maxtext_steps"])
    cfg = dropless_config(flags)
    tokens, flops = dropless_flops_per_step(cfg)
    out = Path(spec["bench_dir"]) / "maxtext"
    work = Path(tempfile.mkdtemp(prefix="dropless-maxtext-"))   # the unpacked site and source
    env = {**os.environ, "OUT": str(out), "PYTHON": py, "MAXTEXT_DIR": str(mdir),
           "MAXTEXT_SITE": str(work / "site"), "MAXTEXT_SRC": str(work / "src"),
           **({"MAXTEXT_HARDWARE": "cpu", "XLA_FLAGS": _one_cpu_device()} if dry else {})}
    cmd = ["bash", str(ROOT / SCRIPT),
           *[f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in flags.items()]]
    # the records are written after MaxText ends: it is stopped a few seconds before the cap
    try:
        status, launch_s, seconds = _run(cmd, env, spec["deadline_t"] - time.time() - 3)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    metrics = [json.loads(ln) for ln in (out / "maxtext_metrics.jsonl").read_text().splitlines()
               if ln.strip()] if (out / "maxtext_metrics.jsonl").exists() else []
    lines = ((out / "maxtext_train.log").read_text(errors="replace").splitlines()
             if (out / "maxtext_train.log").exists() else [])
    for rec in step_records(metrics):
        emit(rec)
    recs = _results(Path(spec["results"]))
    train = next((r for r in recs if r.get("section") == "train"
                  and r.get("event") == "summary"), None)
    kind, peak, peak_source = _device_peak(recs, dry)
    rec = {"event": "summary", "preset": PRESET, "seq_len": cfg.seq_len,
           "per_device_batch_size": cfg.per_device_batch_size, "flags": flags,
           "moe_kernel": moe_kernel(flags), "commit": _commit(mdir), "python": py,
           **summarize(metrics, parse_log(lines), tokens=tokens, flops=flops, peak=peak,
                       train=train),
           "launch_to_first_step_s": launch_s, "seconds": round(seconds, 2),
           "returncode": status, "device": kind, "peak_source": peak_source,
           "log": "maxtext/maxtext_train.log"}
    if status != 0 or not metrics:
        rec["tail"] = [ln for ln in lines if ln.strip()][-20:]
    emit(rec, _line(rec))
    if status != 0 or not metrics:
        raise RuntimeError(f"MaxText exited {status} after {seconds:.0f} s with "
                           f"{len(metrics)} steps (tail in the summary record)")


def _one_cpu_device() -> str:
    """XLA_FLAGS without a host device count (the tests force 8): MaxText's mesh is one device,
    as on the one GPU; a default-valued flag stands in for none (maxtext.sh: no HLO dump)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    return " ".join(flags) or "--xla_cpu_enable_fast_math=false"


def _commit(mdir: Path) -> str | None:
    try:
        return (mdir / "COMMIT").read_text().strip()
    except OSError:
        return None


def _line(rec: dict) -> str:
    if "median_step_time_s" not in rec:
        return f"MaxText exited {rec['returncode']}: {rec['steps']} steps"
    ratio = rec.get("tokens_per_s_ratio")
    mfu = rec.get("median_mfu")
    return (f"MaxText ({rec['moe_kernel'].split(':')[0]}): median step "
            f"{rec['median_step_time_s'] * 1e3:.1f} ms over {rec['timed_steps']} steps, "
            f"{rec['median_tokens_per_s']:.0f} tokens/s, {rec['median_tflops_per_device']:.3f} "
            f"TFLOPS (dropless's count; MaxText's {rec['median_maxtext_tflops_per_device']:.3f})"
            + (f", MFU {100 * mfu:.1f}%" if mfu else "")
            + (f"; dropless/MaxText tokens/s {ratio:.2f}" if ratio else ""))
