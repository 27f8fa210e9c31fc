"""Environment variables a config may set (`TrainConfig.environment`, MaxText's upper-case
keys): which names are allowed, the values some must have, and which platform reads them.

Applying them (before JAX creates its backend, beside the XLA flags) is
`dropless.runtime.xla_flags.apply_startup`'s job; this module only parses and checks.
"""
from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

_ENV_NAME = re.compile(r"^[A-Z][A-Z0-9_]*$")
# environment variables a config may set: these prefixes (XLA_FLAGS has its own key, xla_flags)
ENV_PREFIXES = ("XLA_", "CUDA_", "NCCL_", "NVTE_", "JAX_", "TF_", "TPU_")
# ... and the values some of them must have: name -> (check, what it must be)
_ENV_RULES = {
    "XLA_PYTHON_CLIENT_MEM_FRACTION": (lambda v: 0 < float(v) <= 1, "a fraction in (0, 1]"),
    "CUDA_DEVICE_MAX_CONNECTIONS": (lambda v: int(v) >= 1, "a positive int"),
    "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB": (lambda v: float(v) > 0, "a positive number"),
    "XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE": (lambda v: v in ("true", "false"), "true or false"),
    "XLA_PYTHON_CLIENT_PREALLOCATE": (lambda v: v in ("true", "false"), "true or false"),
}
# variables only a GPU backend reads (on other platforms they change nothing)
GPU_ONLY_ENV = ("CUDA_", "NCCL_", "NVTE_", "XLA_PJRT_GPU_")
ACCELERATOR_ENV = ("XLA_PYTHON_CLIENT_",)   # the GPU/TPU memory allocator; not the CPU's


def check_scalar(name: str, value) -> None:
    """Raise ValueError naming `name` unless `value` is one number or word (no list, no space):
    what one XLA flag or one environment variable can hold."""
    if not isinstance(value, (str, int, float)) or any(c.isspace() for c in str(value)):
        raise ValueError(f"{name}={value!r} must be one number, word or true/false "
                         "(no lists, no spaces)")


def env_text(name: str, value) -> str:
    """An upper-case environment key and its YAML value -> NAME=value (booleans lower-case)."""
    if isinstance(value, bool):
        value = "true" if value else "false"
    check_scalar(name, value)
    return f"{name}={value}"


def parse_environment(text: str) -> dict[str, str]:
    """'A=1 B=x' -> {'A': '1', 'B': 'x'}. Raises ValueError naming the entry for a bad name or
    value (see ENV_PREFIXES and the value rules)."""
    out: dict[str, str] = {}
    for word in text.split():
        name, eq, value = word.partition("=")
        if not eq or not _ENV_NAME.match(name):
            raise ValueError(f"environment: {word!r} must look like NAME=value")
        if name == "XLA_FLAGS":
            raise ValueError("environment: XLA_FLAGS is set through xla_flags (or MaxText xla_* "
                             "keys), not environment")
        if not name.startswith(ENV_PREFIXES):
            raise ValueError(f"environment variable {name}={value!r} is not one a config sets; "
                             f"names start with one of {ENV_PREFIXES}")
        if name in _ENV_RULES:
            ok, what = _ENV_RULES[name]
            try:
                good = ok(value)
            except ValueError:
                good = False
            if not good:
                raise ValueError(f"environment variable {name}={value!r} must be {what}")
        out[name] = value
    return out


def check_environment(text: str) -> None:
    """Validate TrainConfig.environment (ValueError naming the variable and value)."""
    if not isinstance(text, str):
        raise ValueError(f"TrainConfig.environment={text!r} must be a string of NAME=value")
    parse_environment(text)


def platform_notes(environment: str, platform: str) -> list[str]:
    """One line per variable of `environment` (TrainConfig.environment) that changes nothing on
    `platform` ('cpu', 'gpu', 'tpu'): GPU-only variables off GPU, the accelerator allocator's
    on CPU."""
    out = []
    for name in parse_environment(environment):
        if name.startswith(GPU_ONLY_ENV) and platform != "gpu":
            out.append(f"{name}: read by the GPU runtime only; changes nothing on {platform}")
        elif name.startswith(ACCELERATOR_ENV) and platform == "cpu":
            out.append(f"{name}: read by the GPU/TPU allocator only; changes nothing on cpu")
    return out


# JAX_PLATFORMS names -> what must be installed for them (checked before any backend starts:
# JAX itself fails at the first computation with "Unable to initialize backend")
_PLATFORM_NEEDS = {"cuda": ("cuda",), "rocm": ("rocm",), "gpu": ("cuda", "rocm"), "tpu": ("tpu",)}


def installed_platforms() -> list[str]:
    """The JAX platforms this installation could start, without starting any: cpu always, and
    one per installed PJRT plugin (the `jax_plugins` namespace modules and entry points JAX
    loads: `jax_cuda13_plugin` -> cuda) and libtpu (tpu)."""
    import pkgutil
    from importlib.metadata import entry_points
    names = []
    spec = importlib.util.find_spec("jax_plugins")
    if spec is not None and spec.submodule_search_locations:
        names += [m.name for m in pkgutil.iter_modules(spec.submodule_search_locations)]
    names += [e.value for e in entry_points(group="jax_plugins")]
    if importlib.util.find_spec("libtpu") is not None:
        names.append("tpu")
    found = ["cpu"]
    for n in names:
        n = n.lower()
        kind = next((k for k in ("cuda", "rocm", "tpu") if k in n), n.split(".")[-1])
        found.append(kind)
    return list(dict.fromkeys(found))


def check_platforms(value: str | None) -> None:
    """Raise ValueError naming JAX_PLATFORMS unless each of its comma-separated names is a
    platform this installation has (`installed_platforms`); None or '' lets JAX choose."""
    if not value:
        return
    have = installed_platforms()
    for name in value.split(","):
        name = name.strip().lower()
        wants = _PLATFORM_NEEDS.get(name, (name,))
        if name and any(w in have for w in wants):
            continue
        known = name in _PLATFORM_NEEDS or name == "cpu"
        why = (f"no {name.upper()} runtime is installed" if known
               else f"{name!r} is not a JAX platform installed here")
        raise ValueError(f"JAX_PLATFORMS={value!r}: {why} (available: {', '.join(have)}); set "
                         "it to one of those, or unset it to let JAX choose")


def check_writable_folder(path: str | os.PathLike, what: str) -> None:
    """Raise ValueError naming `what` and `path` unless `path` is a folder this process can
    write into, or one it can create (its nearest existing parent is a writable folder and no
    part of the path is a file)."""
    p = Path(path).expanduser().absolute()
    probe = p
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise ValueError(f"{what} {str(path)!r}: {probe} is a file, not a folder; choose "
                         "another folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        where = "" if probe == p else f" (its parent {probe} cannot be written into)"
        raise ValueError(f"{what} {str(path)!r} is not writable{where}; choose a folder you "
                         "can write to")


def format_bytes(b: float) -> str:
    """Bytes as 'x.xx GiB' (or 'x.x TiB' from 1 TiB)."""
    return f"{b / 2 ** 40:.1f} TiB" if b >= 2 ** 40 else f"{b / 2 ** 30:.2f} GiB"


def host_memory() -> float:
    """Bytes of this host's RAM, or its cgroup limit if lower."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        cg = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if cg.isdigit():
            ram = min(ram, int(cg))
    except OSError:
        pass
    return float(ram)


def device_memory() -> tuple[float, str]:
    """(bytes one device may use, where the number came from): what JAX reports
    (`bytes_limit`) on an accelerator; on a CPU the host's RAM (`host_memory`) shared by the
    local host devices. Starts JAX's backend."""
    import jax
    dev = jax.local_devices()[0]
    if dev.platform != "cpu":
        stats = dev.memory_stats() or {}
        if stats.get("bytes_limit"):
            return float(stats["bytes_limit"]), f"{dev.device_kind} bytes_limit"
    ram = host_memory()
    n = jax.local_device_count()
    return ram / n, f"host RAM {format_bytes(ram)}" + (f" / {n} host devices" if n > 1 else "")


def check_fits(needed: float, what: str, advice: str, *, on_device: bool = True) -> None:
    """Raise ValueError naming `what` when `needed` bytes (a lower bound of what it must hold at
    once) exceed the memory of one device (`device_memory`, which starts the backend), or with
    `on_device=False` this host's RAM (nothing started: for a caller that sets XLA flags
    itself)."""
    if on_device:
        limit, source = device_memory()
    else:
        limit = host_memory()
        source = "this host's RAM"
    if needed > limit:
        raise ValueError(f"{what} needs at least {format_bytes(needed)} of memory, more than the "
                         f"{format_bytes(limit)} available ({source}); {advice}")


def check_output_file(path: str | os.PathLike, what: str) -> None:
    """Raise ValueError naming `what` (the flag) and `path` unless a file can be written at
    `path`: it is not a folder, not a pipe or device (nor a link to one), and its folder exists as a writable folder or can be created
    (see `check_writable_folder`). Run before any work whose result goes there."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise ValueError(f"{what} {str(path)!r} is a folder; name a file")
    if p.exists() and not p.is_file() or p.is_symlink() and not p.resolve().is_file():
        raise ValueError(f"{what} {str(path)!r} is not a regular file (a pipe, a device or a "
                         "link to one); name a file")
    check_writable_folder(p.absolute().parent, f"{what} {str(path)!r}: its folder")
