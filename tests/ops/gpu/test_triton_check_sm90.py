"""Every `pallas_gpu` kernel compiled for Hopper (cuda:90, sm_90a) on this CPU host.

Legend: M rows, K contraction dim, N output dim, G groups.

What XLA does with a kernel on an H100/H200, done here with the `triton` wheel (it ships
ptxas): triton's make_ttir passes, triton's compiler for cuda:90 at the kernel's own warps and
stages, then `ptxas -v`. For bf16, f16 and f32, at the defaults, at configured blocks and at
the DeepSeek-V3 expert shape: it compiles, spills nothing, fits an H200 block's 227 KiB of
shared memory (and `pallas_plan.smem_bytes`, which refuses configurations that cannot fit, is
not below what triton allocates), and 16-bit kernels use wgmma. Skipped only where triton
cannot be imported (it installs with the `test` extra on Linux x86_64).
"""
import jax
import jax.numpy as jnp
import pytest

from dropless.ops import grouped_matmul
from dropless.ops.gpu import pallas_plan, triton_check
from dropless.ops.gpu.pallas_gpu import PallasGpuConfig, kernel_blocks

pytestmark = pytest.mark.skipif(triton_check.triton_available() is not None,
                                reason=str(triton_check.triton_available()))

KERNEL_OF = {"dropless_gmm": "fwd", "dropless_gmm_dlhs": "dlhs", "dropless_gmm_drhs": "drhs",
             "dropless_gmm_aligned": "fwd", "dropless_gmm_dlhs_aligned": "dlhs"}

# (dtype, (M, K, N, G), options): defaults at 8192 rows in 8 groups (block_m 128 for 16-bit)
# and in 64 (block_m 64), configured blocks, and the DeepSeek-V3 routed expert (K=7168,
# N=2048, G=256, 24576 rows), and the aligned grid (segments aligned to 128 rows: block_m 128
# at G=64 where the work list takes 64)
CASES = [
    ("bfloat16", (8192, 1024, 1024, 8), {}),
    ("bfloat16", (8192, 1024, 1024, 64), {}),
    ("float16", (8192, 1024, 1024, 8), {}),
    ("float32", (4096, 1024, 1024, 8), {}),
    ("bfloat16", (4096, 1024, 1024, 8), dict(block_m=64, block_k=32, block_n=64, num_stages=3)),
    ("float32", (4096, 1024, 1024, 8), dict(block_m=32, block_k=32, block_n=32)),
    ("bfloat16", (24576, 7168, 2048, 256), {}),
    ("float32", (24576, 7168, 2048, 256), {}),
    ("bfloat16", (8192, 1024, 1024, 64), dict(group_alignment=128)),
]


def _kernels(dtype, shape, options):
    m, k, n, g = shape
    dt = jnp.dtype(dtype)

    def f(lhs, rhs, gs, dy):
        out, vjp = jax.vjp(lambda a, b: grouped_matmul(a, b, gs, backend="pallas_gpu",
                                                       **options), lhs, rhs)
        return out, vjp(dy)
    args = (jax.ShapeDtypeStruct((m, k), dt), jax.ShapeDtypeStruct((g, k, n), dt),
            jax.ShapeDtypeStruct((g,), jnp.int32), jax.ShapeDtypeStruct((m, n), dt))
    return triton_check.triton_kernels(triton_check.cuda_lowered(f, *args))


@pytest.mark.parametrize("dtype,shape,options", CASES,
                         ids=[f"{d}-{'x'.join(map(str, s))}-{'-'.join(f'{k}{v}' for k, v in o.items()) or 'defaults'}"
                              for d, s, o in CASES])
def test_kernels_compile_for_sm90_within_h200_resources(dtype, shape, options, tmp_path):
    m, k, n, g = shape
    kernels = _kernels(dtype, shape, options)
    assert sorted(KERNEL_OF[kk.name] for kk in kernels) == ["dlhs", "drhs", "fwd"]
    options = dict(options)
    align = options.pop("group_alignment", 1)
    assert all(kk.name.endswith("_aligned") for kk in kernels
               if KERNEL_OF[kk.name] != "drhs") == (align > 1)
    cfg = PallasGpuConfig(**options)
    dims = {"fwd": (k, n), "dlhs": (n, k), "drhs": (k, n)}
    for kernel in kernels:
        which = KERNEL_OF[kernel.name]
        blocks = kernel_blocks(cfg, which, dtype, m, *dims[which], g, align)
        assert (kernel.num_warps, kernel.num_stages) == (blocks.num_warps, blocks.num_stages)
        build = triton_check.compile_sm90(kernel, str(tmp_path))
        assert build.spill_bytes == 0, build
        assert build.registers <= 255, build
        assert build.shared_bytes <= pallas_plan.H200_SMEM_PER_BLOCK, build
        assert build.shared_bytes <= pallas_plan.smem_bytes(which, blocks, dtype), (build, blocks)
        assert build.wgmma == pallas_plan.uses_wgmma(which, blocks, dtype), (build, blocks)


def test_a_configuration_that_cannot_fit_is_refused_in_one_line():
    # f32 drhs at the former defaults: 3 buffers x (128x64 + 128x128) x 4 B = 288 KiB
    lhs, rhs = jnp.ones((256, 128)), jnp.ones((2, 128, 128))
    f = jax.grad(lambda b: grouped_matmul(lhs, b, jnp.array([100, 100]), backend="pallas_gpu",
                                          block_m=128, block_k=64, block_n=128,
                                          num_stages=4).sum())
    with pytest.raises(ValueError) as e:
        jax.eval_shape(f, rhs)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("pallas_gpu block_m=128, block_k=64, block_n=128, num_stages=4: "
                          "the drhs kernel in float32 needs 288 KiB"), msg
    assert "227 KiB" in msg and "lower num_stages or a block size" in msg
