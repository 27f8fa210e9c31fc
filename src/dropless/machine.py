"""The machine a number came from: accelerator profiles (peak FLOPS, memory, link bandwidths,
NVLink domain size, with sources), and this host: CPU model, contention, the round-robin timer
(`time_interleaved`), the CPU peak the trainer's MFU divides by, and `machine_info` for
benchmark records. The one place peaks are read from (the planner, the trainer's MFU, the
benches). Imports nothing of dropless; JAX only inside the functions that ask it about devices.

All bandwidths are per GPU, per direction, in bytes/s (NVIDIA quotes NVLink bidirectional:
"900 GB/s" NVLink 4 is 450 GB/s each way). Peaks are dense (no 2:4 sparsity) tensor-core FLOPS.

The `*_efficiency` fields are *assumptions*, not datasheet numbers: the fraction of peak a good
kernel reaches on the large shapes of MoE training (dense GEMM, grouped GEMM, flash attention)
and the fraction of link bandwidth a collective reaches (NCCL bus bandwidth). They are the knobs
to change when a measurement disagrees; docs/planning.md says where the defaults come from.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Mapping

GB = 1e9
TB = 1e12
TFLOPS = 1e12


@dataclasses.dataclass(frozen=True, kw_only=True)
class HardwareProfile:
    """One accelerator as the planner sees it (units: FLOP/s, bytes, bytes/s, seconds)."""

    name: str
    peak_bf16: float
    peak_fp8: float                  # fp8 and MXFP8 (block scales applied inside the GEMM)
    hbm_bytes: float
    hbm_bw: float
    nvlink_bw: float                 # per direction, to the other GPUs of the NVLink domain
    ib_bw: float                     # per direction, this GPU's share of scale-out NICs
    host_bw: float                   # per direction, GPU <-> host memory (offload)
    gpus_per_domain: int             # GPUs sharing one NVLink domain ("node" for the planner)
    gemm_efficiency: float = 0.75    # dense bf16 GEMM, fraction of peak (assumption)
    gmm_efficiency: float = 0.65     # grouped GEMM (assumption)
    fp8_efficiency: float = 0.55     # MXFP8 grouped GEMM incl. quantization (assumption)
    attention_efficiency: float = 0.45  # flash attention fwd+bwd (assumption)
    link_efficiency: float = 0.8     # collective bus bandwidth / link bandwidth (assumption)
    hbm_efficiency: float = 0.8      # memory-bound kernels' share of HBM bandwidth (assumption)
    nvlink_latency_s: float = 5e-6   # per collective step (assumption)
    ib_latency_s: float = 10e-6      # per collective step (assumption)
    usable_memory_fraction: float = 0.92  # runtime, allocator and fragmentation reserve
    overlap_cost: float = 0.1        # share of a hidden collective's time that still slows
                                     # compute (SMs and HBM taken by NCCL kernels; assumption)
    peak_tf32: float | None = None   # float32 matmuls (TF32 tensor cores, XLA's default on GPU)
    sources: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, float) and not v > 0 and f.name != "overlap_cost":
                raise ValueError(f"HardwareProfile.{f.name}={v!r} must be > 0 ({self.name})")
        if self.gpus_per_domain <= 0:
            raise ValueError(f"HardwareProfile.gpus_per_domain={self.gpus_per_domain!r} "
                             f"must be >= 1 ({self.name})")
        for f in ("gemm_efficiency", "gmm_efficiency", "fp8_efficiency",
                  "attention_efficiency", "link_efficiency", "hbm_efficiency",
                  "usable_memory_fraction",
                  "overlap_cost"):
            if not 0 <= getattr(self, f) <= 1:
                raise ValueError(f"HardwareProfile.{f}={getattr(self, f)!r} must be in [0, 1] "
                                 f"({self.name})")

    def replace(self, **changes) -> "HardwareProfile":
        return dataclasses.replace(self, **changes)

    @property
    def usable_memory(self) -> float:
        return self.hbm_bytes * self.usable_memory_fraction


_HOPPER_SRC = ("NVIDIA H100 Tensor Core GPU datasheet / www.nvidia.com/en-us/data-center/h100/ "
               "and the NVIDIA H100 Tensor Core GPU Architecture whitepaper (SXM5 table): "
               "989.4 TFLOPS BF16, 1,978.9 TFLOPS FP8 and 494.7 TFLOPS TF32 dense (quoted x2 "
               "with sparsity), NVLink 900 GB/s, PCIe Gen5 128 GB/s (both bidirectional)")
_IB400 = ("NVIDIA DGX H100/H200/B200 user guides: eight ConnectX-7 400 Gb/s InfiniBand ports, "
          "one per GPU (50 GB/s per direction)")
_TF32 = ("TF32 (float32 matmuls): dense = half the with-sparsity figure NVIDIA quotes on the same "
         "page (B200 2.2 PF, GB200 / GB300 2.5 PF per GPU)")
_C2C = ("NVIDIA Grace Blackwell superchip: NVLink-C2C 900 GB/s bidirectional per Grace CPU, "
        "shared by its GPUs (2 per Grace on GB200/GB300) -> ~225 GB/s per GPU per direction")

PROFILES: dict[str, HardwareProfile] = {
    "h100": HardwareProfile(
        name="h100", peak_bf16=989.4 * TFLOPS, peak_fp8=1978.9 * TFLOPS, hbm_bytes=80 * GB,
        hbm_bw=3.35 * TB, nvlink_bw=450 * GB, ib_bw=50 * GB, host_bw=64 * GB,
        gpus_per_domain=8, peak_tf32=494.7 * TFLOPS,
        sources=(_HOPPER_SRC + "; 80 GB HBM3 at 3.35 TB/s", _IB400)),
    "h200": HardwareProfile(
        name="h200", peak_bf16=989.4 * TFLOPS, peak_fp8=1978.9 * TFLOPS, hbm_bytes=141 * GB,
        hbm_bw=4.8 * TB, nvlink_bw=450 * GB, ib_bw=50 * GB, host_bw=64 * GB,
        gpus_per_domain=8, peak_tf32=494.7 * TFLOPS,
        sources=("NVIDIA H200 datasheet / www.nvidia.com/en-us/data-center/h200/: 141 GB HBM3e "
                 "at 4.8 TB/s, compute as H100 SXM", _HOPPER_SRC, _IB400)),
    "b200": HardwareProfile(
        name="b200", peak_bf16=2250 * TFLOPS, peak_fp8=4500 * TFLOPS, hbm_bytes=180 * GB,
        hbm_bw=8 * TB, nvlink_bw=900 * GB, ib_bw=50 * GB, host_bw=64 * GB,
        gpus_per_domain=8, peak_tf32=1100 * TFLOPS,
        sources=("NVIDIA DGX B200 datasheet / www.nvidia.com/en-us/data-center/dgx-b200/: 8 GPUs, "
                 "72 PFLOPS FP8 training (sparse; 4.5 PF dense per GPU, BF16 half of that), "
                 "1,440 GB HBM3e (180 GB per GPU) at 64 TB/s, NVLink 5 14.4 TB/s aggregate "
                 "(1.8 TB/s per GPU bidirectional)", _IB400, _TF32)),
    "gb200": HardwareProfile(
        name="gb200", peak_bf16=2500 * TFLOPS, peak_fp8=5000 * TFLOPS, hbm_bytes=186 * GB,
        hbm_bw=8 * TB, nvlink_bw=900 * GB, ib_bw=50 * GB, host_bw=225 * GB,
        gpus_per_domain=72, peak_tf32=1250 * TFLOPS,
        sources=("NVIDIA GB200 NVL72 specifications / www.nvidia.com/en-us/data-center/gb200-nvl72/"
                 ": per GPU 10 PF FP8 and 5 PF BF16 with sparsity (dense: half), 13.4 TB HBM3e per "
                 "72 GPUs (186 GB each) at 8 TB/s, NVLink 5 1.8 TB/s per GPU, 72-GPU NVLink domain",
                 "GB200 NVL72 compute trays: ConnectX-7 400 Gb/s per GPU for scale-out", _C2C,
                 _TF32)),
    "gb300": HardwareProfile(
        name="gb300", peak_bf16=2500 * TFLOPS, peak_fp8=5000 * TFLOPS, hbm_bytes=279 * GB,
        hbm_bw=8 * TB, nvlink_bw=900 * GB, ib_bw=100 * GB, host_bw=225 * GB,
        gpus_per_domain=72, peak_tf32=1250 * TFLOPS,
        sources=("NVIDIA GB300 NVL72 specifications / www.nvidia.com/en-us/data-center/gb300-nvl72/"
                 ": 360 PFLOPS FP8 and 180 PFLOPS BF16 dense per 72 GPUs (5 PF / 2.5 PF each), "
                 "up to 20 TB HBM3e per rack (279 GB usable of 288 GB per GPU) at 8 TB/s, NVLink 5 "
                 "130 TB/s per rack (1.8 TB/s per GPU), 72-GPU NVLink domain",
                 "NVIDIA NVL72 AI-factory reference architecture (docs.nvidia.com/enterprise-"
                 "reference-architectures/nvl72-ai-factory): 4 ConnectX-8 (800 Gb/s) per 4-GPU "
                 "tray, i.e. 100 GB/s per GPU per direction", _C2C, _TF32)),
}


def get_profile(name: str) -> HardwareProfile:
    """The profile named `name` (case-insensitive); raises ValueError listing known names."""
    key = name.lower()
    if key not in PROFILES:
        raise ValueError(f"hardware={name!r} is unknown; known profiles: {sorted(PROFILES)} "
                         "(or measure this machine with `dropless plan --calibrate`)")
    return PROFILES[key]


PRECISIONS = ("bf16", "bfloat16", "float16", "fp8", "mxfp8", "float32", "tf32")


def peak_for(hw: HardwareProfile, precision: str) -> float | None:
    """Peak FLOP/s for a precision: 'bf16'/'bfloat16'/'float16', 'fp8'/'mxfp8', or
    'float32'/'tf32' (None when the profile has no TF32 figure). Raises ValueError otherwise."""
    if precision in ("bf16", "bfloat16", "float16"):
        return hw.peak_bf16
    if precision in ("fp8", "mxfp8"):
        return hw.peak_fp8
    if precision in ("float32", "tf32"):
        return hw.peak_tf32
    raise ValueError(f"precision={precision!r} must be one of {PRECISIONS}")


def profile_for_device(device_kind: str) -> HardwareProfile | None:
    """The profile of a GPU by its jax `device_kind` ('NVIDIA H100 80GB HBM3' -> h100), or None.
    Longer names match first, so 'NVIDIA GB200' is gb200, not b200."""
    kind = device_kind.lower()
    for name in sorted(PROFILES, key=len, reverse=True):
        if name in kind:
            return PROFILES[name]
    return None


def device_peak_flops(device_kind: str, precision: str) -> float | None:
    """Dense peak FLOP/s of a GPU by its jax device_kind (e.g. 'NVIDIA H100 80GB HBM3') for a
    dtype name ('float32' = TF32, 'bfloat16', 'fp8', 'mxfp8'), from PROFILES; None for an
    unknown device or precision."""
    hw = profile_for_device(device_kind)
    if hw is None:
        return None
    try:
        return peak_for(hw, precision)
    except ValueError:
        return None


# ---- this host: CPU model, contention, timing, the CPU peak, what a record came from ----

CPU_MODEL_KEYS = ("model name", "Model", "cpu model")   # x86, ARM (Raspberry Pi), MIPS/others


def parse_cpu_model(cpuinfo: str) -> str | None:
    """The CPU model name in the text of /proc/cpuinfo: the first line starting with one of
    CPU_MODEL_KEYS ('model name\t: Intel(R) Xeon(R) ...' -> 'Intel(R) Xeon(R) ...'), or None."""
    for line in cpuinfo.splitlines():
        if line.startswith(CPU_MODEL_KEYS) and ":" in line:
            return line.split(":", 1)[1].strip()
    return None


def cpu_model(cpuinfo_path: str = "/proc/cpuinfo") -> str:
    """This machine's CPU model name (/proc/cpuinfo on Linux, platform.processor() elsewhere)."""
    try:
        with open(cpuinfo_path) as fh:
            name = parse_cpu_model(fh.read())
        if name:
            return name
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown-cpu"


def _cpu_times() -> tuple[int, int]:
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields), idle


def busy_fraction(seconds: float = 0.5) -> float | None:
    """Share of all cores busy over `seconds` while we sleep: others' load (None off Linux)."""
    try:
        t0, i0 = _cpu_times()
        time.sleep(seconds)
        t1, i1 = _cpu_times()
    except OSError:
        return None
    return round(1.0 - (i1 - i0) / max(t1 - t0, 1), 3)


def _block(out: Any) -> None:
    import jax
    jax.block_until_ready(out)


def time_interleaved(fns: Mapping[str, Callable[[], Any]], *, repeats: int = 5,
                     warmup: int = 1) -> dict[str, dict[str, float]]:
    """Time each zero-argument callable `repeats` times, round-robin (on a machine whose speed
    swings, every candidate sees the same swings), after `warmup` calls each. Each round starts
    one candidate further on (A B C, B C A, C A B, ...), so no candidate always runs right after
    the same other one (whose threads, caches and freed memory it would otherwise always meet).

    Returns {name: {"median_ms", "min_ms", "max_ms", "compile_ms", "page_faults"}}; compile_ms
    is the first call (compilation plus one run); page_faults is the median count of the
    process's minor page faults a timed call (fresh memory the call touched, 4 KiB or 2 MiB at a
    time; runtime.host_memory), where the platform counts them.
    """
    stats: dict[str, dict[str, float]] = {}
    for name, fn in fns.items():
        t = time.perf_counter()
        _block(fn())
        stats[name] = {"compile_ms": (time.perf_counter() - t) * 1e3}
        for _ in range(warmup - 1):
            _block(fn())
    samples: dict[str, list[float]] = {name: [] for name in fns}
    faults: dict[str, list[int]] = {name: [] for name in fns}
    order = list(fns)
    for round_ in range(repeats):
        start = round_ % len(order)
        for name in order[start:] + order[:start]:
            fn = fns[name]
            f = _minor_faults()
            t = time.perf_counter()
            _block(fn())
            samples[name].append((time.perf_counter() - t) * 1e3)
            faults[name].append(_minor_faults() - f)
    for name, s in samples.items():
        stats[name].update(median_ms=statistics.median(s), min_ms=min(s), max_ms=max(s))
        if _minor_faults() >= 0:
            stats[name]["page_faults"] = statistics.median(faults[name])
    return stats


def _minor_faults() -> int:
    """The process's minor page faults so far (getrusage); -1 where there is no count."""
    try:
        import resource
    except ImportError:   # not a POSIX system
        return -1
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _git_commit() -> str:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, text=True,
                              capture_output=True, timeout=5).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine_info() -> dict[str, Any]:
    """What the numbers came from: commit, versions, processor, cores, JAX device, and how the
    host's malloc runs (runtime.host_memory.mode())."""
    import jax
    import jaxlib

    from dropless.runtime import host_memory
    dev = jax.devices()[0]
    return {"git_commit": _git_commit(), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "cpu": cpu_model(), "cores": os.cpu_count(), "platform": dev.platform,
            "device_kind": dev.device_kind, "device_count": jax.device_count(),
            "host_malloc": host_memory.mode()}


# Set to a number (FLOP/s for the whole CPU) to use it instead of the cached measurement.
CPU_PEAK_ENV = "DROPLESS_CPU_PEAK_FLOPS"


def measure_cpu_peak(dtype: str = "float32", size: int = 1024, repeats: int = 10) -> float:
    """Best-of-N FLOP/s of one jitted size^3 matmul on the default device (XLA:CPU spreads one
    matmul over every core, so this is the whole machine's rate)."""
    import jax
    import jax.numpy as jnp
    a = jnp.ones((size, size), dtype)
    f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    f(a, a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(a, a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2.0 * size ** 3 / best


def user_cache_dir() -> Path:
    """dropless's folder of per-user caches: $XDG_CACHE_HOME/dropless, else ~/.cache/dropless."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dropless"


def cpu_peak_flops(dtype: str = "float32", *, cache_dir: str | Path | None = None,
                   measure: Callable[[str], float] = measure_cpu_peak) -> tuple[float, str]:
    """The CPU peak MFU divides by: (FLOP/s for the whole machine, where it came from).

    Measured once per (CPU model, usable cores, dtype) with `measure` and cached as one JSON
    file per key in `cache_dir` (default `$XDG_CACHE_HOME/dropless/cpu_peak`, else
    `~/.cache/dropless/cpu_peak`); every later run reads the cached figure, so two runs on one
    machine divide by the same number. The file is created atomically and exclusively, so when
    two processes measure at once the first one's figure is what both use. `$DROPLESS_CPU_PEAK_
    FLOPS` overrides the cache. Delete the file to measure again (e.g. after a first measurement
    on a busy machine). Raises ValueError for a non-numeric or non-positive override.
    """
    env = os.environ.get(CPU_PEAK_ENV)
    if env:
        try:
            value = float(env)
        except ValueError:
            raise ValueError(f"{CPU_PEAK_ENV}={env!r} must be a number of FLOP/s") from None
        if not value > 0:
            raise ValueError(f"{CPU_PEAK_ENV}={env!r} must be > 0")
        return value, f"${CPU_PEAK_ENV}"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    key = f"{cpu_model()} | {cores} cores | {dtype}"
    folder = Path(cache_dir) if cache_dir is not None else user_cache_dir() / "cpu_peak"
    slug = "".join(c if c.isalnum() else "_" for c in key)[:80]
    file = folder / f"{slug}-{hashlib.sha1(key.encode()).hexdigest()[:10]}.json"
    entry = _read_entry(file, key)
    if entry is None:
        folder.mkdir(parents=True, exist_ok=True)
        new = {"key": key, "flops": measure(dtype),
               "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "how": "best of 10 jitted "
               "1024^3 matmuls on one device"}
        tmp = file.with_name(f".{file.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(new, indent=1))
        try:
            os.link(tmp, file)          # fails if another run got there first: keep theirs
        except FileExistsError:
            if _read_entry(file, key) is None:   # unreadable leftover: replace it
                os.replace(tmp, file)
        tmp.unlink(missing_ok=True)
        entry = _read_entry(file, key) or new
    return float(entry["flops"]), f"CPU matmul peak measured {entry['measured']}, cached in {file}"


def _read_entry(file: Path, key: str) -> dict | None:
    try:
        entry = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(entry, dict) and entry.get("key") == key and \
        isinstance(entry.get("flops"), (int, float)) and entry["flops"] > 0
    return entry if ok else None


def peak_flops_per_device(dtype: str) -> tuple[float | None, str]:
    """(peak FLOP/s per device for MFU, where it came from) for jax's default devices: the
    profile table on GPUs (None for an unknown GPU), the cached CPU peak shared by the host
    devices on CPU."""
    import jax
    dev = jax.devices()[0]
    if dev.platform == "cpu":
        peak, how = cpu_peak_flops(dtype)
        return peak / max(1, jax.device_count()), how
    return device_peak_flops(dev.device_kind, dtype), f"table: {dev.device_kind}"
