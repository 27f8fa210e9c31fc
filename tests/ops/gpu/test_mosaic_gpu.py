"""`mosaic_gpu` on CPU: its settings, its refusals, and the operands it hands to `pallas_gpu`.

Legend: M rows (sorted by group), K contraction dim, N output dim, G groups.

jax's Mosaic GPU kernels have no interpret mode, so their numerics need a GPU (the device check)
and their compiles need the CUDA plugin (test_mosaic_gpu_compile.py). Here: what runs instead,
checked against the reference backend.
"""
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from dropless.ops import grouped_matmul
from dropless.ops.gmm import registry
from dropless.ops.gpu import mosaic_gpu
from tests._support.gmm_reference import assert_same_with_grads, operands, with_grads


@pytest.mark.parametrize("options, match", [
    ({"block_m": 100}, "block_m=100 must be a multiple of 8"),
    ({"max_concurrent_steps": 0}, "max_concurrent_steps=0 must be an int >= 1"),
    ({"drhs": "triton"}, "drhs='triton' must be 'pallas' or 'mosaic'"),
])
def test_bad_options_are_named(options, match):
    with pytest.raises(ValueError, match=match):
        grouped_matmul(jnp.ones((8, 64)), jnp.ones((2, 64, 64)), jnp.array([4, 4]),
                       backend="mosaic_gpu", **options)


def test_config_by_rows_per_group_and_options():
    # 8192 rows over 64 groups: 128 a group -> 64-row tiles; over 8 groups: 1024 -> 128
    assert mosaic_gpu.config_for(8192, 1024, 1024, 64, mosaic_gpu.MosaicGpuConfig())[
        "block_m"] == 64
    big = mosaic_gpu.config_for(196608, 7168, 4096, 32, mosaic_gpu.MosaicGpuConfig())
    assert big == dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4,
                       grid_block_n=4)
    # N=320: 3 blocks of 128, which 4 does not divide: the snake falls to one block a row
    assert mosaic_gpu.config_for(196608, 7168, 320, 32, mosaic_gpu.MosaicGpuConfig())[
        "grid_block_n"] == 1
    mine = mosaic_gpu.config_for(8192, 1024, 1024, 8, mosaic_gpu.MosaicGpuConfig(
        block_m=192, max_concurrent_steps=6))
    assert (mine["block_m"], mine["max_concurrent_steps"]) == (192, 6)


def test_clipped_sizes_by_hand():
    got = mosaic_gpu.clipped_sizes(jnp.array([5, -1, 9, 2]), 10)
    np.testing.assert_array_equal(np.asarray(got), [5, 0, 5, 0])


def test_lowered_for_cpu_it_refuses_in_one_line():
    lhs, rhs = jnp.ones((128, 64), jnp.bfloat16), jnp.ones((2, 64, 64), jnp.bfloat16)
    with pytest.raises(Exception, match=mosaic_gpu.NO_CPU_TARGET) as e:
        grouped_matmul(lhs, rhs, jnp.array([60, 68]), backend="mosaic_gpu")
    assert len(str(e.value).strip().splitlines()) == 1


@pytest.mark.parametrize("sizes", [[5, 0, 7], [0, 12, 0], [3, 4, 2]])   # last: rows past the sum
def test_operands_it_cannot_take_run_pallas_gpu_exactly(sizes):
    lhs, rhs, gs, dy = operands(12, 8, 4, sizes)

    def run(backend):
        return with_grads(lambda a, b: grouped_matmul(a, b, gs, backend=backend), lhs, rhs, dy)
    events = []
    with registry.auto_scope(events=events):
        got = run("mosaic_gpu")
    assert_same_with_grads(got, run("reference"))
    assert events[0]["backend"] == "pallas_gpu" and "float32" in events[0]["reason"]


def test_empty_operands_give_zeros():
    out = grouped_matmul(jnp.ones((0, 64), jnp.bfloat16), jnp.ones((2, 64, 64), jnp.bfloat16),
                         jnp.array([0, 0]), backend="mosaic_gpu")
    assert out.shape == (0, 64) and out.dtype == jnp.bfloat16


def test_registered_and_usable_with_this_jax(monkeypatch):
    assert "mosaic_gpu" in registry.grouped_matmul_backends()
    assert registry.unusable("mosaic_gpu") is None
    # a jax without the kernels: one line saying so, and auto skips it
    monkeypatch.setitem(sys.modules, "jax.experimental.pallas.ops.gpu.ragged_dot_mgpu", None)
    mosaic_gpu.mosaic_problem.cache_clear()
    try:
        why = registry.unusable("mosaic_gpu")
        assert why.startswith("mosaic_gpu needs jax's Mosaic GPU ragged-dot kernels")
        assert len(why.splitlines()) == 1
    finally:
        monkeypatch.undo()
        mosaic_gpu.mosaic_problem.cache_clear()
