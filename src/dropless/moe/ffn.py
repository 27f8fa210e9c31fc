"""SwiGLU, written once, and the draw every weight initializer here goes through.

Legend: T tokens (any leading shape: [T] or [B, S]), D model dim, F hidden dim.

`swiglu` is the activation every feed-forward here shares: the routed experts
(`experts.expert_ffn`, the capacity baseline in `layer.py`), the shared experts and the
model's dense layers (`swiglu_ffn`, whose parameters are {"w_gate_DF", "w_up_DF", "w_down_FD"}
in both). This module sits at the bottom of `moe/`; `models/` reads it too.

Initialisation: every init function takes a `draw(key, kind, shape, fan_in, dtype)`, which
returns one weight of parameter kind `kind` (the names `models.init.PARAM_KINDS` lists) whose
per-matrix fan-in (the size of the axes it contracts) is `fan_in`. `fan_in_draw`, the default,
is N(0, 1/fan_in) for every kind; `models.init.initializer(cfg)` builds the draw of a model's
scheme (ModelConfig.init).
"""
from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp


def scaled_normal(key: jax.Array, shape: tuple[int, ...], fan_in: int, dtype) -> jax.Array:
    """N(0, 1/fan_in) drawn in float32, returned in `dtype` (the init of every weight matrix)."""
    return (jax.random.normal(key, shape, jnp.float32) / math.sqrt(fan_in)).astype(dtype)


# draw(key, kind, shape, fan_in, dtype) -> one weight (see the module docstring)
Draw = Callable[[jax.Array, str, tuple[int, ...], int, Any], jax.Array]


def fan_in_draw(key: jax.Array, kind: str, shape: tuple[int, ...], fan_in: int,
                dtype) -> jax.Array:
    """The default draw: scaled_normal over `fan_in`, whatever the kind."""
    del kind
    return scaled_normal(key, shape, fan_in, dtype)


def swiglu(gate_TF: jax.Array, up_TF: jax.Array, dtype) -> jax.Array:
    """silu(gate) * up computed in float32, returned in `dtype` (the down projection's input)."""
    return (jax.nn.silu(gate_TF.astype(jnp.float32)) * up_TF.astype(jnp.float32)).astype(dtype)


def init_swiglu_ffn(key: jax.Array, d: int, f: int, dtype, draw: Draw = fan_in_draw
                    ) -> dict[str, jax.Array]:
    """{"w_gate_DF", "w_up_DF", "w_down_FD"} in `dtype`: gate and up of kind "ffn" (fan-in D),
    down of kind "ffn_out" (fan-in F), each from `draw` (default N(0, 1/fan_in))."""
    ks = jax.random.split(key, 3)
    return {"w_gate_DF": draw(ks[0], "ffn", (d, f), d, dtype),
            "w_up_DF": draw(ks[1], "ffn", (d, f), d, dtype),
            "w_down_FD": draw(ks[2], "ffn_out", (f, d), f, dtype)}


def swiglu_ffn(p: dict[str, jax.Array], x_TD: jax.Array, dtype) -> jax.Array:
    """down(silu(x @ gate) * (x @ up)) -> [..., D] in `dtype`: x and the weights in `dtype`,
    every matmul accumulated in float32 and its output in `dtype`, as the routed experts'
    (a dense layer, or the shared experts of width num_shared_experts * d_ff)."""
    dt = jnp.dtype(dtype)
    x = x_TD.astype(dt)
    g = jnp.dot(x, p["w_gate_DF"].astype(dt), preferred_element_type=dt)
    u = jnp.dot(x, p["w_up_DF"].astype(dt), preferred_element_type=dt)
    return jnp.dot(swiglu(g, u, dt), p["w_down_FD"].astype(dt), preferred_element_type=dt)
