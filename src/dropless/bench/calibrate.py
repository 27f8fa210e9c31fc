"""Calibrate the step-time model against this machine.

A profile of this machine is measured with micro-benchmarks, every device busy at once: dense
and grouped matmul forward+backward rates at the run's shapes (timed in isolation, as the
trainer does at start-up), elementwise memory bandwidth, the all-reduce bandwidth and latency
between host devices. The planner, fed that profile, predicts a different workload, which is
then timed:

  `train_step`: one step of `dropless train` (the trainer's jitted `train_step`: forward,
  backward, AdamW, bias update) for the tiny preset, data-parallel as the trainer places it;
  `moe_layer`: the MoE layer (router, sort, grouped-matmul SwiGLU, combine, shared expert)
  forward + backward under `jax.grad`, data-parallel over N host devices with `shard_map` (each
  device runs its tokens with replicated weights; the weight gradients are all-reduced).

Micro-benchmarks and the workload are timed interleaved in one process (A, B, A, B, ...) so
that the ~2x speed swings of a shared CPU hit both alike. On CPU the collectives run on the
same cores as the compute, so the profile overlaps nothing (overlap_cost = 1).
"""
from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dropless.machine import HardwareProfile, busy_fraction, machine_info, time_interleaved
from dropless.text_table import format_table
from dropless.plan.layout import PlanConfig
from dropless.plan.model import layer_times
from dropless.config import MeshConfig, ModelConfig, MoEConfig, TrainConfig

# The calibration workload: big enough that matmuls, not dispatch overheads, dominate.
WORKLOAD = dict(d_model=256, moe_d_ff=512, num_experts=8, top_k=2, num_shared_experts=1)
TOKENS_PER_DEVICE = 1024
SEQ = 256
_ELEMS = 4 * 2 ** 20        # elementwise micro-benchmark: f32 elements per device
_AR_ELEMS = 2 ** 20         # all-reduce micro-benchmark: f32 elements per device


def check_devices(n: int) -> None:
    """`n` devices to calibrate on exist in this process. Starts JAX's backend to count them
    (jax.devices(), which the calibration's mesh reads anyway; well under a second on CPU), so
    the count is the one the run would get whatever set it: XLA_FLAGS'
    --xla_force_host_platform_device_count, jax_num_cpu_devices, or a GPU backend. Raises
    ValueError naming the count and how to get more."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"calibration devices={n!r} (--calibrate-devices) must be an int >= 1")
    have = len(jax.devices())
    if n > have:
        raise ValueError(f"calibration devices={n} (--calibrate-devices) but this process has "
                         f"{have} JAX device(s): calibrate on at most {have}, or on CPU start "
                         f"it with XLA_FLAGS=--xla_force_host_platform_device_count={n}")


def _mesh(n: int) -> Mesh:
    check_devices(n)
    return Mesh(np.array(jax.devices()[:n]), ("d",))


def _per_device(mesh: Mesh, fn, in_specs, out_specs):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                                 check_vma=False))


def kernel_shapes(cfg: PlanConfig) -> tuple[tuple, tuple]:
    """The matmul shapes a run is made of, timed in isolation as the trainer does at start-up:
    the dense feed-forward (T, D, Fd) and the routed experts' up projection (T*K, D, F, E/ep)
    (the down projection is timed transposed: (T*K, F, D, E/ep))."""
    s, m, t = cfg.model, cfg.moe, cfg.micro_tokens_per_device
    gmm = ((t * m.top_k, s.d_model, m.d_ff, m.num_experts // cfg.mesh.expert) if m is not None
           else None)
    return (t, s.d_model, s.d_ff), gmm


def micro_benchmarks(mesh: Mesh, mm_shape: tuple, gmm_shape: tuple | None
                     ) -> dict[str, tuple[Any, float, str]]:
    """name -> (zero-arg callable, work per call per device, unit). All devices run at once.

    Matmuls are timed forward + backward at the run's shapes (`kernel_shapes`); memory, links
    and links at fixed sizes.
    """
    from dropless.ops import grouped_matmul
    n = mesh.size
    key = jax.random.key(0)
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
    mm_m, mm_k, mm_n = mm_shape
    a = put(jax.random.normal(key, (n * mm_m, mm_k)), P("d"))
    b = put(jax.random.normal(key, (mm_k, mm_n)) / math.sqrt(mm_k), P())

    def mm_train(a, b):
        return jax.grad(lambda a, b: jnp.sum((a @ b) ** 2), argnums=(0, 1))(a, b)[0]
    mm = _per_device(mesh, mm_train, (P("d"), P()), P("d"))
    m, k, nn, g = gmm_shape or (mm_m, mm_k, mm_n, 1)
    gs = jnp.full((g,), m // g, jnp.int32)
    gmm_args = []
    for kk, nk in ((k, nn), (nn, k)):     # up (D -> F) and down (F -> D)
        gmm_args.append((put(jax.random.normal(key, (n * m, kk)), P("d")),
                         put(jax.random.normal(key, (g, kk, nk)) / math.sqrt(kk), P())))

    def gmm_train(lhs, rhs):
        f = lambda l, r: jnp.sum(grouped_matmul(l, r, gs) ** 2)
        return jax.grad(f, argnums=(0, 1))(lhs, rhs)[0]
    gmm = _per_device(mesh, gmm_train, (P("d"), P()), P("d"))

    def gmm_pair():   # 2 up-shaped + 1 down-shaped, as SwiGLU has
        return [gmm(*gmm_args[0]), gmm(*gmm_args[0]), gmm(*gmm_args[1])]
    x = put(jnp.ones((n * _ELEMS,), jnp.float32), P("d"))
    ew = _per_device(mesh, lambda x: x * 1.5 + 1.0, P("d"), P("d"))
    y = put(jnp.ones((n * _AR_ELEMS,), jnp.float32), P("d"))
    ar = _per_device(mesh, lambda y: jax.lax.psum(y, "d"), P("d"), P("d"))
    z = put(jnp.ones((n * 8,), jnp.float32), P("d"))
    lat = _per_device(mesh, lambda z: jax.lax.psum(z, "d"), P("d"), P("d"))
    out = {"matmul": (lambda: mm(a, b), 3 * 2.0 * mm_m * mm_k * mm_n, "flop"),
           "gmm_train": (gmm_pair, 3 * 3 * 2.0 * m * k * nn, "flop"),
           "elementwise": (lambda: ew(x), 2 * 4.0 * _ELEMS, "byte")}
    if n > 1:
        out["allreduce"] = (lambda: ar(y), 2.0 * (n - 1) / n * 4 * _AR_ELEMS, "byte")
        out["latency"] = (lambda: lat(z), 1.0, "call")
    return out


def moe_workload(mesh: Mesh):
    """The timed workload: MoE layer forward + backward, data-parallel over the mesh."""
    from dropless.moe import apply, init_params
    w = WORKLOAD
    cfg = _workload_plan(1).moe   # the layer the planner predicts, timed as it is
    params = jax.device_put(init_params(jax.random.key(0), cfg), NamedSharding(mesh, P()))
    n = mesh.size
    x = jax.device_put(jax.random.normal(jax.random.key(1), (n * TOKENS_PER_DEVICE,
                                                             w["d_model"])),
                       NamedSharding(mesh, P("d")))

    def step(params, x):
        loss = lambda p, x: jnp.mean(apply(p, x.reshape(-1, SEQ, w["d_model"]), cfg)[0] ** 2)
        grads = jax.grad(loss)(params, x)
        return jax.lax.pmean(grads, "d")
    fn = _per_device(mesh, step, (P(), P("d")), P())
    return lambda: fn(params, x)


TRAIN_PRESET = "tiny"
TRAIN_BATCH = 4            # per device
TRAIN_SEQ = 256


def _train_config(n: int):
    from dropless.config_file import build_config
    items = [("preset", TRAIN_PRESET), ("per_device_batch_size", TRAIN_BATCH),
             ("seq_len", TRAIN_SEQ)]
    if n > 1:
        items.append(("ici_data_parallelism", n))
    return build_config(items)


def train_workload(mesh: Mesh):
    """The timed workload: one `dropless train` step (the trainer's jitted `train_step`:
    forward, backward, AdamW, bias update) of the tiny preset, data-parallel over the mesh's
    devices exactly as the trainer places it."""
    import functools
    from dropless.parallel.mesh import batch_sharding, train_mesh
    from dropless.parallel.sharding import state_shardings
    from dropless.train import step as step_lib
    n = mesh.size
    cfg = _train_config(n)
    state, opt = step_lib.init_state(cfg)
    tmesh = train_mesh(cfg.mesh)
    shard = state_shardings(state, tmesh)
    if shard is not None:
        state = jax.device_put(state, shard)
    batch = np.random.default_rng(0).integers(0, cfg.model.vocab_size,
                                              (cfg.global_batch_size, cfg.seq_len + 1),
                                              dtype=np.int32)
    bshard = batch_sharding(tmesh)
    batch = jax.device_put(batch, bshard) if bshard is not None else jnp.asarray(batch)
    fn = jax.jit(functools.partial(step_lib.train_step, cfg=cfg, opt=opt,
                                   mesh=tmesh))
    return lambda: fn(state, batch)


def _train_plan(n: int) -> PlanConfig:
    return PlanConfig(run=_train_config(n), optimizer_dtype="float32", overlap="none",
                      gmm_tile=1, attention_impl="naive")


def profile_from(rates: dict[str, float], n: int) -> HardwareProfile:
    """A HardwareProfile of this machine from measured rates: the peak is the best measured
    matmul rate, the efficiencies are the measured rates over it (memory and links at 1: the
    measured rates are already the achievable ones)."""
    peak = max(rates["matmul"], rates["gmm_train"])
    bw = rates.get("allreduce", 1e12)
    gemm, gmm = rates["matmul"] / peak, rates["gmm_train"] / peak
    return HardwareProfile(
        name=f"cpu-{n}", peak_bf16=peak, peak_fp8=peak, hbm_bytes=_ram_bytes(),
        hbm_bw=rates["elementwise"], nvlink_bw=bw, ib_bw=bw, host_bw=rates["elementwise"],
        gpus_per_domain=n, gemm_efficiency=gemm, gmm_efficiency=gmm, fp8_efficiency=gmm,
        attention_efficiency=gemm, link_efficiency=1.0, hbm_efficiency=1.0,
        nvlink_latency_s=max(rates.get("latency_s", 1e-6), 1e-9),
        ib_latency_s=1e-6, overlap_cost=1.0, usable_memory_fraction=0.9,
        sources=("measured at start-up by dropless.bench.calibrate",))


def _ram_bytes() -> float:
    try:
        with open("/proc/meminfo") as f:
            return float(f.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 8e9


def _workload_plan(n: int) -> PlanConfig:
    w = WORKLOAD
    moe = MoEConfig(num_experts=w["num_experts"], top_k=w["top_k"], d_model=w["d_model"],
                    d_ff=w["moe_d_ff"], num_shared_experts=w["num_shared_experts"])
    s = ModelConfig(vocab_size=2, d_model=w["d_model"], num_layers=1, num_heads=1,
                    d_ff=w["moe_d_ff"], attention="mha", moe=moe,
                    dtype="float32", weight_dtype="float32")
    run = TrainConfig(model=s, mesh=MeshConfig(data=n),
                      per_device_batch_size=TOKENS_PER_DEVICE // SEQ, seq_len=SEQ, remat="none")
    return PlanConfig(run=run, overlap="none", gmm_tile=1)


def layer_parts(hw: HardwareProfile, n: int) -> dict[str, float]:
    """The planner's seconds per part for `moe_workload` on n devices: the MoE block of one
    layer, data-parallel, f32, everything kept for backward, nothing overlapped."""
    cfg = _workload_plan(n)
    return {k: v for k, v in layer_times(cfg, hw, True, attention=False).items() if v}


def train_parts(hw: HardwareProfile, n: int) -> dict[str, float]:
    """The planner's seconds per part (exposed) for one `train_workload` step on n devices."""
    from dropless.plan.model import predict
    exposed = predict(_train_plan(n), hw, name=TRAIN_PRESET)["time"]["exposed_s"]
    return {k: v for k, v in exposed.items() if v}


WORKLOADS = {"moe_layer": (moe_workload, layer_parts,
                           "MoE layer forward+backward (D={d_model}, F={moe_d_ff}, "
                           "E={num_experts}, top-{top_k}, {num_shared_experts} shared, "
                           f"{TOKENS_PER_DEVICE} tokens/device, f32)".format(**WORKLOAD)),
             "train_step": (train_workload, train_parts,
                            f"`dropless train` step, preset {TRAIN_PRESET}, per-device batch "
                            f"{TRAIN_BATCH} x {TRAIN_SEQ}")}


def calibrate(n: int, *, workload: str = "train_step", repeats: int = 7) -> dict[str, Any]:
    """Measure the profile and the workload on n devices (interleaved); predict; compare."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload={workload!r} must be one of {tuple(WORKLOADS)}")
    make, parts_fn, _ = WORKLOADS[workload]
    mesh = _mesh(n)
    plan = (_train_plan if workload == "train_step" else _workload_plan)(n)
    mm_shape, gmm_shape = kernel_shapes(plan)
    micro = micro_benchmarks(mesh, mm_shape, gmm_shape)
    fns = {k: v[0] for k, v in micro.items()}
    fns["workload"] = make(mesh)
    stats = time_interleaved(fns, repeats=repeats, warmup=2)
    out = {"devices": n, "workload": workload}
    for stat in ("median_ms", "min_ms"):   # min: the contention-robust view of a shared CPU
        rates = {k: micro[k][1] / (stats[k][stat] / 1e3) for k in micro if k != "latency"}
        if "latency" in stats:
            rates["latency_s"] = stats["latency"][stat] / 1e3
        hw = profile_from(rates, n)
        parts = parts_fn(hw, n)
        measured = stats["workload"][stat] / 1e3
        tag = "" if stat == "median_ms" else "_min"
        out.update({f"predicted{tag}_s": sum(parts.values()), f"measured{tag}_s": measured,
                    f"error{tag}": sum(parts.values()) / measured - 1.0, f"rates{tag}": rates,
                    f"parts{tag}_s": parts})
    out.update(measured_max_s=stats["workload"]["max_ms"] / 1e3,
               compile_s=stats["workload"]["compile_ms"] / 1e3,
               kernel_shapes={"dense": mm_shape, "grouped": gmm_shape})
    return out


def run_calibration(devices: int = 8, *, workload: str = "train_step", repeats: int = 7
                    ) -> dict[str, Any]:
    """Calibrate on 1 and `devices` host devices; the result holds the records and a text.
    Raises ValueError (`check_devices`) before any measurement when `devices` do not exist."""
    check_devices(devices)
    busy = busy_fraction()
    records = []
    for n in sorted({1, devices}):
        r = calibrate(n, workload=workload, repeats=repeats)
        r.update(machine_info(), busy_fraction_before=busy, busy_fraction_after=busy_fraction())
        records.append(r)
    rows = [{"devices": r["devices"], "predicted_ms": 1e3 * r["predicted_s"],
             "measured_ms": 1e3 * r["measured_s"], "error": f"{100 * r['error']:+.1f}%",
             "error_of_mins": f"{100 * r['error_min']:+.1f}%",
             "gemm_GFLOPs": r["rates"]["matmul"] / 1e9,
             "gmm_GFLOPs": r["rates"]["gmm_train"] / 1e9,
             "mem_GBs": r["rates"]["elementwise"] / 1e9,
             "link_GBs": r["rates"].get("allreduce", 0.0) / 1e9} for r in records]
    text = (f"Calibration: {WORKLOADS[workload][2]}, data-parallel over host devices; "
            f"busy fraction before: {busy}\n")
    text += format_table(rows, ["devices", "predicted_ms", "measured_ms", "error", "error_of_mins",
                                "gemm_GFLOPs", "gmm_GFLOPs", "mem_GBs", "link_GBs"])
    return {"records": records, "text": text}
