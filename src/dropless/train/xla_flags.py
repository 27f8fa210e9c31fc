"""XLA flag recipes, applied to the environment before JAX creates its backend.

JAX reads XLA_FLAGS and XLA_PYTHON_CLIENT_MEM_FRACTION when the first backend is created, not at
import, so `apply_recipe` must run before the first jax.devices() / computation.
"""
from __future__ import annotations

import os

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


def apply_recipe(name: str) -> dict[str, str]:
    """Set the recipe's variables in os.environ; returns what was set. Raises RuntimeError when
    a JAX backend already exists and the recipe would change something."""
    changes = recipe_env(name)
    if changes and backend_started():
        raise RuntimeError(f"xla_recipe={name!r} must be applied before JAX starts; "
                           "a backend already exists")
    os.environ.update(changes)
    return changes
