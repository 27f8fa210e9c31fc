"""Pre-flight: refuse a training config that cannot fit in device memory, before any allocation.

Two ways to know the bytes a step needs, and every report names the one used:
  * `compiled`: XLA's `memory_analysis()` of the compiled train step (`analysis`: arguments +
    outputs - aliased (the donated state) + temporaries + code), compiled on abstract inputs,
    so nothing is allocated. The trainer (train/loop.py) reads it from the one compile of the
    step it runs (guards, mesh, donation, the grouped-matmul kernel fallbacks), made before the
    state is initialised, a checkpoint restored or a resumed run's directory touched, and runs
    that executable: `check(cfg, executable=...)`. It does so on a GPU, on one device or a mesh
    (`reads_compiled`; the platforms are `COMPILED_PLATFORMS`): the executable of a mesh's step
    is one device's program (XLA partitions it before the analysis), so its figures are one
    device's, as they are for compile-only devices. For H100/H200 compile-only
    devices (train/compile_only.py: `check(cfg, target="h100")`, which `dropless plan
    --compile-for` and the GPU leg's tests call) the step is compiled here alone (`compiled`):
    for one device, or for the config's mesh on one host (`target_devices`: N compile-only
    devices, topology 1x1xN; a mesh over several nodes, dcn_* > 1, is refused), with the
    trainer's mesh, state and batch placements and its dispatcher, the figures one device's.
    It holds the kernels `auto` picks in this process (the grouped matmul's Pallas/Mosaic
    kernels, lowered for the named GPU: `_gpu_target`) except one: cuDNN's flash attention is
    traced only with the cuDNN library loaded, which a compile-only process lacks, so the XLA
    attention runs there (its S x S scores over-state the step's temporaries: a fit there is a
    fit); the trainer's guards (check_nan, overflow) are left out (a few scalars a parameter).
  * `model`: the planner's memory model (`dropless.plan.memory.memory_per_device`, the same one
    `dropless plan` prints) applied to the trainer's layout: weights, gradients and Adam moments
    in the model's weight dtype (float32 moments), activations in the compute dtype, and the
    attention the run runs (`step.attention_kernel`): cuDNN's flash attention as the planner's
    `flash`, the XLA reference as `naive` (the S x S scores are materialised). The trainer
    checks it first thing, before the run directory is made or the data read, on a CPU. Not
    the compiled figure on a CPU: XLA:CPU's executable (other fusions, no cuDNN attention)
    says no more about a GPU's step than the model does, its limit (host RAM) is shared with
    the rest of the process, and the model refuses an oversized config in a second where the
    compiled figure needs the data read and the step compiled.
    The trainer's path is the same on every platform (one compile on abstract inputs, then
    allocate, then run that executable); tests/train/test_loop_compile.py runs it on a CPU with
    "cpu" in COMPILED_PLATFORMS.
The device's memory is what JAX reports (`bytes_limit`) on an accelerator, the kind's memory x
the profile's usable fraction (`machine.PROFILES[kind].usable_memory_fraction`) for a
compile-only device and, on a CPU, the host's RAM (or its cgroup limit) shared by the host
devices the mesh uses. DROPLESS_NO_PREFLIGHT=1 skips the check (the trainer still compiles its
step, once).
"""
from __future__ import annotations

import functools
import os
import time

from dropless.config import TrainConfig

GiB = 2 ** 30
COMPILED_PLATFORMS = ("gpu",)   # where the trainer reads its compiled step (module docstring)
_HINTS = {
    "parameters": "use a smaller model or shard it (mesh.fsdp, mesh.expert)",
    "gradients": "use a smaller model or shard it (mesh.fsdp, mesh.expert)",
    "grad_accumulator": "use a smaller model or shard it (mesh.fsdp, mesh.expert), or set "
                        "gradient_accumulation_steps=1 with a per_device_batch_size that fits",
    "optimizer_state": "use a smaller model or shard it (mesh.fsdp, mesh.expert)",
    "gathered_weights": "use a smaller model",
    "compute_weights": "use a smaller model or shard it (mesh.fsdp, mesh.expert)",
    "activations": "lower seq_len or per_device_batch_size (+ gradient_accumulation_steps), "
                   "or set remat=full",
    "layer_workspace": "lower seq_len or per_device_batch_size (+ gradient_accumulation_steps)",
    "logits": "set num_vocab_tiling (a divisor of seq_len), or lower seq_len or "
              "per_device_batch_size (+ gradient_accumulation_steps)",
    "ep_buffers": "lower per_device_batch_size",
}
PARTS = tuple(_HINTS)


class DoesNotFit(ValueError):
    """The config's estimated memory per device exceeds the device's memory."""


def _fmt(b: float) -> str:
    return f"{b / 2 ** 40:.1f} TiB" if b >= 2 ** 40 else f"{b / GiB:.2f} GiB"


def device_memory(cfg: TrainConfig) -> tuple[float, str]:
    """(bytes one device may use, where the number came from): `runtime.environment`'s on an
    accelerator; on a CPU the host's RAM shared by the host devices the run's mesh uses (one
    for the default mesh, however many host devices there are)."""
    import jax
    from dropless.runtime.environment import device_memory as measured
    from dropless.runtime.environment import format_bytes, host_memory
    if jax.local_devices()[0].platform != "cpu":
        return measured()
    ram, n = host_memory(), max(1, min(cfg.mesh.num_devices, jax.local_device_count()))
    return ram / n, f"host RAM {format_bytes(ram)}" + (f" / {n} host devices" if n > 1 else "")


def estimate(cfg: TrainConfig) -> dict[str, float]:
    """Bytes per device by part (the planner's terms) and their `total`."""
    from dropless.machine import PROFILES
    from dropless.plan.layout import DTYPE_BYTES, PlanConfig
    from dropless.plan.memory import memory_per_device
    m = cfg.model
    dt = lambda d: d if d in DTYPE_BYTES else "float32"   # noqa: E731 (float64 -> 4 bytes)
    run = cfg.replace(model=m.replace(dtype=dt(m.dtype), weight_dtype=dt(m.weight_dtype)))
    from dropless.train.step import attention_kernel
    impl = "flash" if attention_kernel(cfg) in ("cudnn", "cudnn_thd") else "naive"
    plan = PlanConfig(run=run, optimizer_dtype=dt(m.weight_dtype), attention_impl=impl)
    mem = memory_per_device(plan, PROFILES["h100"])  # hardware: only for `usable`
    return {k: float(mem[k]) for k in PARTS + ("total",)}


def compiled(cfg: TrainConfig, device, *, on_compiled=None) -> dict[str, float]:
    """Bytes the train step compiled for compile-only GPUs (train/compile_only.py) holds at once
    on one device, by XLA's memory analysis (`analysis`) and the compile's seconds: {"arguments",
    "outputs", "aliased", "temp", "code", "total", "compile_s"}. `device`: one compile-only GPU
    (a one-device step, as the trainer's on one device), or a tuple of cfg.mesh.num_devices of
    them (`target_devices`): the trainer's mesh over them, the state on `state_shardings`, the
    batch on `batch_sharding`, as the trainer places them. Nothing is allocated: the state and
    the batch are abstract. `on_compiled(executable)`, when given, is called with the compiled
    step (e.g. to read its HLO text). Raises what the compile raises."""
    import jax
    from dropless.train import step as step_lib
    t0 = time.perf_counter()
    devs = tuple(device) if isinstance(device, (tuple, list)) else (device,)
    like = jax.eval_shape(lambda: step_lib.init_state(cfg)[0])
    opt = step_lib.make_optimizer(cfg, like["params"])
    mesh, state, batch = _abstract_inputs(cfg, like, devs)
    fn = jax.jit(functools.partial(step_lib.train_step, cfg=cfg, opt=opt, mesh=mesh),
                 donate_argnums=0)
    with _gpu_target(cfg, mesh, devs):
        executable = fn.lower(state, batch).compile()
    if on_compiled is not None:
        on_compiled(executable)
    return {**analysis(executable), "compile_s": time.perf_counter() - t0}


def _abstract_inputs(cfg: TrainConfig, like, devs: tuple):
    """(mesh, state, batch) as the trainer places them (train/loop.py), on the devices `devs`:
    one device: no mesh, everything on it; several: `parallel.mesh.train_mesh`'s mesh over
    `devs`, the state on `state_shardings`, the [global batch, S + 1] tokens on
    `batch_sharding`."""
    import jax
    import jax.numpy as jnp
    from dropless.parallel.mesh import NodeMesh, batch_sharding, make_mesh
    from dropless.parallel.sharding import state_shardings
    if len(devs) == 1:
        mesh, one = None, jax.sharding.SingleDeviceSharding(devs[0])
        shard, bshard = jax.tree.map(lambda _: one, like), one
    else:
        mesh = NodeMesh(make_mesh(cfg.mesh, devs), devices_per_node=cfg.mesh.devices_per_node)
        shard, bshard = state_shardings(like, mesh), batch_sharding(mesh)
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                         like, shard)
    batch = jax.ShapeDtypeStruct((cfg.global_batch_size, cfg.seq_len + 1), jnp.int32,
                                 sharding=bshard)
    return mesh, state, batch


def _gpu_target(cfg: TrainConfig, mesh, devs: tuple):
    """The context the step is lowered in, so that the kernels' lowering (Pallas' Triton
    lowering, `ops.gmm.winners.device_kind`) knows the target GPU: they read the context's
    abstract mesh, else this process's default device (the CPU here). One device: an abstract
    one-device mesh naming its kind (`triton_check.abstract_gpu_target`), at trace time too.
    A mesh whose MoE layers run in the dispatcher's shard_map: none. The shard_map's mesh is of
    the compile-only GPUs and names them in its body, where every grouped matmul runs; a
    context mesh would make the dispatcher's probe of ragged_all_to_all fail (its own mesh is
    another), and `auto` dispatch would pick a2a, not the ragged_a2a the trainer runs on a
    GPU. A mesh with `dispatcher=local` (the grouped matmuls outside any shard_map): the
    mesh's own abstract mesh, which names the GPU."""
    import contextlib

    import jax
    from dropless.moe.dispatch.registry import LOCAL
    from dropless.ops.gpu.triton_check import abstract_gpu_target
    if mesh is None:
        return abstract_gpu_target(devs[0].device_kind)
    moe = cfg.model.moe
    if moe is not None and moe.dispatcher == LOCAL:
        return jax.sharding.use_abstract_mesh(mesh.mesh.abstract_mesh)
    return contextlib.nullcontext()


def target_devices(cfg: TrainConfig, kind: str):
    """The compile-only devices of `kind` `cfg`'s step is compiled for by `measure(target=)`:
    one device, or the tuple of the mesh's on one host (topology 1x1xN). Raises ValueError for
    a mesh over several nodes (mesh.dcn_* > 1) or over more devices than one host of `kind` has
    (`compile_only.HOST_GPUS`), and as `compile_only.devices` does."""
    from dropless.train.compile_only import HOST_GPUS, devices
    m = cfg.mesh
    if m.num_nodes > 1:
        raise ValueError(
            f"the compile-only pre-flight compiles a mesh on one host; this one spans "
            f"{m.num_nodes} nodes (mesh.dcn_data x mesh.dcn_fsdp x mesh.dcn_expert = "
            f"{' x '.join(map(str, m.dcn_shape))}): set the dcn_* sizes to 1 to check one "
            "node's layout")
    host = HOST_GPUS.get(kind, 1)
    if m.num_devices > host:
        raise ValueError(
            f"the compile-only pre-flight compiles a mesh on one host of at most {host} GPUs; "
            f"this one has {m.num_devices} (mesh.data x mesh.fsdp x mesh.expert = "
            f"{m.data} x {m.fsdp} x {m.expert}): check one node's layout (--gpus {host} or "
            "fewer)")
    devs = devices(kind, m.num_devices)
    return devs[0] if len(devs) == 1 else devs


def analysis(executable) -> dict[str, float]:
    """Bytes a compiled step (a jax.stages.Compiled) holds at once on its device, by XLA's
    memory analysis: {"arguments", "outputs", "aliased", "temp", "code", "total"}, total =
    arguments + outputs - aliased (the donated inputs the outputs reuse) + temp + code."""
    ma = executable.memory_analysis()
    out = {"arguments": float(ma.argument_size_in_bytes),
           "outputs": float(ma.output_size_in_bytes), "aliased": float(ma.alias_size_in_bytes),
           "temp": float(ma.temp_size_in_bytes),
           "code": float(ma.generated_code_size_in_bytes)}
    out["total"] = (out["arguments"] + out["outputs"] - out["aliased"] + out["temp"]
                    + out["code"])
    return out


def target_limit(kind: str) -> tuple[float, str]:
    """(usable bytes, where the number came from) of a compile-only device of `kind`."""
    from dropless.machine import PROFILES
    from dropless.train.compile_only import MEMORY_BYTES, NAMES
    frac = PROFILES[kind].usable_memory_fraction
    return (MEMORY_BYTES[kind] * frac,
            f"{NAMES[kind]} {_fmt(MEMORY_BYTES[kind])} x {frac} usable, compile-only")


def reads_compiled(cfg: TrainConfig) -> bool:
    """Whether the trainer checks `cfg` by its compiled step (`check(cfg, executable=...)`, at
    its one compile) rather than by the planner's model (`check(cfg)`, first thing): a platform
    in COMPILED_PLATFORMS, on one device or a mesh (one device's figures either way)."""
    import jax
    return jax.local_devices()[0].platform in COMPILED_PLATFORMS


def measure(cfg: TrainConfig, *, target: str | None = None, on_compiled=None,
            executable=None, compile_s: float | None = None) -> dict:
    """The bytes `cfg`'s step needs per device and how they were found: the estimate's parts
    plus "method" ("compiled" or "model"), "total", and with a compiled step its memory
    analysis ("compiled"). `executable`: the step the caller compiled for its device (the
    trainer's), read by `analysis` (`compile_s`: its compile seconds, kept in "compiled");
    `target`: else compile one here for compile-only H100s/H200s ("h100"/"h200"), one or the
    mesh's (`target_devices`; ValueError when the jax CUDA plugin is missing or the mesh spans
    several nodes), `on_compiled` passed to `compiled`. Neither: the planner's model, nothing
    compiled. Every figure is one device's."""
    est = estimate(cfg)
    est.update(method="model", model_total=est["total"])
    if executable is not None:
        c = {**analysis(executable), "compile_s": compile_s}
    elif target is not None:
        c = compiled(cfg, target_devices(cfg, target), on_compiled=on_compiled)
    else:
        return est
    return {**est, "method": "compiled", "total": c["total"], "compiled": c}


def check(cfg: TrainConfig, *, limit: float | None = None, source: str = "",
          target: str | None = None, on_compiled=None, executable=None,
          compile_s: float | None = None) -> dict:
    """`measure(cfg, ...)` with "limit" and "source" (the device's usable bytes and where that
    number came from), or DoesNotFit naming the method, the biggest term and what to change.
    Compiles nothing and checks nothing with DROPLESS_NO_PREFLIGHT=1. `on_compiled`: passed to
    `compiled` (called only where the step is compiled here, with `target`)."""
    if os.environ.get("DROPLESS_NO_PREFLIGHT") == "1":
        return {**estimate(cfg), "method": "skipped"}
    fit = measure(cfg, target=target, on_compiled=on_compiled, executable=executable,
                  compile_s=compile_s)
    if limit is None:
        limit, source = target_limit(target) if target else device_memory(cfg)
    fit.update(limit=limit, source=source)
    if fit["total"] <= limit:
        return fit
    big = max(PARTS, key=lambda k: fit[k])
    how = ("by the compiled step" if fit["method"] == "compiled"
           else "by the planner's memory model")
    raise DoesNotFit(
        f"per_device_batch_size={cfg.per_device_batch_size} x seq_len={cfg.seq_len} "
        f"(remat={cfg.remat}"
        + (f", gradient_accumulation_steps={cfg.gradient_accumulation_steps}"
           if cfg.gradient_accumulation_steps > 1 else "")
        + (f", mesh data={cfg.mesh.data} x fsdp={cfg.mesh.fsdp} x expert={cfg.mesh.expert}"
           if cfg.mesh.num_devices > 1 else "")
        + f") does not fit: {_fmt(fit['total'])} per device {how}, "
        f"{_fmt(limit)} available ({source}); the biggest term is {big} "
        f"({_fmt(fit[big])}). {_HINTS[big][0].upper() + _HINTS[big][1:]} "
        "(DROPLESS_NO_PREFLIGHT=1 skips the check)")


def summary(fit: dict) -> str:
    """One line for the trainer's start-up: the bytes, the limit, how they were found."""
    if fit.get("method") == "skipped":
        return "  memory pre-flight skipped (DROPLESS_NO_PREFLIGHT=1)"
    how = ("the compiled step's memory analysis" if fit["method"] == "compiled"
           else "the planner's memory model")
    spare = fit["limit"] - fit["total"]
    return (f"  memory: {_fmt(fit['total'])} per device of {_fmt(fit['limit'])} "
            f"({fit['source']}), {_fmt(spare)} to spare, by {how}")
