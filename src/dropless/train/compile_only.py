"""Compile for an NVIDIA H100 or H200 without one: a compile-only device from the jax CUDA
plugin (`jax-cuda13-plugin` + `jax-cuda13-pjrt` of jax's version, what `jax[cuda13]` and so
`dropless[gpu]` install, or no GPU runtime with --no-deps; the CUDA 12 build, where jax still
publishes one, serves too) and a target description of the GPU, so that `compiled.memory_analysis()` says what the executable
would need on it while costing no device memory.

The target descriptions carry the fields of XLA's GPU specs that this XLA reads (XLA's
`xla/backends/gpu/target_config/*.txtpb`: h100_sxm); the H200 differs from the H100 SXM in its
memory (141 GB of HBM3e, 4.8 TB/s: NVIDIA's H200 datasheet) only. The process must run with
JAX_PLATFORMS=cpu: with the CUDA platform requested and no driver the plugin's start-up fails
and registers no topology factory.
"""
from __future__ import annotations

import functools

_TARGET = """
gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132
  fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: {bandwidth} l2_cache_size: 52428800
  clock_rate_ghz: 1.98 device_memory_size: {memory} shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 }} registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 1 }}
device_description_str: "{name}"
"""
# GPUs on one host of each kind (an HGX H100/H200 board): the most devices a compile-only step
# is compiled for (`train.preflight.target_devices`), so a plan of a cluster is not compiled as
# one impossible host of thousands of devices
HOST_GPUS = {"h100": 8, "h200": 8}
# bytes of device memory of each kind (what cudaMemGetInfo reports as total on the device)
MEMORY_BYTES = {"h100": 84942979072, "h200": 150754820096}
NAMES = {"h100": "NVIDIA H100 80GB HBM3", "h200": "NVIDIA H200"}
BANDWIDTH = {"h100": 3352320000000, "h200": 4800000000000}
TARGETS = {k: _TARGET.format(bandwidth=BANDWIDTH[k], memory=MEMORY_BYTES[k], name=NAMES[k])
           for k in MEMORY_BYTES}


# the plugin modules looked for, in jax's own order (jax_plugins: cuda13 before cuda12)
PLUGINS = ("xla_cuda13", "xla_cuda12")


def plugin() -> str | None:
    """The jax CUDA plugin module importable here (`jax_plugins.<name>`), None without one."""
    import importlib
    for name in PLUGINS:
        try:
            importlib.import_module(f"jax_plugins.{name}")
        except ImportError:
            continue
        return name
    return None


def unavailable() -> str:
    """Why a compile-only CUDA device cannot be made here ('' when it can)."""
    if plugin() is None:
        return "the jax CUDA plugin is not installed (jax-cuda13-plugin and jax-cuda13-pjrt " \
               "of this jax's version, --no-deps)"
    return ""


@functools.lru_cache(maxsize=None)
def devices(kind: str = "h100", n: int = 1) -> tuple:
    """n compile-only CUDA devices of `kind` ("h100" or "h200"; one host, topology 1x1xn).
    Raises ValueError for another kind or when the plugin is missing (`unavailable`)."""
    if kind not in TARGETS:
        raise ValueError(f"hardware={kind!r} has no compile-only target; known: "
                         f"{sorted(TARGETS)}")
    why = unavailable()
    if why:
        raise ValueError(f"cannot compile for an {kind.upper()} here: {why}")
    from jax.experimental import topologies
    topo = topologies.get_topology_desc(platform="cuda", target_config=TARGETS[kind],
                                        topology=f"1x1x{n}")
    return tuple(topo.devices)
