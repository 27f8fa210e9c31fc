"""A CPU-only kernel asked for by name is refused in one line where it is lowered for another
platform (cpu_only.py), and nowhere else: the `native` backend lowered for CUDA on
this CPU host, forward and gradient-only; `auto`, which runs it on CPU, lowers for CUDA.

Legend: M rows, K contraction dim, N output dim, G groups.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.ops import grouped_matmul
from dropless.ops.native import load
from dropless.ops.gpu import triton_check
from dropless.ops.native.cpu_only import on_cpu_only
from tests._support.gmm_reference import np_gmm, np_gmm_grads, operands

on_cpu = pytest.mark.skipif(jax.default_backend() != "cpu",
                            reason="runs the kernel: the default backend is not the CPU")
built = pytest.mark.skipif(load.problem() is not None,
                           reason=f"the native library is not built: {load.problem()}")
REFUSED = re.escape("grouped_matmul backend 'native' runs on CPU only (a jax.ffi kernel "
                    "registered for the CPU) and this function is lowered for cuda: use "
                    "backend='auto' or 'tiled'")
SIZES = [3, 0, 5]   # an empty group; rows 8..9 past the sum


def _fwd(backend, gs):
    return lambda a, b: grouped_matmul(a, b, gs, backend=backend)


def _grads_only(backend, gs):
    # only the cotangents are used: XLA would drop the forward's outputs
    return jax.grad(lambda a, b: grouped_matmul(a, b, gs, backend=backend).sum(), (0, 1))


@built
@pytest.mark.parametrize("make", [_fwd, _grads_only], ids=["forward", "gradients_only"])
def test_native_by_name_lowered_for_cuda_is_refused_in_one_line(make):
    lhs, rhs, gs, _ = operands(10, 4, 6, SIZES)
    with pytest.raises(ValueError, match=REFUSED):
        triton_check.cuda_lowered(make("native", gs), lhs, rhs)


@built
def test_the_layer_with_native_by_name_lowered_for_cuda_is_refused_in_one_line():
    from dropless import moe
    from dropless.config import MoEConfig
    cfg = MoEConfig(num_experts=4, top_k=2, d_model=8, d_ff=16, gmm_backend="native")
    params = moe.init_params(jax.random.key(0), cfg)
    x = jnp.ones((6, 8), jnp.float32)
    loss = lambda p, x: moe.apply(p, x, cfg)[0].sum()   # noqa: E731
    for fn in (loss, jax.grad(loss)):
        with pytest.raises(ValueError, match=REFUSED):
            triton_check.cuda_lowered(fn, params, x)
    # lowered for the CPU it is the fused native FFN
    assert "dropless_gate_up_swiglu_f32" in jax.jit(jax.grad(loss)).lower(params, x).as_text()


@built
def test_auto_and_other_dtypes_are_not_refused():
    lhs, rhs, gs, _ = operands(10, 4, 6, SIZES)
    # auto runs native on CPU: its CPU branch is not lowered for CUDA
    cuda = triton_check.cuda_lowered(_grads_only("auto", gs), lhs, rhs).as_text()
    assert load.TARGET not in cuda and triton_check.TRITON_TARGET in cuda
    cpu = jax.jit(_grads_only("auto", gs)).lower(lhs, rhs).as_text()
    assert load.TARGET in cpu and "dropless_cpu_only" not in cpu
    # float16 runs tiled on every platform, by name too (so does bf16 where there is no AMX)
    f16 = [x.astype(jnp.float16) for x in (lhs, rhs)]
    assert load.TARGET not in triton_check.cuda_lowered(_fwd("native", gs), *f16).as_text()
    # bf16 on AMX: auto's CPU branch is not lowered for CUDA either
    b16 = [x.astype(jnp.bfloat16) for x in (lhs, rhs)]
    cuda = triton_check.cuda_lowered(_grads_only("auto", gs), *b16).as_text()
    assert load.BF16_TARGET not in cuda and "dropless_cpu_only" not in cuda


@built
def test_bf16_native_by_name_lowered_for_cuda_is_refused_where_amx_runs_it():
    lhs, rhs, gs, _ = operands(10, 4, 6, SIZES)
    b16 = [x.astype(jnp.bfloat16) for x in (lhs, rhs)]
    if not load.amx_ready():
        assert load.BF16_TARGET not in jax.jit(_fwd("native", gs)).lower(*b16).as_text()
        return
    with pytest.raises(ValueError, match=REFUSED):
        triton_check.cuda_lowered(_fwd("native", gs), *b16)


@on_cpu
@built
def test_on_cpu_the_kernel_runs_jitted_eager_and_vmapped():
    lhs, rhs, gs, dy = operands(10, 4, 6, SIZES)
    f = lambda a, b, d: jax.vjp(_fwd("native", gs), a, b)[1](d)   # noqa: E731
    dl, dr = jax.jit(f)(lhs, rhs, dy)
    edl, edr = np_gmm_grads(lhs, rhs, SIZES, dy)
    np.testing.assert_allclose(dl, edl, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dr, edr, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_fwd("native", gs)(lhs, rhs), np_gmm(lhs, rhs, SIZES),
                               rtol=1e-5, atol=1e-5)
    two = jax.vmap(_fwd("native", gs), (0, None))(jnp.stack([lhs, 2 * lhs]), rhs)
    np.testing.assert_allclose(two[1], 2 * np_gmm(lhs, rhs, SIZES), rtol=1e-5, atol=1e-5)


@on_cpu
def test_on_cpu_only_wraps_any_function_and_names_the_platform():
    f = on_cpu_only(lambda x: (2 * x, x.sum()), "my kernel is CPU-only, not {platform}")
    x = jnp.arange(4.0)
    out = jax.jit(f)(x)
    np.testing.assert_array_equal(out[0], 2 * x)
    assert float(out[1]) == 6.0
    assert float(jax.grad(lambda x: f(x)[1])(x).sum()) == 4.0
    with pytest.raises(ValueError, match=r"^my kernel is CPU-only, not cuda$"):
        jax.jit(lambda x: f(x)[0]).trace(x).lower(lowering_platforms=("cuda",))
    with pytest.raises(ValueError, match=r"^my kernel is CPU-only, not cpu/cuda$"):
        jax.jit(lambda x: f(x)[0]).trace(x).lower(lowering_platforms=("cpu", "cuda"))
