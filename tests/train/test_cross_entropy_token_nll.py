"""`cross_entropy.token_nll`, the per-position cross-entropy the loss sums: optax's
`softmax_cross_entropy_with_integer_labels` bit for bit, values and gradients (float32 and
from bfloat16 logits), at extreme logits, and a gradient with no scatter: the target's logit
is picked by a compare, so the backward pass is one elementwise pass over the logits."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dropless.train import cross_entropy

from tests._support.jaxpr_walk import traced


def _operands(b=3, s=7, v=50, seed=0, scale=4.0):
    rng = np.random.default_rng(seed)
    logits = jnp.asarray(rng.standard_normal((b, s, v)) * scale, jnp.float32)
    targets = jnp.asarray(rng.integers(0, v, (b, s)), jnp.int32)
    g = jnp.asarray(rng.standard_normal((b, s)), jnp.float32)
    return logits, targets, g


def _value_and_grad(fn, logits, targets, g):
    out, pull = jax.vjp(lambda x: fn(x, targets), logits)
    return out, pull(g)[0]


@pytest.mark.parametrize("scale", [1e-3, 4.0, 80.0])
def test_same_bits_as_optax(scale):
    logits, targets, g = _operands(scale=scale)
    got = jax.jit(lambda x, t, g: _value_and_grad(cross_entropy.token_nll, x, t, g))(logits, targets, g)
    want = jax.jit(lambda x, t, g: _value_and_grad(
        optax.softmax_cross_entropy_with_integer_labels, x, t, g))(logits, targets, g)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_against_float64():
    logits, targets, _ = _operands(seed=3)
    x = np.asarray(logits, np.float64)
    lse = np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1)) + x.max(-1)
    want = lse - np.take_along_axis(x, np.asarray(targets)[..., None], -1)[..., 0]
    np.testing.assert_allclose(cross_entropy.token_nll(logits, targets), want, rtol=1e-6, atol=1e-6)


def test_bfloat16_logits_through_the_loss():
    logits, targets, g = _operands(seed=5)
    logits = logits.astype(jnp.bfloat16)
    f = lambda fn: jax.grad(lambda x: jnp.sum(fn(x.astype(jnp.float32), targets) * g))(logits)
    got = jax.jit(lambda: f(cross_entropy.token_nll))()
    want = jax.jit(lambda: f(optax.softmax_cross_entropy_with_integer_labels))()
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_gradient_has_no_gather_or_scatter():
    logits, targets, _ = _operands()
    def primitives(fn) -> set[str]:
        return {e.primitive.name for e in traced(jax.grad(lambda x: fn(x, targets).sum()),
                                                 logits)}
    ours = primitives(cross_entropy.token_nll)
    theirs = primitives(optax.softmax_cross_entropy_with_integer_labels)
    assert any(p.startswith("scatter") for p in theirs)   # what the check would see
    assert not any(p.startswith(("scatter", "gather")) for p in ours)
