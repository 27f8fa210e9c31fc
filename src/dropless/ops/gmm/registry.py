"""The grouped-matmul registry: named backends behind one function.

Legend: M rows (sorted by group), K contraction dim, N output dim, G groups.

`grouped_matmul(lhs_MK, rhs_GKN, group_sizes_G)` has exactly `jax.lax.ragged_dot`'s semantics:
rows [start_g, start_g + group_sizes[g]) are multiplied by rhs[g]; rows past sum(group_sizes)
come out as zeros; empty groups are fine. Backends are chosen by name; `auto` picks the fastest
exact one for the platform when the function is lowered (`jax.lax.platform_dependent`), so one
jitted function is right on CPU and on CUDA, and lowers for CUDA on a machine without a GPU:

  platform   auto picks                                   why
  cpu        native (float32) where it builds, else       ragged_dot is a masked dense dot there;
             tiled                                        XLA:CPU copies each tile of `tiled`
  cuda       the measured winner of the shape's bucket    XLA runs ragged_dot zero-padded there
             and direction (winners.json), else tokamax
             if usable, else pallas_gpu
  rocm/tpu   ragged_dot                                   a grouped kernel in XLA (TPU)

`ragged_dot` runs on CUDA only when asked for by name.

On CUDA `auto` first reads the committed table of measured winners (`winners.py`): per
(device kind, shape bucket, direction) the backend a device run found fastest. A row's backend
is used if it is usable here and not refused; directions with different winners run under one
custom VJP (`per_direction_gmm`: the forward of one backend, dlhs and drhs of others). A shape
the table lacks, or a row naming a backend that cannot run, gets the chain's default; a winner
refused by the fallback is replaced by the chain's default too (`fallback_after`).

`auto` is a chain per platform (`AUTO_CHAINS`): the first usable backend that is not refused
runs, and the last is the floor (never refused). A backend is refused for one shape or for a
whole function by `auto_scope(refused=...)`, which `ops/gmm/fallback.py` sets when the chosen
backend fails to compile or to run on the device; tracing inside `auto_scope(events=[...])`
records, per grouped matmul, what `auto` chose on each platform and what `tokamax` ran, so a
caller can say which backend ran. `stand_in` puts a backend first on a platform's chain (tests
and `bench gpu --dry-run` use failing stand-ins to show the fallback on CPU). An old backend
name (`aliases.ALIASES`: `openblas` -> `native`) is accepted wherever a name is, as its new one.

Loading this module registers the built-in backends (at its end); `names.py` lists their names
without JAX, for the configs, which check a name without loading any backend.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from dropless.ops.gmm import choices, winners
from dropless.ops.gmm.baselines import loop_gmm, padded_gmm, ragged_dot_gmm, reference_gmm
from dropless.ops.gmm.shapes import DIRECTIONS
from dropless.ops.gmm.aliases import canonical_backend
from dropless.ops.gmm.choices import auto_scope, note, shape_key  # noqa: F401 (re-exported)
from dropless.ops.gmm.names import BACKENDS, check_backend_name  # noqa: F401 (re-exported)
from dropless.ops.gmm.tiled import tiled_gmm
from dropless.ops.gpu import cudnn_ragged, mosaic_gpu, pallas_gpu, tokamax_backend
from dropless.ops.gpu.pallas_plan import ALIGNED_ROW_BLOCK
from dropless.ops.native import native_gmm, problem as native_problem


@dataclasses.dataclass(frozen=True)
class BackendSpec:
    """A registered backend: `fn(lhs, rhs, group_sizes, *, out_dtype, **options) -> out_MN`."""

    name: str
    fn: Callable[..., jax.Array]
    description: str
    options: tuple[str, ...] = ()
    jittable: bool = True
    problem: Callable[[], str | None] | None = None   # why it cannot run here (None: it can)
    # takes `group_alignment=`: may skip the group-boundary tiles when every group starts at a
    # multiple of it (`row_block`, the rows it wants them aligned to); others ignore the layout
    aligned: bool = False
    row_block: int = 1


_REGISTRY: dict[str, BackendSpec] = {}


def register_backend(name: str, fn: Callable[..., jax.Array], *, description: str,
                     options: tuple[str, ...] = (), jittable: bool = True,
                     problem: Callable[[], str | None] | None = None, aligned: bool = False,
                     row_block: int = 1) -> None:
    """Add a backend under `name` (raises ValueError if the name is taken). `problem()` says
    why an optional backend cannot run here (None when it can); `auto` skips it then. An
    `aligned` backend is passed `group_alignment=` and wants segments aligned to `row_block`."""
    if name in _REGISTRY or name == "auto":
        raise ValueError(f"grouped-matmul backend name {name!r} is already registered")
    _REGISTRY[name] = BackendSpec(name, fn, description, tuple(options), jittable, problem,
                                  aligned, row_block)


def grouped_matmul_backends() -> tuple[str, ...]:
    """Names accepted by `grouped_matmul(backend=...)`, `auto` first.

    What `auto` picks on each platform: `resolve_backend("auto", p)` for p in `AUTO_PLATFORMS`.
    """
    return ("auto",) + tuple(_REGISTRY)


def backend_spec(name: str) -> BackendSpec:
    """The registered backend `name` (an old name: its new one); for `auto`, a spec whose fn
    chooses per platform when lowered. Raises ValueError for an unknown name."""
    check_backend_name(name)
    name = canonical_backend(name)
    if name == "auto":
        return BackendSpec("auto", auto_gmm, "the fastest exact backend of the platform, "
                           "chosen when lowering: " + ", ".join(
                               f"{p} -> {resolve_backend('auto', p)}" for p in AUTO_PLATFORMS),
                           aligned=True)
    return _REGISTRY[name]


AUTO_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
# what `auto` tries on each platform, in order; the last is the floor
AUTO_CHAINS = {"cpu": ("native", "tiled"), "cuda": ("tokamax", "pallas_gpu"),
               "rocm": ("ragged_dot",), "tpu": ("ragged_dot",)}


@contextlib.contextmanager
def stand_in(name: str, fn: Callable[..., jax.Array], *, first_on: str,
             description: str = "a stand-in (tests, bench gpu --dry-run)") -> Iterator[None]:
    """Within the block, backend `name` is `fn` (replacing a registered one of that name) and
    `auto` tries it first on platform `first_on`, before that platform's chain. Not
    thread-safe (the registry is shared): for tests and a dry run's own process."""
    saved = _REGISTRY.get(name)
    _REGISTRY[name] = BackendSpec(name, fn, description)
    state = choices.STATE.get()
    token = choices.STATE.set(dataclasses.replace(state, first=state.first + ((first_on, name),)))
    try:
        yield
    finally:
        choices.STATE.reset(token)
        if saved is None:
            del _REGISTRY[name]
        else:
            _REGISTRY[name] = saved


def unusable(name: str) -> str | None:
    """Why backend `name` cannot run in this process (not registered, optional package missing
    or unsuited); None when it can."""
    name = canonical_backend(name)
    spec = _REGISTRY.get(name)
    if spec is None:
        return f"{name!r} is not registered"
    return spec.problem() if spec.problem is not None else None


def auto_chain(platform: str) -> tuple[str, ...]:
    """The usable backends `auto` tries on `platform` ("cuda", "gpu", "cpu", ...), in order:
    stand-ins first, then `AUTO_CHAINS`; the last one is the floor."""
    platform = platform_name(platform)
    firsts = tuple(b for p, b in choices.STATE.get().first if p == platform)
    chain = [b for b in firsts + AUTO_CHAINS[platform] if unusable(b) is None]
    return tuple(dict.fromkeys(chain)) or AUTO_CHAINS[platform][-1:]


def _refused(backend: str, shape: tuple | None) -> bool:
    refused = choices.STATE.get().refused
    return (backend, None) in refused or (shape is not None and (backend, shape) in refused)


def fallback_after(backend: str, platform: str, shape: tuple | None = None) -> str | None:
    """The backend `auto` would use on `platform` at `shape` if `backend` were refused there:
    the next of the chain; for a backend off the chain that the winner table can name (CUDA,
    usable), the chain's default. None: `backend` is the floor, or neither."""
    chain = auto_chain(platform)
    if backend not in chain:   # a winner from the table: the chain's default replaces it
        if not _winner_platform(platform) or unusable(backend) is not None:
            return None
        return next((b for b in chain[:-1] if not _refused(b, shape)), chain[-1])
    if backend == chain[-1]:
        return None
    rest = chain[chain.index(backend) + 1:]
    return next((b for b in rest[:-1] if not _refused(b, shape)), rest[-1])


def platform_name(platform: str) -> str:
    """A jax backend or lowering platform name as a key of AUTO_CHAINS ("gpu" -> "cuda" or
    "rocm"); ValueError for another."""
    if platform == "gpu":
        return "rocm" if _gpu_is_rocm() else "cuda"
    if platform not in AUTO_CHAINS:
        raise ValueError(f"platform={platform!r} is not one of {sorted(AUTO_CHAINS)}")
    return platform


def current_platform() -> str:
    """jax's default backend as a lowering platform name ("cpu", "cuda", "rocm", "tpu")."""
    return platform_name(jax.default_backend())


def tokamax_available() -> bool:
    """Whether the optional `tokamax` package (the `gpu` extra) is installed, imports, and
    suits this jax (`tokamax_backend.tokamax_problem`; cached there)."""
    if importlib.util.find_spec("tokamax") is None:
        return False
    return tokamax_backend.tokamax_problem() is None


def tokamax_unusable() -> str | None:
    """Why `auto` cannot use tokamax here (None: it can); the tokamax backend's `problem`."""
    if tokamax_available():
        return None
    return (tokamax_backend.tokamax_problem() if importlib.util.find_spec("tokamax")
            else "tokamax is not installed")


def what_ran(events: list[dict], platform: str) -> list[dict]:
    """Per grouped-matmul shape traced (events of an `auto_scope`), what runs on `platform`:
    {"asked", "backend", "shape"} and, where tokamax decided, "implementation" or "reason"
    (why it is not the backend asked for). `auto`'s choice for `platform` first, refined by
    what tokamax did at that shape; a backend asked for by name is itself."""
    platform = platform_name(platform)
    out: dict[tuple, dict] = {}
    for e in events:
        if e["asked"] == "auto" and e["platform"] == platform:
            out[e["shape"]] = dict(e)
    for e in events:
        if e["asked"] == "auto":
            continue
        cur = out.get(e["shape"])
        if cur is None:
            out[e["shape"]] = dict(e)
        elif cur["backend"] == e["asked"]:
            cur.update({k: v for k, v in e.items() if k not in ("asked", "shape")})
    for r in out.values():
        r.pop("platform", None)
    return list(out.values())


def _winner_platform(platform: str) -> bool:
    """Whether `auto` reads the winner table on `platform` (CUDA, without stand-ins)."""
    platform = platform_name(platform)
    return platform == "cuda" and not any(p == platform for p, _ in choices.STATE.get().first)


def table_winner(platform: str, shape: tuple | None, direction: str = "fwd") -> str | None:
    """The winner table's backend for `shape` (a `shape_key`) and `direction` on `platform`
    when it can be used here (registered, usable, jittable, not refused); else None."""
    if shape is None or not _winner_platform(platform):
        return None
    (m, k), _, (g, _, n), *_ = shape
    name = winners.winner(winners.device_kind(), m, k, n, g, direction)
    if name is None or name not in _REGISTRY or not _REGISTRY[name].jittable:
        return None
    if unusable(name) is not None or _refused(name, shape):
        return None
    return name


def resolve_backend(name: str, platform: str | None = None, shape: tuple | None = None,
                    direction: str = "fwd") -> str:
    """The backend `name` runs as on `platform` (default: jax's default backend), at `shape`
    (a `shape_key`; None: any shape) for `direction` under the active `auto_scope`'s refusals.
    On CUDA `auto` takes the winner table's backend where it can (`table_winner`).

    `auto` -> `native` on CPU where its kernel builds, else `tiled` (ragged_dot does G times
    the work there); on CUDA (`gpu`/`cuda`)
    `tokamax` when it is installed and suits this jax, else `pallas_gpu` (never ragged_dot: XLA
    runs it as a zero-padded dense product on CUDA); `ragged_dot` on TPU and ROCm: the first
    of `auto_chain(platform)` not refused, the last one if all are. Other names: themselves
    (an old name: its new one).
    """
    if name != "auto":
        return canonical_backend(name)
    platform = platform or jax.default_backend()
    won = table_winner(platform, shape, direction)
    if won is not None:
        return won
    chain = auto_chain(platform)
    return next((b for b in chain[:-1] if not _refused(b, shape)), chain[-1])


def _gpu_is_rocm() -> bool:
    try:
        return jax.devices("gpu")[0].client.platform == "rocm"
    except RuntimeError:
        return False


def row_alignment(backend: str = "auto", platform: str | None = None) -> int:
    """The rows an expert segment should start at a multiple of for `backend` on `platform`
    (default: jax's default backend): the resolved backend's `row_block` if it is `aligned`,
    else 1 (aligning would only add rows)."""
    spec = _REGISTRY.get(resolve_backend(backend, platform))
    return spec.row_block if spec is not None and spec.aligned else 1


def auto_gmm(lhs_MK, rhs_GKN, group_sizes_G, *, out_dtype, group_alignment: int = 1):
    """`auto`: each platform's backend, picked when the caller is lowered (not traced).

    Every branch is traced (cheap), only the lowering platform's branch is lowered, so a CUDA
    module holds the GPU kernels and no CPU or ragged_dot code. Each branch's choice is noted
    (`note`) for an `auto_scope(events=...)`.
    """
    key = shape_key(lhs_MK, rhs_GKN, group_sizes_G, out_dtype)

    def branch(platform):
        names = {d: resolve_backend("auto", platform, key, d) for d in DIRECTIONS}
        event = {"asked": "auto", "platform": platform, "backend": names["fwd"], "shape": key}
        if any(table_winner(platform, key, d) for d in DIRECTIONS):
            (m, k), _, (g, _, n), *_ = key
            event["by"] = (f"winner table: {winners.device_kind()} "
                           f"{winners.bucket(m, k, n, g)}")
        if len(set(names.values())) > 1:
            event["directions"] = dict(names)
        note(event)
        if len(set(names.values())) == 1:
            spec = _REGISTRY[names["fwd"]]
            aligned = {"group_alignment": group_alignment} if spec.aligned else {}
            return functools.partial(spec.fn, out_dtype=out_dtype, **aligned)
        return functools.partial(per_direction_gmm, out_dtype=out_dtype,
                                 fns=tuple(_REGISTRY[names[d]].fn for d in DIRECTIONS))
    return jax.lax.platform_dependent(
        lhs_MK, rhs_GKN, group_sizes_G, **{p: branch(p) for p in AUTO_PLATFORMS})


def per_direction_gmm(lhs_MK, rhs_GKN, group_sizes_G, *, out_dtype, fns):
    """One grouped matmul whose forward, dlhs and drhs run different backends (`fns`: their
    functions in `DIRECTIONS` order): the forward is fns[0]'s, the backward takes dlhs from
    fns[1]'s VJP and drhs from fns[2]'s (XLA drops each VJP's unused half)."""
    return _per_direction(lhs_MK, rhs_GKN, group_sizes_G, jnp.dtype(out_dtype), fns)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _per_direction(lhs_MK, rhs_GKN, group_sizes_G, out_dtype, fns):
    return fns[0](lhs_MK, rhs_GKN, group_sizes_G, out_dtype=out_dtype)


def _per_direction_fwd(lhs_MK, rhs_GKN, group_sizes_G, out_dtype, fns):
    return (_per_direction(lhs_MK, rhs_GKN, group_sizes_G, out_dtype, fns),
            (lhs_MK, rhs_GKN, group_sizes_G))


def _per_direction_bwd(out_dtype, fns, res, dy_MN):
    lhs_MK, rhs_GKN, group_sizes_G = res
    _, dlhs = jax.vjp(lambda a: fns[1](a, rhs_GKN, group_sizes_G, out_dtype=out_dtype), lhs_MK)
    _, drhs = jax.vjp(lambda b: fns[2](lhs_MK, b, group_sizes_G, out_dtype=out_dtype), rhs_GKN)
    return dlhs(dy_MN)[0], drhs(dy_MN)[0], None


_per_direction.defvjp(_per_direction_fwd, _per_direction_bwd)


def _is_concrete(x: Any) -> bool:
    return not isinstance(x, jax.core.Tracer)


def check_operands(lhs_MK, rhs_GKN, group_sizes_G) -> None:
    """Shape and dtype checks shared by every backend; ValueError names the argument."""
    if lhs_MK.ndim != 2:
        raise ValueError(f"lhs must be 2-D [M, K]; got shape {lhs_MK.shape}")
    if rhs_GKN.ndim != 3:
        raise ValueError(f"rhs must be 3-D [G, K, N]; got shape {rhs_GKN.shape}")
    if lhs_MK.shape[1] != rhs_GKN.shape[1]:
        raise ValueError(f"lhs K={lhs_MK.shape[1]} does not match rhs K={rhs_GKN.shape[1]} "
                         f"(lhs {lhs_MK.shape}, rhs {rhs_GKN.shape})")
    if group_sizes_G.ndim != 1 or group_sizes_G.shape[0] != rhs_GKN.shape[0]:
        raise ValueError(f"group_sizes must have shape [G]=[{rhs_GKN.shape[0]}]; "
                         f"got {group_sizes_G.shape}")
    if not jnp.issubdtype(group_sizes_G.dtype, jnp.integer):
        raise ValueError(f"group_sizes must be integers; got dtype {group_sizes_G.dtype}")
    if _is_concrete(group_sizes_G):
        gs = np.asarray(group_sizes_G)
        if (gs < 0).any():
            raise ValueError(f"group_sizes must be >= 0; got {gs.tolist()}")
        if gs.sum() > lhs_MK.shape[0]:
            raise ValueError(f"sum(group_sizes)={int(gs.sum())} exceeds lhs rows M="
                             f"{lhs_MK.shape[0]}")


def check_alignment(group_alignment: Any, group_sizes_G) -> None:
    """ValueError unless `group_alignment` is a positive int dividing every (concrete) size."""
    a = group_alignment
    if isinstance(a, bool) or not isinstance(a, (int, np.integer)) or a < 1:
        raise ValueError(f"group_alignment must be a positive int; got {a!r}")
    if a > 1 and _is_concrete(group_sizes_G):
        gs = np.asarray(group_sizes_G)
        if (gs % a).any():
            raise ValueError(f"group_alignment={a} but group_sizes {gs.tolist()} are not all "
                             f"multiples of it; pad each group to a multiple or pass 1")


def grouped_matmul(lhs_MK: jax.Array, rhs_GKN: jax.Array, group_sizes_G: jax.Array, *,
                   backend: str = "auto", preferred_element_type: Any = None,
                   group_alignment: int = 1, **options: Any) -> jax.Array:
    """out[r] = lhs[r] @ rhs[g(r)] for rows sorted by group; `jax.lax.ragged_dot` semantics.

    Args:
      lhs_MK: [M, K] rows sorted by group.
      rhs_GKN: [G, K, N] one matrix per group.
      group_sizes_G: [G] int rows per group, on device (traced under jit; never copied to host
        except by the `loop` baseline). Rows past the sum give zeros.
      backend: a name from `grouped_matmul_backends()`.
      preferred_element_type: output dtype (accumulation is float32 for float inputs);
        default: the promoted input dtype.
      group_alignment: every group starts at a multiple of this many rows (the layout of
        aligned expert segments; the rows between groups are zero). Passed to backends
        registered `aligned`, which may then skip the tiles that straddle two groups.
      **options: backend options (`tile_sizes` for tiled, `capacity` for padded, block sizes
        for pallas_gpu, `implementation` for tokamax); `auto` takes none.
    Returns: [M, N].
    Raises: ValueError for an unknown backend or option, bad shapes, negative sizes (when
      concrete), a `group_alignment` that is not a positive int or (sizes concrete) does not
      divide every group size, or the `loop` backend under jit.
    """
    lhs_MK, rhs_GKN = jnp.asarray(lhs_MK), jnp.asarray(rhs_GKN)
    group_sizes_G = jnp.asarray(group_sizes_G)
    spec = backend_spec(backend)
    unknown = sorted(set(options) - set(spec.options))
    if unknown:
        raise ValueError(f"grouped_matmul backend {spec.name!r} takes options "
                         f"{list(spec.options)}; got unknown {unknown}")
    check_operands(lhs_MK, rhs_GKN, group_sizes_G)
    check_alignment(group_alignment, group_sizes_G)
    if spec.aligned:
        options = dict(options, group_alignment=group_alignment)
    out_dtype = jnp.dtype(preferred_element_type if preferred_element_type is not None
                          else jnp.result_type(lhs_MK, rhs_GKN))
    return spec.fn(lhs_MK, rhs_GKN, group_sizes_G.astype(jnp.int32), out_dtype=out_dtype,
                   **options)


# The built-in backends, registered when this module loads (whoever reads the registry imports
# it); `names.BACKENDS` lists them for the configs, which check a name without loading them.
register_backend("reference", reference_gmm,
                 description="per-group masked loop, G x the work; obviously correct (tests)")
register_backend("ragged_dot", ragged_dot_gmm,
                 description="jax.lax.ragged_dot (XLA): a grouped kernel on TPU; on CUDA a "
                             "zero-padded dense product (G x the FLOPs), by name only")
register_backend("tiled", tiled_gmm, options=("tile_sizes",),
                 description="pure-JAX row tiles per group with hand-written VJP; CPU default")
register_backend("native", native_gmm, problem=native_problem,
                 description="the native CPU library (ops/native): one GEMM per group through "
                             "XLA's FFI, rows in place, OpenBLAS's sgemm or, on AVX-512, the "
                             "library's own tiled kernel (float32; other dtypes run tiled); CPU "
                             "default when it builds (old name: openblas)")
register_backend("pallas_gpu", pallas_gpu.pallas_gpu_gmm, options=pallas_gpu.OPTIONS,
                 description="our Pallas kernels via Triton (fwd, dlhs, drhs), sizes on device; "
                             "CUDA; interpret mode on CPU (slow, for tests)",
                 aligned=True, row_block=ALIGNED_ROW_BLOCK)
register_backend("tokamax", tokamax_backend.tokamax_gmm, options=("implementation",),
                 problem=tokamax_unusable,
                 description="tokamax.ragged_dot (Mosaic GPU SM90/SM100, Triton); optional "
                             "dependency, the `gpu` extra")
register_backend("mosaic_gpu", mosaic_gpu.mosaic_gpu_gmm, options=mosaic_gpu.OPTIONS,
                 problem=mosaic_gpu.mosaic_problem,
                 description="jax's own Mosaic GPU kernels for Hopper (ragged_dot_mgpu: fwd, dlhs; "
                             "drhs ours or, with drhs='mosaic', transposed_ragged_dot_mgpu); "
                             "bf16/f16, sm_90a; other operands run pallas_gpu")
register_backend("cudnn_ragged_dot", cudnn_ragged.cudnn_ragged_gmm, problem=cudnn_ragged.problem,
                 description="jax.lax.ragged_dot as XLA's cuDNN grouped GEMM; usable only where "
                             "cuDNN >= 9.22 is loaded and XLA_FLAGS enables the fusion "
                             "(ops/gpu/cudnn_ragged.py detects both)")
register_backend("padded", padded_gmm, options=("capacity",),
                 description="pad each group to a capacity, one batched GEMM (naive baseline)")
register_backend("loop", loop_gmm, jittable=False,
                 description="host loop over groups, sizes copied to host (naive baseline)")
if tuple(_REGISTRY) != BACKENDS:   # the configs check names against that list
    raise ImportError(f"ops/gmm/names.py's BACKENDS {BACKENDS} are not the backends registered "
                      f"here, {tuple(_REGISTRY)}: make them the same")
