"""What the native library's tests share: the grouped matmul's forward and both gradients on the
`native` backend, jitted once, and a check of which GEMM kernel ran."""
import jax
import pytest

from dropless.ops import grouped_matmul
from dropless.ops.native import choice


@pytest.fixture(scope="session")
def fwd_bwd():
    """(lhs [M, K], rhs [G, K, N], sizes [G], dy [M, N]) -> (out, dlhs, drhs) on `native`."""
    def f(lhs, rhs, sizes, dy):
        out, pullback = jax.vjp(
            lambda a, b: grouped_matmul(a, b, sizes, backend="native"), lhs, rhs)
        return (out, *pullback(dy))
    return jax.jit(f)


@pytest.fixture
def only_ran():
    """only_ran(kernel, before): every GEMM since `before` (choice.gemm_calls()) ran on
    `kernel`, and some did."""
    def check(kernel, before):
        now = choice.gemm_calls()
        return now[kernel] > before[kernel] and all(now[k] == before[k] for k in now
                                                    if k != kernel)
    return check
