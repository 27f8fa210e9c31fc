"""Every Triton module our CUDA lowering emits parses and verifies as XLA parses it.

Legend: M rows, K contraction dim, N output dim, G groups.

XLA's Triton emitter parses the serialized module of each `__gpu$xla.gpu.triton` custom call
(MLIR with the Triton dialect registered) before compiling it; a module that does not verify
fails the whole program on a GPU. `triton_check.verify` does the same parse here. The MoE layer
and a train step are verified in test_cuda_lowering.py (same helper); here: the grouped matmul's
three kernels in every dtype, and the check failing on the bug it was written for.
"""
import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from dropless.ops import grouped_matmul
from dropless.ops.gpu import triton_check

G, M, K, N = 6, 56, 24, 40
SIZES = jnp.array([9, 0, 20, 1, 3, 13], jnp.int32)


def fwd_bwd(lhs, rhs, gs, dy):
    out, vjp = jax.vjp(lambda a, b: grouped_matmul(a, b, gs, backend="pallas_gpu"), lhs, rhs)
    return out, vjp(dy)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_every_pallas_gpu_kernel_verifies(dtype):
    dt = jnp.dtype(dtype)
    args = (jax.ShapeDtypeStruct((M, K), dt), jax.ShapeDtypeStruct((G, K, N), dt), SIZES,
            jax.ShapeDtypeStruct((M, N), dt))
    kernels = triton_check.triton_kernels(triton_check.cuda_lowered(fwd_bwd, *args))
    assert sorted(k.name for k in kernels) == ["dropless_gmm", "dropless_gmm_dlhs",
                                               "dropless_gmm_drhs"]
    for kernel in kernels:
        text = triton_check.verify(kernel)
        assert "tt.func" in text and "scf.for" in text, kernel.name


def _old_trips_kernel(n_ref, x_ref, o_ref):
    # the pre-fix `_gmm_kernel` pattern: weak-typed literals in the where that bounds the loop
    trips = jnp.where(n_ref[0] > 0, 4, 0)
    o_ref[...] = lax.fori_loop(0, trips, lambda i, acc: acc + x_ref[...], x_ref[...] * 0)


def test_verify_rejects_the_invalid_loop_bound():
    call = pl.pallas_call(_old_trips_kernel, out_shape=jax.ShapeDtypeStruct((16, 16),
                                                                            jnp.float32),
                          compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
                          name="old_trips")
    args = (jax.ShapeDtypeStruct((1,), jnp.int32), jax.ShapeDtypeStruct((16, 16), jnp.float32))
    [kernel] = triton_check.triton_kernels(triton_check.cuda_lowered(call, *args))
    with pytest.raises(ValueError, match=r"scf.for.*same type"):
        triton_check.verify(kernel)
