"""Accelerator profiles: peak FLOPS, memory, link bandwidths, NVLink domain size, with sources.

All bandwidths are per GPU, per direction, in bytes/s (NVIDIA quotes NVLink bidirectional:
"900 GB/s" NVLink 4 is 450 GB/s each way). Peaks are dense (no 2:4 sparsity) tensor-core FLOPS.

The `*_efficiency` fields are *assumptions*, not datasheet numbers: the fraction of peak a good
kernel reaches on the large shapes of MoE training (dense GEMM, grouped GEMM, flash attention)
and the fraction of link bandwidth a collective reaches (NCCL bus bandwidth). They are the knobs
to change when a measurement disagrees; docs/planning.md says where the defaults come from.
"""
from __future__ import annotations

import dataclasses

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
