"""Permutation: the hand-worked example and gradients against plain autodiff of gathers."""
import jax
import jax.numpy as jnp
import numpy as np

from dropless.moe import permute as perm


def test_hand_worked_example():
    # from the module docstring: T=3, K=2, E=3
    ids = jnp.array([[2, 0], [0, 1], [2, 1]])
    p = perm.sort_by_expert(ids, 3)
    assert p.order_N.tolist() == [1, 2, 3, 5, 0, 4]
    assert p.inv_N.tolist() == [4, 0, 1, 2, 5, 3]
    assert p.group_sizes_E.tolist() == [2, 2, 2]
    x = jnp.array([[10.0], [20.0], [30.0]])
    assert perm.permute(x, p.order_N, p.inv_N, 2)[:, 0].tolist() == [10, 20, 20, 30, 10, 30]


def test_empty_experts_and_round_trip():
    ids = jnp.array([[4, 1], [4, 1], [1, 4]])  # experts 0, 2, 3 receive nothing
    p = perm.sort_by_expert(ids, 5)
    assert p.group_sizes_E.tolist() == [0, 3, 0, 0, 3]
    x = jnp.arange(6.0).reshape(3, 2)
    x_nd = perm.permute(x, p.order_N, p.inv_N, 2)
    back = perm.unpermute(x_nd, p.order_N, p.inv_N, 2)
    np.testing.assert_array_equal(back, jnp.repeat(x[:, None], 2, axis=1))


def test_grads_match_autodiff_of_plain_gathers():
    key = jax.random.key(0)
    t, k, e, d = 7, 3, 5, 4
    ids = jax.vmap(lambda kk: jax.random.choice(kk, e, (k,), replace=False))(
        jax.random.split(key, t))
    p = perm.sort_by_expert(ids, e)
    x = jax.random.normal(key, (t, d))
    w_nd = jax.random.normal(jax.random.key(1), (t * k, d))
    w_tkd = jax.random.normal(jax.random.key(2), (t, k, d))
    plain_perm = lambda x: x[p.order_N // k]
    plain_unperm = lambda y: y[p.inv_N].reshape(t, k, d)
    f = lambda x: jnp.sum(perm.permute(x, p.order_N, p.inv_N, k) * w_nd)
    g = lambda x: jnp.sum(plain_perm(x) * w_nd)
    np.testing.assert_allclose(jax.grad(f)(x), jax.grad(g)(x), rtol=1e-6)
    y = jax.random.normal(key, (t * k, d))
    f = lambda y: jnp.sum(perm.unpermute(y, p.order_N, p.inv_N, k) * w_tkd)
    g = lambda y: jnp.sum(plain_unperm(y) * w_tkd)
    np.testing.assert_allclose(jax.grad(f)(y), jax.grad(g)(y), rtol=1e-6)
