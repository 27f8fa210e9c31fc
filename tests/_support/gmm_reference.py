"""The plain-NumPy grouped matmul (a loop over groups, float64) and its gradients, and random
operands: the reference every grouped-matmul backend is checked against; a grouped matmul's
output and both gradients, and their comparison."""
import jax
import jax.numpy as jnp
import numpy as np


def np_gmm(lhs, rhs, sizes):
    """The definition, in float64: rows of group g times rhs[g]; rows past the sum are zero."""
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    start = 0
    for g, s in enumerate(sizes):
        out[start:start + s] = lhs[start:start + s] @ rhs[g]
        start += s
    return out


def np_gmm_grads(lhs, rhs, sizes, dy):
    lhs, rhs, dy = (np.asarray(a, np.float64) for a in (lhs, rhs, dy))
    dlhs, drhs = np.zeros_like(lhs), np.zeros_like(rhs)
    start = 0
    for g, s in enumerate(sizes):
        dlhs[start:start + s] = dy[start:start + s] @ rhs[g].T
        drhs[g] = lhs[start:start + s].T @ dy[start:start + s]
        start += s
    return dlhs, drhs


def operands(m, k, n, sizes, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    lhs = jnp.asarray(rng.standard_normal((m, k)), dtype)
    rhs = jnp.asarray(rng.standard_normal((len(sizes), k, n)), dtype)
    dy = jnp.asarray(rng.standard_normal((m, n)), dtype)
    return lhs, rhs, jnp.asarray(sizes, jnp.int32), dy


def with_grads(gmm, lhs, rhs, dy):
    """`gmm(lhs, rhs)` (a grouped matmul of two operands, sizes bound) and its gradients at dy:
    (out, dlhs, drhs)."""
    out, vjp = jax.vjp(gmm, lhs, rhs)
    return (out, *vjp(dy))


def assert_same_with_grads(got, want, tol: float = 1e-5) -> None:
    """Two (out, dlhs, drhs) triples agree within rtol = atol = `tol`; a mismatch names which."""
    for g, w, what in zip(got, want, ("out", "dlhs", "drhs"), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=tol, atol=tol,
                                   err_msg=what)
