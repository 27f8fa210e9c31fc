"""`openblas`: a native CPU grouped GEMM (one GEMM per group, rows read in place) behind XLA's
FFI, float32, with the backward written out. Each group's GEMM is the library's own
register-tiled kernel in AVX-512 builds (native/grouped_gemm.cc), OpenBLAS's sgemm elsewhere.
DROPLESS_NATIVE_KERNEL=own|openblas, read when the library loads, forces one, and `use_kernel`
for a block; `describe()` and `gemm_calls()` say which ran.

Legend: M rows (sorted by group), K contraction dim, N output dim, G groups.

Why: XLA:CPU runs every dot of a `tiled` kernel through a fusion that copies the tile's rows and
the group's weights and the result (docs/grouped_matmul.md), and its dense f32 dot ran at about
half of OpenBLAS's rate on the 2-core AMD EPYC it was measured on. Here each group's product is
one GEMM on pointers into the operands, with the transposes done by flags:
  forward  out[rows of g] = lhs[rows of g] @ rhs[g]
  dlhs     dlhs[rows of g] = dy[rows of g] @ rhs[g]^T
  drhs     drhs[g] = lhs[rows of g]^T @ dy[rows of g]        (one GEMM, contraction = the rows)
Rows past the last group, and an empty group's weight gradient, are written as zeros without a
product, so a NaN stays in its own rows and group (the registry's rule for every backend).

`gather_rows`, `gather_sum` and `row_dots` (native/rows.cc) are the row gathers of the layer's
permute and combine (moe/permute.py runs them for float32 on CPU).

`swiglu_ffn` is the expert FFN down(silu(x @ gate) * (x @ up)) on this backend with the
elementwise steps done by the row task that produced them, while its rows are in cache (three
more handlers: gate_up_swiglu, swiglu_dlhs, dual_dlhs); the layer runs it for float32 on CPU
where `auto` would pick `openblas` for all three products (moe/experts.py).

The kernel (`native/grouped_gemm.cc`) is compiled the first time it is needed, with the system's
C++ compiler (or the `ziglang` package's, where there is none) against jaxlib's FFI headers and the
`scipy-openblas32` wheel, for this CPU (-march=native), into a cache folder keyed by everything the
binary depends on (`DROPLESS_CACHE`, default `~/.cache/dropless`); a finished build is moved into
place atomically, so concurrent processes never load a half-written file (an unwritable cache
folder: the temp folder). Where that cannot happen (no compiler, no wheel, a failed build)
`problem()` says why and `auto` uses `tiled`. Operands other than float32
(bf16, f16, or another output dtype) run `tiled`. The kernel is registered for the CPU only:
`backend="openblas"` in a function lowered for another platform raises one line saying so
(`cpu_only.py`); `auto` lowers its CPU branch only for the CPU.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dropless.ops.native.cpu_only import on_cpu_only
from dropless.ops.gmm.tiled import tiled_gmm

TARGET = "dropless_grouped_gemm_f32"
# what `backend="openblas"` (the grouped matmul, and the layer's fused FFN) raises when lowered
# for another platform (`cpu_only.on_cpu_only`)
CPU_ONLY = ("grouped_matmul backend 'openblas' runs on CPU only (a jax.ffi kernel registered "
            "for the CPU) and this function is lowered for {platform}: use backend='auto' or "
            "'tiled'")
# FFI target name -> the handler symbol in the library: the grouped GEMMs, and the row gathers
GEMM_HANDLERS = {TARGET: "DroplessGroupedGemmF32",
                 "dropless_gate_up_swiglu_f32": "DroplessGateUpSwigluF32",
                 "dropless_swiglu_dlhs_f32": "DroplessSwigluDlhsF32",
                 "dropless_dual_dlhs_f32": "DroplessDualDlhsF32"}
ROW_HANDLERS = {"dropless_gather_rows_f32": "DroplessGatherRowsF32",
                "dropless_gather_sum_f32": "DroplessGatherSumF32",
                "dropless_row_dots_f32": "DroplessRowDotsF32",
                "dropless_sort_by_expert": "DroplessSortByExpert",
                "dropless_top_k": "DroplessTopK"}
HANDLERS = {**GEMM_HANDLERS, **ROW_HANDLERS}
NATIVE = Path(__file__).parent / "csrc"
SOURCES = (NATIVE / "grouped_gemm.cc", NATIVE / "rows.cc")   # one library
HEADERS = (NATIVE / "threads.h",)
MODES = {"forward": 0, "dlhs": 1, "drhs": 2}

_LOCK = threading.Lock()
_STATE: dict[str, object] = {}   # "problem": str | None once decided; "lib": the loaded CDLL


def cache_dir() -> Path:
    """Where built kernels are kept: $DROPLESS_CACHE/native, else ~/.cache/dropless/native."""
    root = os.environ.get("DROPLESS_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "dropless")
    return Path(root) / "native"


def _compiler() -> list[str] | None:
    """The C++ compiler command: $CXX, c++, g++ or clang++ on PATH, else the `ziglang` package's
    (pip-installable; its first build takes minutes); None when there is none."""
    cxx = next((c for c in (os.environ.get("CXX"), "c++", "g++", "clang++")
                if c and shutil.which(c)), None)
    if cxx is not None:
        return [cxx]
    if importlib.util.find_spec("ziglang") is not None:
        return [sys.executable, "-m", "ziglang", "c++"]
    return None


def _cpu() -> str:
    """This CPU's model and feature flags (-march=native builds for it; a cache folder shared
    by several machines keeps one build per CPU)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        import platform  # noqa: PLC0415
        return platform.processor() or platform.machine()
    return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))


def core() -> str | None:
    """The kernel set OpenBLAS runs in this process ("SkylakeX", "Haswell", ...: its own
    detection, or OPENBLAS_CORETYPE where that is set), or None where `openblas` cannot run."""
    if problem() is not None:
        return None
    fn = _STATE["lib"].scipy_openblas_get_corename   # type: ignore[attr-defined]
    fn.restype = ctypes.c_char_p
    return fn().decode()


def describe() -> dict[str, object]:
    """What the native library runs here, for benchmark records: OpenBLAS's kernel set
    ("openblas_core"), the tiled kernel's vector width in floats ("native_vector_floats"; 16
    in AVX-512 builds, where `auto` runs it for every group, see native/grouped_gemm.cc) and the
    kernel choice ("native_kernel": "own",
    "openblas", or "auto", the library's rule; DROPLESS_NATIVE_KERNEL or `use_kernel`). Empty
    where `openblas` cannot run."""
    if problem() is not None:
        return {}
    return {"openblas_core": core(),
            "native_vector_floats": int(_STATE["lib"].dropless_vector_floats()),  # type: ignore
            "native_kernel": kernel()}


def _build_inputs() -> tuple[list[str], str]:
    """The compile command (output path last, to be filled in) and its cache key."""
    import scipy_openblas32  # noqa: PLC0415 (optional at import time of the package)
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (set CXX, install g++, or pip install ziglang)")
    inc_ffi = jax.ffi.include_dir()
    lib_dir = scipy_openblas32.get_lib_dir()
    # -march=native and -fno-trapping-math let the fused handlers' elementwise loops vectorize;
    # -ffp-contract=fast lets the tiled kernel's multiply-adds be FMAs under -std=c++17
    cmd = [*cxx, "-O3", "-march=native", "-fno-trapping-math", "-ffp-contract=fast",
           "-std=c++17", "-shared", "-fPIC",
           "-w", f"-I{inc_ffi}", *map(str, SOURCES),
           f"-L{lib_dir}", f"-l{scipy_openblas32.get_library()}", f"-Wl,-rpath,{lib_dir}"]
    version = subprocess.run([*cxx, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([
        *(f.read_text() for f in SOURCES + HEADERS), " ".join(cmd), version, _cpu(),
        importlib.metadata.version("jaxlib"), importlib.metadata.version("scipy-openblas32"),
    ]).encode()).hexdigest()[:16]
    return cmd, key


def build() -> Path:
    """Compile the kernel into the cache (once per key) and return the shared library's path.
    Raises RuntimeError (with the compiler's message) when it cannot be built."""
    cmd, key = _build_inputs()
    out = None
    for root in (cache_dir(), Path(tempfile.gettempdir()) / f"dropless-{os.getuid()}" / "native"):
        out = root / key / "libdropless_gmm.so"
        if out.exists():
            return out
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(out.parent, os.W_OK):
            break   # else: an unwritable cache folder, build into the temp folder instead
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        proc = subprocess.run(cmd + ["-o", tmp], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"building {', '.join(f.name for f in SOURCES)} failed: "
                               f"{(proc.stderr or proc.stdout).strip()[-600:]}")
        os.replace(tmp, out)   # atomic: a reader sees no file or the whole one
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def problem() -> str | None:
    """Why `openblas` cannot run in this process (None: it can). Builds and registers the kernel
    on first call; the answer is kept for the process."""
    with _LOCK:
        if "problem" not in _STATE:
            try:
                lib = ctypes.CDLL(str(build()))
                for target, symbol in HANDLERS.items():
                    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                                platform="cpu")
                _STATE["lib"] = lib
                _STATE["problem"] = None
                try:   # the kernel choice, once: a bad value fails every call, naming it
                    lib.dropless_set_kernel(_kernel_code(os.environ.get(KERNEL_ENV) or "auto",
                                                         KERNEL_ENV))
                except ValueError as e:
                    _STATE["kernel_error"] = f"{e} (or leave it unset)"
            except ImportError:
                _STATE["problem"] = "the scipy-openblas32 package is not installed"
            except (RuntimeError, OSError, AttributeError) as e:
                _STATE["problem"] = f"the native kernel is unavailable: {e}"
        return _STATE["problem"]  # type: ignore[return-value]


KERNEL_ENV = "DROPLESS_NATIVE_KERNEL"
KERNEL_CHOICES = ("auto", "own", "openblas")   # the library's choice codes 0, 1, 2


def _kernel_code(name: str, where: str) -> int:
    if name not in KERNEL_CHOICES:
        raise ValueError(f"{where}={name!r}: use one of {', '.join(KERNEL_CHOICES)}")
    return KERNEL_CHOICES.index(name)


def _require() -> None:
    why = problem()
    if why is not None:
        raise RuntimeError(f"grouped_matmul backend 'openblas': {why}; use backend='tiled'")
    if "kernel_error" in _STATE:
        raise ValueError(_STATE["kernel_error"])


def _lib():
    _require()
    return _STATE["lib"]


@contextlib.contextmanager
def use_kernel(name: str):
    """Run the native library's GEMMs on `name` ("own": the tiled kernel, "openblas", or "auto",
    the library's rule) while the block runs, for every call in the process (it is one setting,
    read when a call runs); the previous choice is restored after. For benchmarks and tests."""
    code = _kernel_code(name, "use_kernel")
    lib = _lib()
    before = lib.dropless_kernel()
    lib.dropless_set_kernel(code)
    try:
        yield
    finally:
        lib.dropless_set_kernel(before)


def kernel() -> str:
    """The native library's kernel choice now: "auto" (its rule), "own" or "openblas"."""
    return KERNEL_CHOICES[_lib().dropless_kernel()]


def stream_min_bytes() -> int | None:
    """The output size above which the grouped GEMM's forward and rhs gradient are written with
    streaming stores (the workers' L2s together), None where the build has no such stores."""
    fn = _lib().dropless_stream_min_bytes
    fn.restype = ctypes.c_int64
    got = int(fn())
    return None if got < 0 else got


def chunk_rows() -> dict[str, int]:
    """The tiled kernel's contraction chunk (rows of B a tile reads before C is written and read
    back; half the L2 over a panel's width) by product: "nn" (forward, drhs), "nt" (dlhs and the
    fused backward's, in 2-vector passes) and "gate_up" (the fused forward)."""
    fn = _lib().dropless_chunk_rows
    fn.restype, fn.argtypes = ctypes.c_int64, [ctypes.c_int]
    return {name: int(fn(i)) for i, name in enumerate(("nn", "nt", "gate_up"))}


def gemm_calls() -> dict[str, int]:
    """GEMMs the native library has run in this process, by kernel ("own", "openblas")."""
    fn = _lib().dropless_gemm_calls
    fn.restype, fn.argtypes = ctypes.c_int64, [ctypes.c_int]
    return {"own": int(fn(1)), "openblas": int(fn(0))}


def _call(mode: str, a, b, group_sizes_G, out_shape):
    return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(out_shape, jnp.float32),
                            vmap_method="sequential")(
        a, b, group_sizes_G.astype(jnp.int32), mode=np.int32(MODES[mode]))


def gmm_forward(lhs_MK, rhs_GKN, group_sizes_G):
    """out[rows of g] = lhs[rows of g] @ rhs[g] -> [M, N] float32 (rows past the groups: 0)."""
    _require()
    return _call("forward", lhs_MK, rhs_GKN, group_sizes_G, (lhs_MK.shape[0], rhs_GKN.shape[2]))


def gmm_dlhs(dy_MN, rhs_GKN, group_sizes_G):
    """dy[rows of g] @ rhs[g]^T -> [M, K] float32: the lhs gradient."""
    _require()
    return _call("dlhs", dy_MN, rhs_GKN, group_sizes_G, (dy_MN.shape[0], rhs_GKN.shape[1]))


def gmm_drhs(lhs_MK, dy_MN, group_sizes_G):
    """lhs[rows of g]^T @ dy[rows of g] -> [G, K, N] float32: the rhs gradient (0 for an empty
    group)."""
    _require()
    return _call("drhs", lhs_MK, dy_MN, group_sizes_G,
                 (group_sizes_G.shape[0], lhs_MK.shape[1], dy_MN.shape[1]))


@jax.custom_vjp
def _gmm(lhs_MK, rhs_GKN, group_sizes_G):
    return gmm_forward(lhs_MK, rhs_GKN, group_sizes_G)


def _gmm_fwd(lhs_MK, rhs_GKN, group_sizes_G):
    return gmm_forward(lhs_MK, rhs_GKN, group_sizes_G), (lhs_MK, rhs_GKN, group_sizes_G)


def _gmm_bwd(res, dy_MN):
    lhs_MK, rhs_GKN, group_sizes_G = res
    dy_MN = dy_MN.astype(jnp.float32)
    return (gmm_dlhs(dy_MN, rhs_GKN, group_sizes_G), gmm_drhs(lhs_MK, dy_MN, group_sizes_G),
            None)


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def _call_many(target, out_shapes, *args):
    f32 = jnp.float32
    return jax.ffi.ffi_call(target, tuple(jax.ShapeDtypeStruct(s, f32) for s in out_shapes),
                            vmap_method="sequential")(*args)


def gate_up_swiglu(x_ND, w_gate_EDF, w_up_EDF, group_sizes_E):
    """(g, u, h) [N, F] float32: g = x @ w_gate[e], u = x @ w_up[e] on expert e's rows,
    h = silu(g) * u, in one pass (rows past the groups: 0)."""
    _require()
    shape = (x_ND.shape[0], w_gate_EDF.shape[2])
    return _call_many("dropless_gate_up_swiglu_f32", (shape,) * 3, x_ND, w_gate_EDF, w_up_EDF,
                      group_sizes_E.astype(jnp.int32))


def swiglu_dlhs(dy_ND, w_down_EFD, g_NF, u_NF, group_sizes_E):
    """(dg, du) [N, F] float32, the gradients of g and u through h = silu(g) * u and the down
    projection: dh = dy @ w_down[e]^T, dg = dh * u * silu'(g), du = dh * silu(g)."""
    _require()
    return _call_many("dropless_swiglu_dlhs_f32", (g_NF.shape,) * 2, dy_ND, w_down_EFD, g_NF,
                      u_NF, group_sizes_E.astype(jnp.int32))


def dual_dlhs(dg_NF, w_gate_EDF, du_NF, w_up_EDF, group_sizes_E):
    """dg @ w_gate[e]^T + du @ w_up[e]^T -> [N, D] float32: x's gradient through gate and up."""
    _require()
    return _call_many("dropless_dual_dlhs_f32", ((dg_NF.shape[0], w_gate_EDF.shape[1]),), dg_NF,
                      w_gate_EDF, du_NF, w_up_EDF, group_sizes_E.astype(jnp.int32))[0]


@jax.custom_vjp
def swiglu_ffn(x_ND, w_gate_EDF, w_up_EDF, w_down_EFD, group_sizes_E):
    """down(silu(x @ gate) * (x @ up)) per expert over expert-major rows -> [N, D] float32, with
    the elementwise steps fused into the products (the layer's `expert_ffn` on this backend)."""
    return _swiglu_ffn_fwd(x_ND, w_gate_EDF, w_up_EDF, w_down_EFD, group_sizes_E)[0]


def _swiglu_ffn_fwd(x_ND, w_gate_EDF, w_up_EDF, w_down_EFD, group_sizes_E):
    g_NF, u_NF, h_NF = gate_up_swiglu(x_ND, w_gate_EDF, w_up_EDF, group_sizes_E)
    y_ND = gmm_forward(h_NF, w_down_EFD, group_sizes_E)
    return y_ND, (x_ND, w_gate_EDF, w_up_EDF, w_down_EFD, group_sizes_E, g_NF, u_NF, h_NF)


def _swiglu_ffn_bwd(res, dy_ND):
    x_ND, w_g, w_u, w_d, gs, g_NF, u_NF, h_NF = res
    dy_ND = dy_ND.astype(jnp.float32)
    dg_NF, du_NF = swiglu_dlhs(dy_ND, w_d, g_NF, u_NF, gs)
    return (dual_dlhs(dg_NF, w_g, du_NF, w_u, gs), gmm_drhs(x_ND, dg_NF, gs),
            gmm_drhs(x_ND, du_NF, gs), gmm_drhs(h_NF, dy_ND, gs), None)


swiglu_ffn.defvjp(_swiglu_ffn_fwd, _swiglu_ffn_bwd)
# the layer's fused FFN where the backend is asked for by name: refused in one line when lowered
# for another platform, as the grouped matmul is
swiglu_ffn_on_cpu = on_cpu_only(swiglu_ffn, CPU_ONLY)


# ---- Row movement (native/rows.cc): the MoE layer's permute and combine on CPU ----
# Legend here: R source rows, D row width, N gathered rows, T tokens, K choices per token.

def _rows(target, out_shape, *args):
    why = problem()   # (the GEMMs' kernel setting does not apply to these)
    if why is not None:
        raise RuntimeError(f"the native row gathers: {why}")
    return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(out_shape, jnp.float32),
                            vmap_method="sequential")(*args)


def _factors(f, shape):
    """A factor operand: f as float32 of `shape`, or the empty [0] meaning every factor is 1."""
    if f is None:
        return jnp.zeros((0,), jnp.float32)
    return jnp.asarray(f, jnp.float32).reshape(shape)


def gather_rows(src_RD, idx_N, scale_N=None):
    """out[i] = scale[i] * src[idx[i]] -> [N, D] float32 (scale None: the rows copied as they
    are). Indices outside [0, R) are clamped to it (jnp.take's mode="clip")."""
    n = idx_N.shape[0]
    return _rows("dropless_gather_rows_f32", (n, src_RD.shape[1]), src_RD.astype(jnp.float32),
                 idx_N.astype(jnp.int32), _factors(scale_N, (n,)))


def gather_sum(src_RD, idx_TK, weights_TK=None):
    """out[t] = sum_k weights[t, k] * src[idx[t, k]] -> [T, D] float32, summed in float32 in
    order k = 0, 1, ... (weights None: every weight 1). Indices clamped as in gather_rows."""
    return _rows("dropless_gather_sum_f32", (idx_TK.shape[0], src_RD.shape[1]),
                 src_RD.astype(jnp.float32), idx_TK.astype(jnp.int32),
                 _factors(weights_TK, idx_TK.shape))


def row_dots(a_TD, b_RD, idx_TK):
    """out[t, k] = dot(a[t], b[idx[t, k]]) -> [T, K] float32 (the gradient of gather_sum's
    weights). Indices clamped as in gather_rows."""
    return _rows("dropless_row_dots_f32", idx_TK.shape, a_TD.astype(jnp.float32),
                 b_RD.astype(jnp.float32), idx_TK.astype(jnp.int32))


def sort_by_expert(ids_N, num_experts: int):
    """(order_N, inv_N, sizes_E) int32 by a counting sort: order_N the stable argsort of ids_N,
    inv_N its inverse, sizes_E[e] the ids equal to e (moe.permute.sort_by_expert's XLA form,
    out-of-range ids included)."""
    why = problem()
    if why is not None:
        raise RuntimeError(f"the native sort: {why}")
    n = ids_N.shape[0]
    i32 = jnp.int32
    return jax.ffi.ffi_call("dropless_sort_by_expert",
                            (jax.ShapeDtypeStruct((n,), i32), jax.ShapeDtypeStruct((n,), i32),
                             jax.ShapeDtypeStruct((num_experts,), i32)),
                            vmap_method="sequential")(ids_N.astype(i32))


def top_k_indices(x_TE, k: int):
    """[T, K] int32: the indices jax.lax.top_k(x_TE, k) returns (each row's k largest,
    descending, equal values by lower index, NaN above +inf and -NaN below -inf), for float32
    x [T, E] with k <= E."""
    why = problem()
    if why is not None:
        raise RuntimeError(f"the native top-k: {why}")
    return jax.ffi.ffi_call("dropless_top_k",
                            jax.ShapeDtypeStruct((x_TE.shape[0], k), jnp.int32),
                            vmap_method="sequential")(x_TE.astype(jnp.float32))


def supports(lhs_MK, rhs_GKN, out_dtype) -> bool:
    """Whether the native kernel takes these operands (float32 in and out); others run tiled."""
    f32 = jnp.dtype(jnp.float32)
    return lhs_MK.dtype == f32 and rhs_GKN.dtype == f32 and jnp.dtype(out_dtype) == f32


# the kernel is registered for the CPU only: asked for by name elsewhere, say so when lowering
# (auto's CPU branch is not lowered for another platform, so auto is never refused)
_gmm_on_cpu = on_cpu_only(_gmm, CPU_ONLY)


def native_gmm(lhs_MK, rhs_GKN, group_sizes_G, *, out_dtype):
    """Grouped matmul by one OpenBLAS sgemm per group (float32); other dtypes run `tiled`.
    Shapes are checked by the caller. Raises RuntimeError when the kernel cannot be built, and
    ValueError (naming the platform) when float32 operands are lowered for a platform other
    than the CPU."""
    if not supports(lhs_MK, rhs_GKN, out_dtype):
        return tiled_gmm(lhs_MK, rhs_GKN, group_sizes_G, out_dtype=out_dtype)
    return _gmm_on_cpu(lhs_MK, rhs_GKN, group_sizes_G)
