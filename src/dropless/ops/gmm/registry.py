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
  cuda       tokamax if usable, else pallas_gpu           XLA runs ragged_dot zero-padded there
  rocm/tpu   ragged_dot                                   a grouped kernel in XLA (TPU)

`ragged_dot` runs on CUDA only when asked for by name.

`auto` is a chain per platform (`AUTO_CHAINS`): the first usable backend that is not refused
runs, and the last is the floor (never refused). A backend is refused for one shape or for a
whole function by `auto_scope(refused=...)`, which `ops/gmm/fallback.py` sets when the chosen
backend fails to compile or to run on the device; tracing inside `auto_scope(events=[...])`
records, per grouped matmul, what `auto` chose on each platform and what `tokamax` ran, so a
caller can say which backend ran. `stand_in` puts a backend first on a platform's chain (tests
and `bench gpu --dry-run` use failing stand-ins to show the fallback on CPU). An old backend
name (`aliases.ALIASES`: `openblas` -> `native`) is accepted wherever a name is, as its new one.
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

from dropless.ops.gmm import choices
from dropless.ops.gmm.aliases import ALIASES, canonical_backend
from dropless.ops.gmm.choices import auto_scope, note, shape_key  # noqa: F401 (re-exported)


@dataclasses.dataclass(frozen=True)
class BackendSpec:
    """A registered backend: `fn(lhs, rhs, group_sizes, *, out_dtype, **options) -> out_MN`."""

    name: str
    fn: Callable[..., jax.Array]
    description: str
    options: tuple[str, ...] = ()
    jittable: bool = True
    problem: Callable[[], str | None] | None = None   # why it cannot run here (None: it can)


_REGISTRY: dict[str, BackendSpec] = {}


def register_backend(name: str, fn: Callable[..., jax.Array], *, description: str,
                     options: tuple[str, ...] = (), jittable: bool = True,
                     problem: Callable[[], str | None] | None = None) -> None:
    """Add a backend under `name` (raises ValueError if the name is taken). `problem()` says
    why an optional backend cannot run here (None when it can); `auto` skips it then."""
    if name in _REGISTRY or name == "auto":
        raise ValueError(f"grouped-matmul backend name {name!r} is already registered")
    _REGISTRY[name] = BackendSpec(name, fn, description, tuple(options), jittable, problem)


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
                               f"{p} -> {resolve_backend('auto', p)}" for p in AUTO_PLATFORMS))
    return _REGISTRY[name]


def check_backend_name(name: str, where: str = "backend") -> None:
    """Raise ValueError naming `where`, the value and the known backends if `name` is unknown
    (an old name, `aliases.ALIASES`, is known)."""
    if name != "auto" and ALIASES.get(name, name) not in _REGISTRY:
        raise ValueError(f"{where}={name!r} is not a grouped-matmul backend; "
                         f"known: {', '.join(grouped_matmul_backends())}")


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
    """The backend `auto` would use on `platform` at `shape` if `backend` were refused there
    (None: `backend` is the floor, or not on that platform's chain)."""
    chain = auto_chain(platform)
    if backend not in chain or backend == chain[-1]:
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
    from dropless.ops.gpu.tokamax_backend import tokamax_problem  # noqa: PLC0415
    return tokamax_problem() is None


def tokamax_unusable() -> str | None:
    """Why `auto` cannot use tokamax here (None: it can); the tokamax backend's `problem`."""
    if tokamax_available():
        return None
    from dropless.ops.gpu.tokamax_backend import tokamax_problem  # noqa: PLC0415
    return tokamax_problem() if importlib.util.find_spec("tokamax") else "tokamax is not installed"


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


def resolve_backend(name: str, platform: str | None = None, shape: tuple | None = None) -> str:
    """The backend `name` runs as on `platform` (default: jax's default backend), at `shape`
    (a `shape_key`; None: any shape) under the active `auto_scope`'s refusals.

    `auto` -> `native` on CPU where its kernel builds, else `tiled` (ragged_dot does G times
    the work there); on CUDA (`gpu`/`cuda`)
    `tokamax` when it is installed and suits this jax, else `pallas_gpu` (never ragged_dot: XLA
    runs it as a zero-padded dense product on CUDA); `ragged_dot` on TPU and ROCm: the first
    of `auto_chain(platform)` not refused, the last one if all are. Other names: themselves
    (an old name: its new one).
    """
    if name != "auto":
        return canonical_backend(name)
    chain = auto_chain(platform or jax.default_backend())
    return next((b for b in chain[:-1] if not _refused(b, shape)), chain[-1])


def _gpu_is_rocm() -> bool:
    try:
        return jax.devices("gpu")[0].client.platform == "rocm"
    except RuntimeError:
        return False


def auto_gmm(lhs_MK, rhs_GKN, group_sizes_G, *, out_dtype):
    """`auto`: each platform's backend, picked when the caller is lowered (not traced).

    Every branch is traced (cheap), only the lowering platform's branch is lowered, so a CUDA
    module holds the GPU kernels and no CPU or ragged_dot code. Each branch's choice is noted
    (`note`) for an `auto_scope(events=...)`.
    """
    key = shape_key(lhs_MK, rhs_GKN, group_sizes_G, out_dtype)

    def branch(platform):
        name = resolve_backend("auto", platform, key)
        note({"asked": "auto", "platform": platform, "backend": name, "shape": key})
        return functools.partial(_REGISTRY[name].fn, out_dtype=out_dtype)
    return jax.lax.platform_dependent(
        lhs_MK, rhs_GKN, group_sizes_G, **{p: branch(p) for p in AUTO_PLATFORMS})


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


def grouped_matmul(lhs_MK: jax.Array, rhs_GKN: jax.Array, group_sizes_G: jax.Array, *,
                   backend: str = "auto", preferred_element_type: Any = None,
                   **options: Any) -> jax.Array:
    """out[r] = lhs[r] @ rhs[g(r)] for rows sorted by group; `jax.lax.ragged_dot` semantics.

    Args:
      lhs_MK: [M, K] rows sorted by group.
      rhs_GKN: [G, K, N] one matrix per group.
      group_sizes_G: [G] int rows per group, on device (traced under jit; never copied to host
        except by the `loop` baseline). Rows past the sum give zeros.
      backend: a name from `grouped_matmul_backends()`.
      preferred_element_type: output dtype (accumulation is float32 for float inputs);
        default: the promoted input dtype.
      **options: backend options (`tile_sizes` for tiled, `capacity` for padded, block sizes
        for pallas_gpu, `implementation` for tokamax); `auto` takes none.
    Returns: [M, N].
    Raises: ValueError for an unknown backend or option, bad shapes, negative sizes (when
      concrete), or the `loop` backend under jit.
    """
    lhs_MK, rhs_GKN = jnp.asarray(lhs_MK), jnp.asarray(rhs_GKN)
    group_sizes_G = jnp.asarray(group_sizes_G)
    spec = backend_spec(backend)
    unknown = sorted(set(options) - set(spec.options))
    if unknown:
        raise ValueError(f"grouped_matmul backend {spec.name!r} takes options "
                         f"{list(spec.options)}; got unknown {unknown}")
    check_operands(lhs_MK, rhs_GKN, group_sizes_G)
    out_dtype = jnp.dtype(preferred_element_type if preferred_element_type is not None
                          else jnp.result_type(lhs_MK, rhs_GKN))
    return spec.fn(lhs_MK, rhs_GKN, group_sizes_G.astype(jnp.int32), out_dtype=out_dtype,
                   **options)
