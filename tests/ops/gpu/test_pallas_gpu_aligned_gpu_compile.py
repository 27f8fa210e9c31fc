"""`pallas_gpu` on aligned segments compiled for a compile-only H200 at a shapes-table shape.

Legend: M routed rows, P rows of the aligned layout, K contraction dim, N output dim, G groups,
T row tiles.

Qwen3-30B-A3B's gate_up product on one GPU (ops/gmm/shapes.py: M=262,144, K=2048, N=1536,
G=128) in the layout `MoEConfig.align_expert_rows=128` builds: P = `permute.aligned_rows` rows,
every group a multiple of 128. One compile of its forward and backward (operands abstract:
jax.ShapeDtypeStruct on the compile-only H200 of the jax CUDA plugin), read for the Triton
kernels it launches and each one's grid, against `pallas_plan`'s tile model: T = P / 128 plain
row tiles for the forward and dlhs, no work list.
"""
import re

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from dropless.moe.permute import aligned_rows
from dropless.ops import grouped_matmul
from dropless.ops.gmm import shapes
from dropless.ops.gpu import pallas_plan
from dropless.ops.gpu.triton_check import abstract_gpu_target
from tests._support import cuda_compile

cuda_compile.require_plugin()

ALIGN = pallas_plan.ALIGNED_ROW_BLOCK


def test_aligned_kernels_compile_at_qwen3_gate_up():
    s = shapes.shape("qwen3_30b_a3b/gate_up")
    p = aligned_rows(s.m, s.g, ALIGN)
    sh = SingleDeviceSharding(cuda_compile.devices("h200", 1)[0])

    def arg(shape, dt=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dt, sharding=sh)

    def fwd_bwd(lhs, rhs, gs, dy):
        out, vjp = jax.vjp(lambda a, b: grouped_matmul(a, b, gs, backend="pallas_gpu",
                                                       group_alignment=ALIGN), lhs, rhs)
        return out, vjp(dy)
    with abstract_gpu_target():
        text = jax.jit(fwd_bwd).lower(arg((p, s.k)), arg((s.g, s.k, s.n)),
                                      arg((s.g,), jnp.int32), arg((p, s.n))).compile().as_text()
    grids = {}
    for line in text.splitlines():
        if "__gpu$xla.gpu.triton" in line and "custom-call(" in line:
            grids[re.search(r'name = "([^"]+)"', line)[1]] = int(
                re.search(r"grid_x = (\d+)", line)[1])
    assert "ragged" not in text
    # P = 262,144 + 128 x 127 rounded up to 128 = 278,400: T = 2,175 tiles of 128 rows
    tiles = pallas_plan.row_tiles_launched(p, s.g, ALIGN, aligned=True)
    assert (p, tiles) == (278400, 2175)
    # bf16 defaults: block_n 128, block_k 64 (drhs's [bk, bn] tiles per group)
    assert grids == {"dropless_gmm_aligned": tiles * (s.n // 128),
                     "dropless_gmm_dlhs_aligned": tiles * (s.k // 128),
                     "dropless_gmm_drhs": s.g * (s.k // 64) * (s.n // 128)}
