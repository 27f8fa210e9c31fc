"""The output head in a narrow compute dtype (`decoder.head_logits`): float32 logits forward,
and a backward pass whose two products take the logits' cotangent rounded to the compute dtype
(as autodiff of the other products does), against a float64 reference, and with no float32
product of the [B, S, V] cotangent left in the gradient."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.config import ModelConfig
from dropless.models import decoder

from tests._support.jaxpr_walk import equations

B, S, D, V = 2, 5, 16, 48


def _operands(dtype=jnp.bfloat16, seed=0):
    rng = np.random.default_rng(seed)
    z = jnp.asarray(rng.standard_normal((B, S, D)), dtype)
    w = jnp.asarray(rng.standard_normal((D, V)) / 4, dtype)
    g = jnp.asarray(rng.standard_normal((B, S, V)), jnp.float32)
    return z, w, g


def _bf16(x):
    return np.asarray(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32),
                      np.float64)


def test_forward_is_the_float32_product():
    z, w, _ = _operands()
    got = jax.jit(decoder.head_logits)(z, w)
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(got, jnp.dot(z, w, preferred_element_type=jnp.float32))


def test_gradients_against_float64_with_the_cotangent_rounded():
    z, w, g = _operands()
    d_z, d_w = jax.jit(lambda z, w, g: jax.vjp(decoder.head_logits, z, w)[1](g))(z, w, g)
    assert d_z.dtype == jnp.bfloat16 and d_w.dtype == jnp.bfloat16
    g64 = _bf16(g)                                    # the cotangent in the compute dtype
    z64, w64 = np.asarray(z, np.float64), np.asarray(w, np.float64)
    want_z = np.einsum("bsv,dv->bsd", g64, w64)
    want_w = np.einsum("bsd,bsv->dv", z64, g64)
    # each accumulated in float32 and rounded once to bfloat16: within half a bf16 ulp (+ f32)
    for got, want in ((d_z, want_z), (d_w, want_w)):
        got = np.asarray(got, np.float64)
        np.testing.assert_allclose(got, want, rtol=2.0 ** -8 + 1e-6,
                                   atol=1e-6 * np.abs(want).max())
        np.testing.assert_array_equal(got, _bf16(got))


def _float32_products(jaxpr, size: int) -> int:
    """dot_general equations (nested bodies included) with a float32 operand of `size`
    elements."""
    return sum(eqn.primitive.name == "dot_general"
               and any(v.aval.dtype == jnp.float32 and v.aval.size == size for v in eqn.invars)
               for eqn in equations(jaxpr))


@pytest.mark.parametrize("tie", [False, True])
def test_model_gradient_has_no_float32_product_of_the_logits(tie):
    cfg = ModelConfig(vocab_size=V, d_model=D, num_layers=1, num_heads=2, d_ff=24,
                      attention="mla", kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4,
                      v_head_dim=6, dtype="bfloat16", tie_embeddings=tie)
    params = decoder.init_params(jax.random.key(0), cfg)
    tokens = (jnp.arange(B * S, dtype=jnp.int32).reshape(B, S) * 5) % V
    loss = lambda p: decoder.forward(p, tokens, cfg)[0].mean()
    jaxpr = jax.make_jaxpr(jax.grad(loss))(params).jaxpr
    assert _float32_products(jaxpr, B * S * V) == 0
    # the check sees autodiff's float32 products of the plain head
    plain = lambda p: jnp.dot(decoder.rms_norm(jnp.ones((B, S, D), jnp.bfloat16),
                                               p["final_norm"]["w_D"], cfg.norm_eps),
                              p["embed"]["w_VD"].T.astype(jnp.bfloat16),
                              preferred_element_type=jnp.float32).mean()
    assert _float32_products(jax.make_jaxpr(jax.grad(plain))(params).jaxpr, B * S * V) >= 1


def test_float32_compute_is_the_plain_product():
    cfg = ModelConfig(vocab_size=V, d_model=D, num_layers=1, num_heads=2, d_ff=24,
                      attention="mla", kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4,
                      v_head_dim=6, dtype="float32")
    params = decoder.init_params(jax.random.key(0), cfg)
    h = jnp.asarray(np.random.default_rng(1).standard_normal((B, S, D)), jnp.float32)
    jaxpr = jax.make_jaxpr(lambda p: decoder.logits_from_hidden(p, h, p["final_norm"]["w_D"],
                                                                cfg))(params)
    assert "custom_vjp" not in str(jaxpr)
