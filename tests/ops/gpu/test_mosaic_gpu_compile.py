"""`mosaic_gpu` compiled for an H200 without a GPU, at every shape of the shapes table.

Legend: M rows (sorted by group), K contraction dim, N output dim, G groups.

The compile-only H200 comes from the jax CUDA plugin (tests/_support/cuda_compile.py); the
operands are abstract (jax.ShapeDtypeStruct placed on it), so DeepSeek-V3's 196k-row product
costs no memory. Each compiled module is read for the kernels it launches: Mosaic GPU kernels
are `mosaic_gpu_v2` custom calls, Pallas/Triton ones `__gpu$xla.gpu.triton`. That checks what
runs each direction (and that XLA dropped the unused half of a VJP used for one direction).
"""
import collections
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import SingleDeviceSharding

from dropless.ops import grouped_matmul
from dropless.ops.gmm import registry, shapes, winners
from dropless.ops.gpu import mosaic_gpu
from dropless.ops.gpu.triton_check import abstract_gpu_target
from tests._support import cuda_compile

cuda_compile.require_plugin()

MOSAIC, TRITON = "mosaic_gpu_v2", "__gpu$xla.gpu.triton"


def operands(m, k, n, g, dtype=jnp.bfloat16):
    sh = SingleDeviceSharding(cuda_compile.devices("h200", 1)[0])

    def s(shape, dt=dtype):
        return jax.ShapeDtypeStruct(shape, dt, sharding=sh)
    return s((m, k)), s((g, k, n)), s((g,), jnp.int32), s((m, n))


def kernels(fn, *args) -> dict:
    """Custom-call kernels of `fn` compiled for the compile-only H200, by target."""
    with abstract_gpu_target():
        text = jax.jit(fn).lower(*args).compile().as_text()
    return dict(collections.Counter(re.findall(r'custom_call_target="([^"]+)"', text)))


def fwd_bwd(backend="mosaic_gpu", **options):
    def f(lhs, rhs, gs, dy):
        out, vjp = jax.vjp(lambda a, b: grouped_matmul(a, b, gs, backend=backend, **options),
                           lhs, rhs)
        return out, vjp(dy)
    return f


@pytest.mark.parametrize("shape", shapes.SHAPES, ids=lambda s: s.label)
def test_compiles_at_the_shapes_table(shape):
    lhs, rhs, gs, dy = operands(shape.m, shape.k, shape.n, shape.g)
    used = mosaic_gpu.kernels_used(shape.m, shape.k, shape.n, shape.g)
    assert (used["fwd"], used["dlhs"], used["drhs"]) == ("mosaic", "mosaic", "pallas_gpu")
    fwd = kernels(lambda a, b, s: grouped_matmul(a, b, s, backend="mosaic_gpu"), lhs, rhs, gs)
    assert fwd == {MOSAIC: 1}
    assert kernels(fwd_bwd(), lhs, rhs, gs, dy) == {MOSAIC: 2, TRITON: 1}


@pytest.mark.parametrize("label", ["small/G8", "qwen3_30b_a3b/down"])
def test_mosaic_weight_gradient_compiles(label):
    s = shapes.shape(label)
    assert mosaic_gpu.kernels_used(s.m, s.k, s.n, s.g, mosaic_gpu.MosaicGpuConfig(
        drhs="mosaic"))["drhs"] == "mosaic"
    assert kernels(fwd_bwd(drhs="mosaic"), *operands(s.m, s.k, s.n, s.g)) == {MOSAIC: 3}


def test_dims_the_kernels_cannot_take_run_pallas_gpu_for_that_direction():
    # block_k=128: K=192 is no multiple of it, so the forward runs ours; dlhs contracts N=128
    # and stores K=192 columns (a multiple of the 64-wide store tile): Mosaic
    cfg = mosaic_gpu.MosaicGpuConfig(block_k=128)
    used = mosaic_gpu.kernels_used(512, 192, 128, 4, cfg)
    assert (used["fwd"], used["dlhs"]) == ("pallas_gpu", "mosaic")
    assert kernels(fwd_bwd(block_k=128), *operands(512, 192, 128, 4)) == {MOSAIC: 1, TRITON: 2}
    # K=96: neither the forward's contraction nor dlhs's stored columns fit
    used = mosaic_gpu.kernels_used(512, 96, 128, 4)
    assert (used["fwd"], used["dlhs"]) == ("pallas_gpu", "pallas_gpu")
    assert kernels(fwd_bwd(), *operands(512, 96, 128, 4)) == {TRITON: 3}


def test_float32_runs_pallas_gpu_and_says_why():
    events = []
    with registry.auto_scope(events=events):
        got = kernels(fwd_bwd(), *operands(512, 128, 128, 4, jnp.float32))
    assert got == {TRITON: 3}
    mine = [e for e in events if e["asked"] == "mosaic_gpu"]
    assert mine and all(e["backend"] == "pallas_gpu" and "bf16/f16" in e["reason"]
                        for e in mine)


def test_auto_runs_each_direction_on_its_table_winner():
    s = shapes.shape("small/G64")
    b = winners.bucket(s.m, s.k, s.n, s.g)
    prov = {f: "test" for f in winners.PROVENANCE_FIELDS}
    rows = [{"device_kind": "NVIDIA H200", "bucket": b, "direction": d, "backend": w,
             "shape": s.label, "times_ms": {}}
            for d, w in (("fwd", "mosaic_gpu"), ("dlhs", "pallas_gpu"), ("drhs", "mosaic_gpu"))]
    events = []
    with winners.device_scope("NVIDIA H200", {"provenance": prov, "rows": rows}), \
            registry.auto_scope(events=events):
        got = kernels(fwd_bwd("auto"), *operands(s.m, s.k, s.n, s.g))
    # forward: Mosaic; dlhs: ours; drhs: mosaic_gpu's default drhs, ours. Nothing else runs
    # (each direction's VJP computes both gradients; XLA drops the unused one)
    assert got == {MOSAIC: 1, TRITON: 2}
    cuda = [e for e in events if e["asked"] == "auto" and e["platform"] == "cuda"]
    assert cuda[-1]["directions"] == {"fwd": "mosaic_gpu", "dlhs": "pallas_gpu",
                                      "drhs": "mosaic_gpu"}
