"""Compile for an NVIDIA H100 or H200 without a GPU: compile-only topologies from the jax CUDA
plugin (`jax-cuda12-plugin` + `jax-cuda12-pjrt`, the jax version's, installed with --no-deps by
.ci/jax_leg) and a target description of the device.

`devices(kind, n)` gives n compile-only devices of `kind` ("h100" or "h200"); arrays placed on
them are abstract (jax.ShapeDtypeStruct with a sharding), so a compile costs no device memory and
`compiled.memory_analysis()` reports what the executable would need. `require_plugin()` skips a
test where the plugin is absent, except in the GPU leg of CI (DROPLESS_GPU_LEG=required, set by
the Makefile), where its absence is a failure: a leg that skips its compiles proves nothing.
The process must run with JAX_PLATFORMS=cpu (tests/conftest.py sets it): with the CUDA platform
requested and no driver, the plugin's start-up fails and registers no topology factory.

The target descriptions carry the fields of XLA's GPU specs that this XLA reads (XLA's
`xla/backends/gpu/target_config/*.txtpb`: h100_sxm); the H200 differs from the H100 SXM in its
memory (141 GB of HBM3e, 4.8 TB/s: NVIDIA's H200 datasheet) only.
"""
from __future__ import annotations

import functools
import os

import pytest

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
TARGETS = {
    "h100": _TARGET.format(bandwidth=3352320000000, memory=84942979072,
                           name="NVIDIA H100 80GB HBM3"),
    "h200": _TARGET.format(bandwidth=4800000000000, memory=150754820096, name="NVIDIA H200"),
}
# bytes of device memory each kind's target description declares (what a fit is checked against)
MEMORY_BYTES = {"h100": 84942979072, "h200": 150754820096}


def require_plugin() -> None:
    """Skip the calling test (or module, at import) without the jax CUDA plugin; in the GPU leg
    (DROPLESS_GPU_LEG=required) fail instead."""
    try:
        import jax_plugins.xla_cuda12  # noqa: F401
    except ImportError:
        if os.environ.get("DROPLESS_GPU_LEG") == "required":
            pytest.fail("the GPU leg needs the jax CUDA plugin (jax-cuda12-plugin and "
                        "jax-cuda12-pjrt of this jax's version; .ci/jax_leg installs them)")
        pytest.skip("needs the jax CUDA plugin (compile only)", allow_module_level=True)


@functools.lru_cache(maxsize=None)
def devices(kind: str = "h200", n: int = 1) -> tuple:
    """n compile-only CUDA devices of `kind` (one host, topology 1x1xn)."""
    from jax.experimental import topologies
    topo = topologies.get_topology_desc(platform="cuda", target_config=TARGETS[kind],
                                        topology=f"1x1x{n}")
    return tuple(topo.devices)
