"""XLA flags and environment variables, applied before JAX creates its backend.

Three sources, in the order they yield to each other: what the process environment already holds
(always kept), the config's own `xla_flags` / `environment` (MaxText's `xla_*` keys and
upper-case environment keys land there), then the named recipe (`xla_recipe`). JAX reads
XLA_FLAGS and XLA_PYTHON_CLIENT_MEM_FRACTION when the first backend is created, not at import, so
`apply_startup` / `apply_recipe` must run before the first jax.devices() / computation.

An XLA flag the installed XLA does not know aborts the process at backend creation (a fatal
log line, no exception), so every flag is checked first against the names XLA knows
(`known_flag_names`): the `xla_*` names compiled into the installed jaxlib's and PJRT plugins'
shared objects, read from their bytes (~0.5 s, once per process). A flag whose name is not in
those bytes cannot be one XLA parses; a name found there is accepted (the set holds a few
hundred non-flag words too, so a rare typo that is one of them still reaches XLA).
"""
from __future__ import annotations

import functools
import mmap
import os
import re
from pathlib import Path

from dropless.runtime import environment
from dropless.runtime.environment import check_scalar, parse_environment

# name -> (XLA_FLAGS additions, other environment variables)
RECIPES: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    "none": ((), {}),
    # GPU recipe in the spirit of the MaxText / JAX-toolbox GPU guides: latency-hiding scheduler,
    # collectives combined into larger messages, async collectives on separate streams.
    "gpu": ((
        "--xla_gpu_enable_latency_hiding_scheduler=true",
        "--xla_gpu_enable_triton_gemm=false",
        "--xla_gpu_enable_command_buffer=",
        "--xla_gpu_all_reduce_combine_threshold_bytes=1073741824",
        "--xla_gpu_all_gather_combine_threshold_bytes=1073741824",
        "--xla_gpu_reduce_scatter_combine_threshold_bytes=1073741824",
        "--xla_gpu_enable_pipelined_all_gather=true",
        "--xla_gpu_enable_pipelined_reduce_scatter=true",
        "--xla_gpu_enable_pipelined_all_reduce=true",
        "--xla_gpu_enable_while_loop_double_buffering=true",
        "--xla_gpu_enable_all_gather_combine_by_dim=false",
        "--xla_gpu_enable_reduce_scatter_combine_by_dim=false",
        "--xla_disable_hlo_passes=rematerialization",
    ), {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.92", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}),
    # host devices for trying the mesh path on a CPU
    "cpu8": (("--xla_force_host_platform_device_count=8",), {}),
}


def recipe_env(name: str, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment changes `name` makes: XLA_FLAGS (existing flags kept, recipe appended
    unless the flag is already set) and any other variables. Raises ValueError on an unknown name."""
    if name not in RECIPES:
        raise ValueError(f"xla_recipe={name!r} is not known; known: {sorted(RECIPES)}")
    environ = dict(os.environ if environ is None else environ)
    flags, extra = RECIPES[name]
    current = environ.get("XLA_FLAGS", "").split()
    present = {f.split("=")[0] for f in current}
    added = [f for f in flags if f.split("=")[0] not in present]
    out = {k: v for k, v in extra.items() if k not in environ}
    if added:
        out["XLA_FLAGS"] = " ".join(current + added)
    return out


def backend_started() -> bool:
    """Whether JAX has already created a backend (after which flags no longer apply)."""
    import sys
    xb = sys.modules.get("jax._src.xla_bridge")
    return bool(xb is not None and getattr(xb, "_backends", None))


def ask_host_devices(n: int) -> bool:
    """Ask XLA:CPU for `n` host devices (`--xla_force_host_platform_device_count`), as a command
    that needs several devices on a CPU does before JAX starts. Does nothing where the backend
    already exists or XLA_FLAGS already names a count (the caller's wins); True when it set it.
    Only the host platform reads the flag: on a GPU the devices are the GPUs."""
    flags = os.environ.get("XLA_FLAGS", "")
    if backend_started() or "xla_force_host_platform_device_count" in flags:
        return False
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    return True


def apply_recipe(name: str) -> dict[str, str]:
    """Set the recipe's variables in os.environ; returns what was set. Raises RuntimeError when
    a JAX backend already exists and the recipe would change something."""
    changes = recipe_env(name)
    if changes and backend_started():
        raise RuntimeError(f"xla_recipe={name!r} must be applied before JAX starts; "
                           "a backend already exists")
    os.environ.update(changes)
    return changes


_FLAG = re.compile(r"^--([A-Za-z0-9_]+)(=.*)?$")
def flag_text(name: str, value) -> str:
    """A MaxText `xla_*` key and its YAML value -> one XLA flag: booleans as true/false, None or
    '' as an empty value (`--xla_gpu_enable_command_buffer=` turns command buffers off)."""
    if isinstance(value, bool):
        value = "true" if value else "false"
    elif value is None:
        value = ""
    check_scalar(name, value)
    return f"--{name}={value}"


def parse_flags(text: str) -> dict[str, str]:
    """'--a=1 --b' -> {'a': '--a=1', 'b': '--b'} (a later flag of the same name wins).
    Raises ValueError for a word that is not a --flag."""
    out: dict[str, str] = {}
    for word in text.split():
        m = _FLAG.match(word)
        if not m:
            raise ValueError(f"xla_flags: {word!r} is not an XLA flag (--name=value)")
        out[m.group(1)] = word
    return out


def check_flags(text: str) -> None:
    """Validate TrainConfig.xla_flags' syntax (ValueError naming the bad word)."""
    if not isinstance(text, str):
        raise ValueError(f"TrainConfig.xla_flags={text!r} must be a string of --flags")
    parse_flags(text)


def xla_binaries() -> list[Path]:
    """The shared objects that parse XLA_FLAGS in this installation: jaxlib's and those of the
    installed PJRT plugins (`jax_plugins.*`, `jax_cuda*_plugin`, libtpu)."""
    import importlib.util
    roots = []
    for mod in ("jaxlib", "jax_plugins", "jax_cuda12_plugin", "jax_cuda13_plugin", "libtpu"):
        spec = importlib.util.find_spec(mod)
        if spec is not None:
            roots += list(spec.submodule_search_locations or [])
    return sorted({p for r in roots for p in Path(r).rglob("*.so")})


@functools.lru_cache(maxsize=1)
def known_flag_names() -> frozenset[str]:
    """Every `xla_*` word in the bytes of `xla_binaries()` (each flag XLA registers is one)."""
    names: set[str] = set()
    for path in xla_binaries():
        with open(path, "rb") as fh:
            try:
                data = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:   # an empty file
                continue
            with data:
                names.update(w.decode() for w in re.findall(rb"xla_[a-z0-9_]+", data))
    return frozenset(names)


def unknown_flags(flags: tuple[str, ...]) -> tuple[str, ...]:
    """The flags (of `flags`, each --name or --name=value) whose name XLA does not know
    (`known_flag_names`; XLA_FLAGS has no --noname spelling: XLA aborts on it)."""
    known = known_flag_names()
    if not known:   # no jaxlib binary found to read: nothing can be said
        return ()
    bad = []
    for f in flags:
        name = f.lstrip("-").split("=", 1)[0]
        if name not in known:
            bad.append(f)
    return tuple(bad)


def check_environment_flags(text: str | None) -> None:
    """Raise ValueError naming XLA_FLAGS and the flag unless every word of `text` (the
    environment's XLA_FLAGS) is a --flag XLA knows; run before JAX starts a backend (XLA
    would abort the process on it)."""
    if not text or not text.strip():
        return
    try:
        flags = parse_flags(text)
    except ValueError as e:
        raise ValueError(f"XLA_FLAGS in the environment: {e}") from None
    bad = unknown_flags(tuple(flags.values()))
    if bad:
        import jaxlib
        raise ValueError(f"XLA_FLAGS in the environment holds {bad[0]!r}, a flag this XLA "
                         f"(jaxlib {jaxlib.__version__}) does not know; remove it from XLA_FLAGS")


def startup_env(cfg, environ: dict[str, str] | None = None) -> tuple[dict[str, str], list[str]]:
    """The environment changes `cfg` (a TrainConfig) asks for, and the lines that say so.

    Config flags are appended to XLA_FLAGS unless the environment already sets that flag (the
    environment's value is kept, and a line says so); then the recipe's, unless set by either.
    Config variables are set unless the environment holds them. Nothing is checked against XLA.
    """
    environ = dict(os.environ if environ is None else environ)
    lines: list[str] = []
    current = parse_flags(environ.get("XLA_FLAGS", ""))
    flags = dict(current)
    for name, word in parse_flags(cfg.xla_flags).items():
        if name in current and current[name] != word:
            lines.append(f"{word[2:]}: XLA_FLAGS in the environment already has "
                         f"{current[name]}; kept")
        flags.setdefault(name, word)
    changes: dict[str, str] = {}
    for name, value in parse_environment(cfg.environment).items():
        if name in environ and environ[name] != value:
            lines.append(f"{name}={value}: the environment already has "
                         f"{name}={environ[name]}; kept")
        elif name not in environ:
            changes[name] = value
    joined = " ".join(flags.values())
    recipe = recipe_env(cfg.xla_recipe, {**environ, **changes, "XLA_FLAGS": joined})
    changes.update(recipe)
    if recipe.get("XLA_FLAGS", joined) != environ.get("XLA_FLAGS", ""):
        changes["XLA_FLAGS"] = recipe.get("XLA_FLAGS", joined)
    return changes, lines


def apply_startup(cfg) -> list[str]:
    """Set what `startup_env` computes in os.environ; return the lines to print at start-up
    (XLA_FLAGS when any is set, each variable set, each value the environment overrode).

    Raises ValueError naming the flag when the installed XLA does not know a flag the config or
    its recipe adds (`unknown_flags`), or naming JAX_PLATFORMS when the config sets one that is
    not installed, and RuntimeError when a JAX backend already exists and something would change.
    """
    changes, lines = startup_env(cfg)
    before = set(parse_flags(os.environ.get("XLA_FLAGS", "")).values())
    ours = tuple(f for f in parse_flags(changes.get("XLA_FLAGS", "")).values()
                 if f not in before)   # the config's and the recipe's, not the user's
    bad = unknown_flags(ours) if ours else ()
    if bad:
        import jaxlib
        raise ValueError(f"xla flag {bad[0]!r} is not known to this XLA (jaxlib "
                         f"{jaxlib.__version__}); remove it from the config (or choose another "
                         f"xla_recipe than {cfg.xla_recipe!r} if it comes from there)")
    if "JAX_PLATFORMS" in changes:
        environment.check_platforms(changes["JAX_PLATFORMS"])
    if changes and backend_started():
        raise RuntimeError("XLA flags and environment must be applied before JAX starts; "
                           "a backend already exists")
    os.environ.update(changes)
    flags = os.environ.get("XLA_FLAGS", "")
    out = [f"XLA_FLAGS={flags!r}"] if flags else []   # none set: nothing to say
    out += [f"{k}={v}" for k, v in sorted(changes.items()) if k != "XLA_FLAGS"]
    return out + lines


def platform_notes(cfg, platform: str) -> list[str]:
    """One line per flag or variable of `cfg` that changes nothing on `platform` ('cpu', 'gpu',
    'tpu'): xla_gpu_* flags off GPU, xla_cpu_* off CPU, xla_tpu_* off TPU, then the
    environment's (`environment.platform_notes`)."""
    out = []
    for name in parse_flags(cfg.xla_flags):
        target = name.split("_")[1] if name.count("_") >= 2 else ""
        if target in ("gpu", "cpu", "tpu") and target != platform:
            out.append(f"{name}: an XLA:{target.upper()} flag; changes nothing on {platform}")
    return out + environment.platform_notes(cfg.environment, platform)
