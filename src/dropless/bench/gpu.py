"""`dropless bench gpu`: the prepared device check for an NVIDIA GPU (sized for one H200).

Legend: M routed rows, K contraction dim, N output dim, G groups (experts).

Sections (bench/gpu_plan.py: the plan, the caps, the cost model; bench/gpu_sections.py,
gpu_autotune.py, gpu_train.py: the bodies), each in its own process, appending JSON lines (key
"section") to OUT_DIR/gpu_bench.jsonl as each measurement is taken, output in
OUT_DIR/<section>.log:
  info      versions (jax, jaxlib, torch, triton, tokamax), the device kind, cuDNN (jax's and
            torch's), the grouped-matmul backends usable, what `auto` resolves to
  gmm       bf16 grouped matmul fwd and fwd+bwd, and dlhs and drhs alone (the winner
            table's directions), at the shapes table (ops/gmm/shapes.py), every backend usable
            in the section's process, pallas_gpu on aligned segments too, against XLA's dense
            matmul of equal useful FLOPs in the same run, and torch._grouped_mm / torch.mm as
            the peer; uniform and Zipf routing; the units that fit the cap with margin, most
            informative first (the DeepSeek-V3 and Qwen3 per-device products), then the rest
            while time is left
  moe       the MoE layer fwd+bwd at the Qwen3 and DeepSeek-V3 per-device shapes against a
            dense SwiGLU over the same rows, the per-kernel table of one layer fwd+bwd
            (OUT_DIR/moe_kernels.jsonl, from a profiler trace), then fwd
  autotune  a restricted tokamax autotune, written as OUT_DIR/tokamax_<device kind>.json
  train     the one-GPU model's training (bench/gpu_train.py)
  maxtext   the same model trained by MaxText on the same GPU, tokens/s beside train's
            (bench/gpu_maxtext.py; one "skipped" record where .maxtext/ was not carried)
  tests     the GPU tests (TEST_PATTERNS, each of which must match a file) under
            JAX_PLATFORMS=cuda (Triton and Mosaic kernels for real), time-boxed: passed, failed
            and not reached are counted; cut at its cap it is still "ok"
Every grouped-matmul function is compiled through ops/gmm/fallback.py: a kernel `auto` chose
that fails to compile or run falls back (one log line) and every record names the backend that
ran; the summary table at the end counts the fallbacks.
Isolation: a section that raises, crashes or hangs is recorded (a "section_end" record with its
status, exit code and last lines) and the next one runs; each section's process group is
killed at its cap, at the budget's end (550 s) and when the runner is signalled (SIGTERM from
run.sh's hard stop, SIGINT, SIGHUP). The runner never starts a device client itself and gives
the sections the allocator settings they need (ALLOCATOR_ENV: no preallocation), so run.sh is
not needed for correctness. Exit status: 0 when every section produced its measurements, 1
when one failed or was skipped, 128 + the signal when stopped. `--dry-run` runs the same
runner on CPU with tiny shapes (pallas_gpu in interpret mode; the tests section only collects),
and every run prints the estimated time of each section on one H200 first. Nothing here
asserts a speed.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Mapping

from dropless.bench import gpu_plan as plan

# the GPU-relevant tests, run on the device (the Triton and Mosaic kernels for real); every
# pattern must match a file (`stale_patterns`: the dry run refuses one that does not, a device
# run records it as the tests section's error); the hypothesis soak and the 1,600-row tiled
# case exercise CPU code paths, not the GPU's
TEST_PATTERNS = ("tests/ops/gpu/test_cudnn_attention_gpu.py", "tests/ops/gpu/test_pallas_gpu.py",
                 "tests/ops/gpu/test_pallas_gpu_aligned.py", "tests/ops/gpu/test_mosaic_gpu.py", "tests/ops/gmm/test_registry.py",
                 "tests/ops/gpu/test_triton_check*.py", "tests/ops/gpu/test_tokamax_backend.py")
TEST_DESELECT = "not property and not default_tiles"
FAULT_KINDS = ("raise", "hang", "exit")
# a stand-in tokamax that fails there, put first in `auto` (KEY=SECTION:tokamax only)
STANDIN_KINDS = ("compile", "run")
# what the device's allocator needs: the runner, the section processes, the tests' workers and
# the torch peer share one GPU, so none may take most of its memory up front
ALLOCATOR_ENV = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false",
                 "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuOptions:
    """What `dropless bench gpu` runs: where gpu_bench.jsonl and the logs go, the sections (of
    plan.SECTIONS, run in the order given), the grouped-matmul routings, the shape labels (None:
    all of the table, plan.SHAPES or, in a dry run, plan.DRY_SHAPES), the training steps, the
    config keys the train section sets over the preset's run settings (`train_set`, (key,
    value) pairs: a variant), the training run's directory (None: a new temporary one), the
    whole check's deadline in seconds, the folder MaxText is carried in (`maxtext_dir`, None:
    the checkout's .maxtext; bench/gpu_maxtext.py), the sections' time caps overridden (section ->
    seconds), the faults injected (a section "gmm" or one measurement "gmm:pallas_gpu" -> one
    of FAULT_KINDS) and `dry_run` (every section on CPU with tiny shapes; the dry run's budget
    and caps are plan.DRY_CAP_SCALE times longer)."""
    out_dir: str = "gpu_bench_out"
    sections: tuple[str, ...] = plan.SECTIONS
    routings: tuple[str, ...] = plan.ROUTINGS
    shapes: tuple[str, ...] | None = None
    train_steps: int = plan.TRAIN_STEPS
    train_set: tuple[tuple[str, str], ...] = ()
    train_dir: str | None = None
    budget_s: float = plan.BUDGET_S
    maxtext_dir: str | None = None
    caps: Mapping[str, float] = dataclasses.field(default_factory=dict)
    faults: Mapping[str, str] = dataclasses.field(default_factory=dict)
    dry_run: bool = False


def _caps(args: GpuOptions) -> dict[str, float]:
    scale = plan.DRY_CAP_SCALE if args.dry_run else 1
    caps = {name: cap * scale for name, cap in plan.CAPS_S.items()}
    for key, val in args.caps.items():
        if key not in caps:
            raise ValueError(f"--cap: unknown section {key!r}; known: {list(caps)}")
        caps[key] = float(val) * scale    # a dry run's given caps are scaled as the defaults
    return caps


def _faults(args: GpuOptions) -> dict[str, str]:
    for key, kind in args.faults.items():
        if kind not in FAULT_KINDS + STANDIN_KINDS:
            raise ValueError(f"--inject-fault {key}={kind!r}: the kind is one of "
                             f"{FAULT_KINDS + STANDIN_KINDS}")
        if key.split(":")[0] not in plan.SECTIONS:
            raise ValueError(f"--inject-fault {key}: unknown section; known: {plan.SECTIONS}")
        if (kind in STANDIN_KINDS) != key.endswith(":tokamax"):
            raise ValueError(f"--inject-fault {key}={kind}: {STANDIN_KINDS} go with "
                             f"SECTION:tokamax (a stand-in tokamax kernel), the others with a "
                             f"section or a measurement")
    return dict(args.faults)


def _shapes(args: GpuOptions) -> tuple[plan.GmmShape, ...]:
    table = plan.DRY_SHAPES if args.dry_run else plan.SHAPES
    if not args.shapes:
        return table
    bad = sorted(set(args.shapes) - {s.label for s in table})
    if bad:
        raise ValueError(f"--shapes: unknown {bad}; known: {[s.label for s in table]}")
    return tuple(s for s in table if s.label in args.shapes)


def _sections(args: GpuOptions) -> list[str]:
    sections = list(args.sections)
    bad = sorted(set(sections) - set(plan.SECTIONS))
    if bad:
        raise ValueError(f"--sections: unknown {bad}; known: {list(plan.SECTIONS)}")
    return sections


def _child_env() -> dict[str, str]:
    """This process's environment, with this dropless first on the path of the children and
    the allocator settings (ALLOCATOR_ENV) unless the caller set them."""
    src = str(Path(__file__).resolve().parents[2])   # .../src (this file: src/dropless/bench)
    env = {**ALLOCATOR_ENV, **os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    return env


class Signalled(BaseException):
    """The runner received SIGTERM, SIGINT or SIGHUP (`run` turns it into an exit status)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_signalled(signum, frame):
    raise Signalled(signum)


def run_process(cmd: list[str], *, env: dict, timeout_s: float, log: Path,
                prefix: str, started=None) -> tuple[int | str, list[str], float]:
    """Run `cmd` in its own process group, echoing each output line (stdout and stderr) as it
    comes, with `prefix`, and writing it to `log`; kill the group at `timeout_s`, and also when
    anything interrupts the wait (the runner signalled: the group is killed, then the
    interruption propagates). `started(pid)` is called once the process runs.
    Returns (exit status or "timeout", the output lines, seconds)."""
    t = time.perf_counter()
    lines: list[str] = []
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace", start_new_session=True)

    def pump():
        with log.open("a") as fh:
            for ln in proc.stdout:
                lines.append(ln.rstrip("\n"))
                fh.write(ln)
                fh.flush()
                print(f"{prefix}{ln}", end="", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        if started is not None:
            started(proc.pid)
        status: int | str = proc.wait(timeout=max(timeout_s, 0.1))
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        status = "timeout"
    except BaseException:
        _kill_group(proc)
        raise
    finally:
        if proc.poll() is None:
            _kill_group(proc)
    _kill_group(proc, wait=False)      # what the section left behind in its group
    reader.join(timeout=5)
    return status, lines, time.perf_counter() - t


def _kill_group(proc: subprocess.Popen, wait: bool = True) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if wait:
        proc.wait()


def tests_root() -> Path:
    """The checkout whose tests the tests section runs: this source tree's, else the cwd."""
    root = Path(__file__).resolve().parents[3]
    return root if (root / "tests").is_dir() else Path.cwd()


def stale_patterns(root: Path, patterns=None) -> list[str]:
    """The `patterns` (default TEST_PATTERNS) that match no file under `root`: a test file
    moved or renamed would otherwise leave the tests section silently running less."""
    return [pat for pat in (TEST_PATTERNS if patterns is None else patterns)
            if not glob.glob(str(root / pat))]


def _tests_command(args: GpuOptions, root: Path) -> list[str] | None:
    files = sorted({f for pat in TEST_PATTERNS for f in glob.glob(str(root / pat))})
    if not files:
        return None
    cmd = [sys.executable, "-m", "pytest", "--tb=line", "-p", "no:cacheprovider",
           "-o", "addopts=", *files, "-k", TEST_DESELECT]
    if args.dry_run:
        return cmd + ["--collect-only", "-q"]
    cmd.append("-v")   # one line per test as it ends: counted even when the cap cuts it off
    try:   # compiles dominate the GPU tests: four processes on the 16-core host, one GPU
        import xdist  # noqa: F401
        cmd += ["-n", "4"]
    except ImportError:
        pass
    return cmd + ["--durations=10"]


def _tests_record(lines: list[str]) -> dict:
    """Counts of the per-test result lines of `pytest -v` (complete or cut off), the failures,
    and pytest's own last line."""
    counts: dict[str, int] = {}
    failed = []
    for ln in lines:
        for word in ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS"):
            if f" {word}" in ln and "::" in ln:
                counts[word.lower()] = counts.get(word.lower(), 0) + 1
                if word in ("FAILED", "ERROR"):
                    failed.append(ln.strip()[:200])
                break
    tail = [ln for ln in lines if ln.strip()][-1:]
    collected = [ln for ln in lines if "collected" in ln or "tests collected" in ln]
    selected = None
    # "collected 116 items / 2 deselected / 114 selected", "4 workers [114 items]"
    for ln in lines:
        m = (re.search(r"(\d+) selected", ln) or re.search(r"workers \[(\d+) items?\]", ln)
             or re.search(r"collected (\d+) items?", ln)
             or re.search(r"(\d+)(?:/\d+)? tests? collected", ln))
        if m:
            selected = int(m.group(1))
    done = sum(counts.values())
    out = {"counts": counts, "passed": counts.get("passed", 0),
           "failed_count": counts.get("failed", 0) + counts.get("error", 0),
           "failed": failed[:20], "summary": tail,
           **({"collected": collected[-1].strip()} if collected else {})}
    if selected is not None:
        out["selected"], out["not_reached"] = selected, max(selected - done, 0)
    return out


def _spec(args: GpuOptions, section: str, t0: float, results: Path, train_dir: str,
          timeout_s: float, est: dict) -> dict:
    dry = args.dry_run
    sec = est.get(section, {})
    units = {f"{section}_units": sec.get("kept", []), f"{section}_dropped": sec.get("dropped", [])}
    return {"section": section, "results": str(results), "t0": t0, "dry_run": dry,
            "fault": _faults(args),
            # units start only while their H200 estimate fits before the cap (the dry run's
            # tiny shapes are not the H200's: there only the cap itself counts)
            "deadline_t": time.time() + timeout_s - plan.SECTION_RESERVE_S,
            "est": 0.0 if dry else 1.0,
            **{k: [] for s in ("gmm", "moe", "autotune") for k in (f"{s}_units", f"{s}_dropped")},
            **units, "bench_dir": str(Path(results).parent),
            "timing": plan.DRY_TIMING if dry else plan.TIMING,
            "shapes": [dataclasses.asdict(s) for s in _shapes(args)],
            "routings": list(args.routings),
            "moe_cases": list(plan.DRY_MOE_CASES if dry else plan.MOE_CASES),
            "align_option": plan.align_option(), "profile_calls": 1 if dry else plan.PROFILE_CALLS,
            "autotune_configs": 2 if dry else plan.AUTOTUNE_CONFIGS,
            "train_steps": 2 if dry else args.train_steps, "out_dir": train_dir,
            "train_set": [list(kv) for kv in args.train_set],
            "maxtext_steps": plan.MAXTEXT_STEPS, "maxtext_dir": args.maxtext_dir}


def run_section(args: GpuOptions, section: str, *, timeout_s: float, t0: float, out_dir: Path,
                results: Path, train_dir: str, est: dict) -> dict:
    """One section in its own process; its "section_end" record: status ok / error / timeout
    (the time-boxed tests section is "ok" when cut at its cap: it reports passed / failed /
    not reached). A "section_start" record names the process (its group is killed at the cap
    or when the runner is signalled)."""
    env, log = _child_env(), out_dir / f"{section}.log"
    prefix = f"  {section}| "
    extra: dict = {}
    if section == "tests":
        root = tests_root()
        stale = stale_patterns(root)
        if stale:       # the files that exist still run; the section is not "ok"
            extra["stale_patterns"] = stale
        cmd = _tests_command(args, root)
        if cmd is None:
            return {"status": "skipped", "reason": f"no GPU test files under {root}/tests"}
        if not args.dry_run:
            # f32 comparisons at 1e-5 need f32 dots, not XLA's TF32 default on NVIDIA GPUs
            env.update(JAX_PLATFORMS="cuda", JAX_DEFAULT_MATMUL_PRECISION="highest")
        if "tests" in _faults(args):   # the same injected faults as the other sections'
            kind = _faults(args)["tests"]
            cmd = [sys.executable, "-c", "import os, time; " + {
                "raise": "raise RuntimeError('injected fault at tests')",
                "hang": "time.sleep(10**6)", "exit": "os._exit(3)"}[kind]]
    else:
        spec = _spec(args, section, t0, results, train_dir, timeout_s, est)
        cmd = [sys.executable, "-m", "dropless.bench.gpu_sections", json.dumps(spec)]

    def started(pid):
        _append(results, {"section": section, "event": "section_start", "pid": pid,
                          "t_s": round(time.time() - t0, 2)})
    status, lines, seconds = run_process(cmd, env=env, timeout_s=timeout_s, log=log,
                                         prefix=prefix, started=started)
    if section == "tests":
        extra = {**_tests_record(lines), **extra}
        if args.dry_run:          # collected only: nothing was to be reached
            extra.pop("not_reached", None)
    ok = status == 0
    if section == "tests" and not args.dry_run and status in (0, 1, "timeout"):
        ok = True     # tests ran: failures and the ones not reached are in the counts
    if extra.get("stale_patterns"):
        ok = False
        extra["reason"] = (f"TEST_PATTERNS (bench/gpu.py) entries match no file under "
                           f"{root}: {extra['stale_patterns']}")
    rec = {"status": "ok" if ok else ("timeout" if status == "timeout" else "error"),
           "returncode": status, "seconds": round(seconds, 2), "timeout_s": round(timeout_s, 1),
           "log": log.name, **extra}
    if not ok:
        rec["tail"] = [ln for ln in lines if ln.strip()][-8:]
    return rec


def _tokamax_installed() -> bool:
    import importlib.util
    return importlib.util.find_spec("tokamax") is not None


def _torch_installed() -> bool:
    import importlib.util
    return importlib.util.find_spec("torch") is not None


def _append(path: Path, rec: dict) -> None:
    with path.open("a") as fh:
        fh.write(json.dumps(rec, sort_keys=True, default=str) + "\n")


_PROBE = ("import json, jax; from dropless.ops.gmm import registry as r; "
          "print(json.dumps([jax.default_backend(), [b for b in r.grouped_matmul_backends() "
          "if b != 'auto' and r.unusable(b) is None]]))")


def _probe(env: dict) -> tuple[str, list[str]]:
    """(jax's default backend, the grouped-matmul backends usable there) as a child process
    sees them: the runner itself never starts a device client (it would hold GPU memory the
    sections need)."""
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True,
                         text=True, timeout=120)
    try:
        backend, usable = json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return f"none ({out.stderr.strip()[-200:]})", []
    return backend, usable


def summarize(recs: list[dict]) -> list[dict]:
    """One row per section of a results file's records: status, seconds, the estimate and cap,
    measurements, errors, skipped units, fallbacks (a record whose backend fell back)."""
    rows: dict[str, dict] = {}
    for r in recs:
        sec = r.get("section")
        if sec in (None, "plan"):
            continue
        row = rows.setdefault(sec, {"section": sec, "measurements": 0, "errors": 0,
                                    "skipped": 0, "fallbacks": 0})
        if r.get("event") == "section_end":
            row.update(status=r["status"], seconds=r.get("seconds"),
                       estimated_h200_s=r.get("estimated_h200_s"), cap_s=r.get("timeout_s"))
            if sec == "tests" and "not_reached" in r:
                row["tests"] = (f"{r.get('passed', 0)} passed, {r.get('failed_count', 0)} "
                                f"failed, {r['not_reached']} not reached")
            elif sec == "tests" and "selected" in r:
                row["tests"] = f"{r['selected']} collected"
            continue
        if r.get("event") == "section_start":
            continue
        row["errors"] += "error" in r
        row["skipped"] += "skipped" in r
        row["measurements"] += "median_ms" in r or r.get("event") in ("step", "summary") or (
            sec == "info")
        row["fallbacks"] += bool(r.get("gmm_fallbacks"))
    return list(rows.values())


def run(args: GpuOptions) -> int:
    """Run the selected sections in order; 0 when every one ended "ok" (it produced its
    measurements; the time-boxed tests section is ok when cut at its cap), else 1; 128 + the
    signal when the runner is stopped by SIGTERM, SIGINT or SIGHUP (the running section's
    process group is killed first, and its end recorded). Every result, failed sections'
    included, is in OUT_DIR/gpu_bench.jsonl, and a summary table ends the output. Raises
    ValueError for bad options, or when a real run finds no GPU."""
    t0 = time.time()
    sections, caps = _sections(args), _caps(args)
    budget_s = args.budget_s * (plan.DRY_CAP_SCALE if args.dry_run else 1)
    _shapes(args), _faults(args)                      # bad options fail before anything runs
    if args.train_steps < 1:
        raise ValueError(f"--train-steps={args.train_steps} must be >= 1")
    if "train" in sections:
        from dropless.bench.gpu_train import check_train_set
        check_train_set(args.train_set)
    stale = stale_patterns(tests_root()) if "tests" in sections else []
    if stale and args.dry_run:     # a device run still runs the rest and records them
        raise ValueError(f"bench/gpu.py TEST_PATTERNS: {stale} match no file under "
                         f"{tests_root()}; name the GPU tests where they are now")
    for key, val in ALLOCATOR_ENV.items():            # before anything here starts a device
        os.environ.setdefault(key, val)
    backends = plan.DRY_BACKENDS
    if not args.dry_run:
        backend, usable = _probe(_child_env())
        backends = tuple(plan.measured_backends(usable))
        if backend != "gpu":
            raise ValueError(f"bench gpu needs a GPU (jax's default backend is {backend!r}); "
                             f"use --dry-run to check it on CPU")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = out_dir / "gpu_bench.jsonl"
    # the dry run estimates the device run: torch there, tokamax too (when its wheels travel)
    # planned against the H200 caps, or the ones given (--cap, in seconds as given)
    plan_caps = {**plan.CAPS_S, **{k: float(v) for k, v in args.caps.items()}}
    tokamax, aligned = args.dry_run or _tokamax_installed(), plan.align_option() is not None
    est = plan.estimate(tokamax=tokamax, torch=args.dry_run or _torch_installed(),
                        backends=backends, aligned=aligned, train_steps=args.train_steps,
                        caps=plan_caps)
    # the shapes asked for (the dry run's own), planned as the H200's would be
    est["gmm"] = plan.section_plan("gmm", tokamax=tokamax, backends=backends,
                                   shapes=_shapes(args), routings=args.routings,
                                   cap_s=plan_caps["gmm"])
    if args.dry_run:
        est["moe"] = plan.section_plan("moe", tokamax=True, moe_cases=plan.DRY_MOE_CASES,
                                       aligned=aligned, cap_s=plan_caps["moe"])
        est["autotune"] = plan.section_plan("autotune", tokamax=True,
                                            autotune_shapes=plan.DRY_AUTOTUNE_SHAPES,
                                            cap_s=plan_caps["autotune"])
    est["total"]["seconds"] = sum(est[name]["seconds"] for name in plan.SECTIONS)
    print(plan.format_estimate(est), flush=True)
    _append(results, {"section": "plan", "estimate_h200": est, "caps_s": caps,
                      "budget_s": budget_s, "sections": sections,
                      "dry_run": bool(args.dry_run), "t_s": 0.0})
    # the train section's run folder: the one given, kept; else a temporary one, removed at the end
    train_dir = args.train_dir or tempfile.mkdtemp(prefix="dropless-gpu-train-")
    handlers = _install_handlers()
    ends: dict = {}
    try:
        for section in sections:
            ends[section] = _one_section(args, section, caps, budget_s, t0, out_dir, results,
                                         train_dir, est)
    except Signalled as e:
        section = next((s for s in sections if s not in ends), sections[-1])
        rec = {"section": section, "event": "section_end", "status": "killed",
               "reason": f"the runner got {e}: the section's process group was killed",
               "dry_run": bool(args.dry_run), "t_s": round(time.time() - t0, 2)}
        _append(results, rec)
        ends[section] = rec
        print(f"# section {section}: killed ({e})", flush=True)
        _print_summary(results, t0)
        return 128 + e.signum
    finally:
        _restore_handlers(handlers)
        if not args.train_dir:
            shutil.rmtree(train_dir, ignore_errors=True)
    _print_summary(results, t0)
    return 0 if all(r["status"] == "ok" for r in ends.values()) else 1


def _one_section(args, section, caps, budget_s, t0, out_dir, results, train_dir, est) -> dict:
    """Run (or skip, when the budget is spent) one section; its section_end record."""
    left = budget_s - (time.time() - t0)
    timeout_s = min(caps[section], left)
    print(f"# section {section} (cap {timeout_s:.0f} s, estimated "
          f"{est[section]['seconds']:.0f} s on an H200)", flush=True)
    if left < plan.MIN_SECTION_S:
        rec = {"status": "skipped", "reason": f"{max(left, 0):.0f} s left of the "
               f"{budget_s:g} s budget"}
    else:
        rec = run_section(args, section, timeout_s=timeout_s, t0=t0, out_dir=out_dir,
                          results=results, train_dir=train_dir, est=est)
    rec = {"section": section, "event": "section_end", **rec,
           "estimated_h200_s": round(est[section]["seconds"], 1),
           "dry_run": bool(args.dry_run), "t_s": round(time.time() - t0, 2)}
    _append(results, rec)
    print(f"# section {section}: {rec['status']}"
          + (f" ({rec['returncode']})" if rec["status"] in ("error", "timeout") else "")
          + (f" in {rec['seconds']:.1f} s" if "seconds" in rec else "")
          + (f": {rec['reason']}" if "reason" in rec else ""), flush=True)
    return rec


SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _install_handlers() -> dict:
    """SIGTERM/SIGINT/SIGHUP raise Signalled in the runner (main thread only; elsewhere, as
    under a test's thread, nothing is installed)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, _raise_signalled) for sig in SIGNALS}


def _restore_handlers(handlers: dict) -> None:
    for sig, old in handlers.items():
        signal.signal(sig, old)


def _print_summary(results: Path, t0: float) -> None:
    from dropless import text_table
    recs = [json.loads(ln) for ln in results.read_text().splitlines() if ln.strip()]
    rows = summarize(recs)
    _append(results, {"section": "summary", "event": "summary", "rows": rows,
                      "t_s": round(time.time() - t0, 2)})
    print(f"# wrote {results} in {time.time() - t0:.0f} s", flush=True)
    print(text_table.format_table(rows, ["section", "status", "seconds", "estimated_h200_s",
                                         "cap_s", "measurements", "errors", "skipped",
                                         "fallbacks", "tests"]), flush=True)
