"""Check Pallas/Triton kernels the way XLA and the GPU toolchain will, on a host without a GPU.

Three steps, each usable alone:
  cuda_lowered(fn, *args)      lower a jitted function for CUDA, with an abstract H200 as the
                               target where the JAX version asks for one (jax >= 0.11's Pallas
                               Triton lowering reads the target GPU: `get_gpu_info`)
  triton_kernels(lowered)      every `__gpu$xla.gpu.triton` custom call: name, the serialized
                               Triton module, warps, stages, grid
  verify(kernel)               parse the module with the Triton dialect registered, as XLA's
                               Triton emitter does before compiling it; raises on invalid IR
  compile_sm90(kernel)         (optional `triton` package) triton's make_ttir passes, as XLA
                               runs them, then triton's compiler for cuda:90 at the kernel's
                               own warps/stages, and `ptxas -v` (the wheel ships it) for
                               registers, spills and shared memory
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import subprocess
import tempfile

import jax

TRITON_TARGET = "__gpu$xla.gpu.triton"
H200_KIND = "NVIDIA H200"
H200_SMS = 132


def abstract_gpu_mesh(device_kind: str = H200_KIND, num_cores: int = H200_SMS):
    """A one-device `AbstractMesh` whose device is an abstract NVIDIA GPU."""
    dev = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=num_cores,
                                      platform="gpu")
    # Auto, not jax >= 0.11's default Explicit: explicit sharding would make ops such as
    # ragged_dot ask for out_sharding; the mesh is here only to name the target device
    return jax.sharding.AbstractMesh((1,), ("gpu_target",),
                                     axis_types=(jax.sharding.AxisType.Auto,),
                                     abstract_device=dev)


@contextlib.contextmanager
def abstract_gpu_target(device_kind: str = H200_KIND):
    """Lower inside this to target an abstract GPU (a no-op need on jax 0.10, harmless)."""
    with jax.sharding.use_abstract_mesh(abstract_gpu_mesh(device_kind)):
        yield


def cuda_lowered(fn, *args, device_kind: str = H200_KIND):
    """`jax.jit(fn)` traced on `args` (arrays or ShapeDtypeStructs) and lowered for CUDA."""
    with abstract_gpu_target(device_kind):   # at trace time too: jax keeps it in the trace
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


@dataclasses.dataclass(frozen=True)
class TritonKernel:
    """One serialized Triton kernel of a lowered module."""

    name: str
    ir: bytes           # MLIR bytecode of the Triton module, as XLA receives it
    num_warps: int
    num_stages: int
    grid: tuple[int, int, int]


def triton_kernels(lowered) -> list[TritonKernel]:
    """Every Triton custom call in a `jax.stages.Lowered`, in module order."""
    from jaxlib.mlir import ir  # noqa: PLC0415 (jaxlib internals: only here)
    module = lowered.compiler_ir("stablehlo")
    found = []

    def visit(op):
        op = op.operation if hasattr(op, "operation") else op
        if op.name == "stablehlo.custom_call" and \
                ir.StringAttr(op.attributes["call_target_name"]).value == TRITON_TARGET:
            cfg = ir.DictAttr(op.attributes["mhlo.backend_config"])
            num = lambda key: ir.IntegerAttr(cfg[key]).value  # noqa: E731
            found.append(TritonKernel(
                name=ir.StringAttr(cfg["name"]).value, ir=ir.StringAttr(cfg["ir"]).value_bytes,
                num_warps=num("num_warps"), num_stages=num("num_stages"),
                grid=(num("grid_x"), num("grid_y"), num("grid_z"))))
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    return found


def verify(kernel: TritonKernel) -> str:
    """Parse and verify the kernel's Triton module; return its text. Raises ValueError with
    MLIR's diagnostic (e.g. "'scf.for' op failed to verify ...") if XLA would reject it."""
    from jax._src.interpreters import mlir as jax_mlir  # noqa: PLC0415
    from jaxlib.mlir import ir  # noqa: PLC0415
    from jaxlib.mlir._mlir_libs import _triton_ext  # noqa: PLC0415
    ctx = jax_mlir.make_ir_context()
    _triton_ext.register_dialect(ctx)
    with ctx:
        try:
            module = ir.Module.parse(kernel.ir)
        except Exception as e:  # noqa: BLE001 (MLIR raises its own error types)
            raise ValueError(f"Triton kernel {kernel.name}: {e}") from e
        if not module.operation.verify():
            raise ValueError(f"Triton kernel {kernel.name}: module does not verify")
        return module.operation.get_asm(enable_debug_info=False)


@dataclasses.dataclass(frozen=True)
class Sm90Build:
    """What the sm_90a build of a kernel uses (ptxas -v and triton's metadata)."""

    name: str
    registers: int
    spill_bytes: int     # spill stores + spill loads
    shared_bytes: int    # triton's shared-memory allocation for one block
    wgmma: bool          # the PTX uses Hopper's warpgroup MMA


def triton_available() -> str | None:
    """None if the `triton` compiler package is importable, else why not."""
    try:
        import triton  # noqa: F401, PLC0415
        from triton.backends.compiler import GPUTarget  # noqa: F401, PLC0415
    except Exception as e:  # noqa: BLE001 (any import failure means: cannot compile here)
        return f"triton is not importable ({type(e).__name__}: {e})"
    return None


def _ptxas() -> str:
    import triton  # noqa: PLC0415
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    return path if os.path.exists(path) else "ptxas"


def compile_sm90(kernel: TritonKernel, workdir: str | None = None) -> Sm90Build:
    """Compile the kernel for cuda:90 with triton's compiler and read `ptxas -v`.

    Raises ImportError if triton is missing, RuntimeError if triton or ptxas fails.
    """
    import triton  # noqa: PLC0415
    from triton._C.libtriton import ir as tir  # noqa: PLC0415
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415
    from triton.compiler.compiler import make_backend  # noqa: PLC0415
    text = verify(kernel)
    workdir = workdir or tempfile.mkdtemp(prefix="dropless_sm90_")
    path = os.path.join(workdir, f"{kernel.name}.ttir")
    with open(path, "w") as f:
        f.write(text)
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    opts = backend.parse_options(dict(num_warps=kernel.num_warps, num_stages=kernel.num_stages))
    ctx = tir.context()
    tir.load_dialects(ctx)
    backend.load_dialects(ctx)
    module = tir.parse_mlir_module(path, ctx)
    module.context = ctx
    backend.make_ttir(module, {}, opts, 90)   # XLA runs these before lowering to TTGIR
    with open(path, "w") as f:
        f.write(str(module))
    try:
        compiled = triton.compile(path, target=target, options=dict(
            num_warps=kernel.num_warps, num_stages=kernel.num_stages))
    except Exception as e:  # noqa: BLE001
        raise RuntimeError(f"triton failed to compile {kernel.name} for cuda:90: {e}") from e
    ptx = compiled.asm["ptx"]
    ptx_path = path + ".ptx"
    with open(ptx_path, "w") as f:
        f.write(ptx)
    run = subprocess.run([_ptxas(), "-v", "--gpu-name=sm_90a", ptx_path, "-o", path + ".cubin"],
                         capture_output=True, text=True, check=False)
    if run.returncode:
        raise RuntimeError(f"ptxas failed on {kernel.name}: {run.stderr.strip()[-400:]}")
    regs = re.findall(r"Used (\d+) registers", run.stderr)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", run.stderr)
    if not regs or not spills:
        raise RuntimeError(f"no register report from ptxas -v for {kernel.name}: "
                           f"{run.stderr.strip()[-400:]}")
    return Sm90Build(name=kernel.name, registers=max(int(r) for r in regs),
                     spill_bytes=sum(int(a) + int(b) for a, b in spills),
                     shared_bytes=int(compiled.metadata.shared),
                     wgmma="wgmma.mma_async" in ptx)
