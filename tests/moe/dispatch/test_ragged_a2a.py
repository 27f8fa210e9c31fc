"""ragged_a2a on GPU, checked here by lowering for CUDA (XLA:CPU cannot compile it).

`auto` resolves per platform at lowering time (lax.platform_dependent): the same jitted layer
lowers to ragged_all_to_all for CUDA when this JAX can lower it there, and to all_to_all for
CPU, where it also runs. Legend: E experts, K top-k, D model dim, F hidden, T tokens.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from dropless import MoEConfig
from dropless.config import MeshConfig
from dropless.moe import layer
from dropless.moe.dispatch import registry, resolve_dispatcher
from dropless.parallel import make_mesh

E, K, D, F, T = 16, 2, 8, 16, 64
RAGGED = "ragged_all_to_all"


def _cfg(dispatcher="auto") -> MoEConfig:
    return MoEConfig(num_experts=E, top_k=K, d_model=D, d_ff=F, gmm_backend="ragged_dot",
                     dispatcher=dispatcher, ragged_buffer_factor=1.0)


@functools.lru_cache(maxsize=None)
def _traced(dispatcher: str, grad: bool):
    cfg, mesh = _cfg(dispatcher), make_mesh(MeshConfig(expert=8))
    f = lambda p, x: jnp.sum(layer.apply(p, x, cfg, mesh=mesh)[0])
    fn = jax.grad(f, argnums=(0, 1)) if grad else f
    args = (layer.init_params(jax.random.key(0), cfg), jnp.ones((T, D), jnp.float32))
    return jax.jit(fn), args


def _hlo(dispatcher: str, grad: bool, platform: str) -> str:
    fn, args = _traced(dispatcher, grad)
    return fn.trace(*args).lower(lowering_platforms=(platform,)).as_text()


def test_auto_lowers_ragged_for_cuda_forward_and_backward():
    assert registry.ragged_lowers("cuda")          # this JAX lowers it for CUDA
    fwd, bwd = _hlo("auto", False, "cuda"), _hlo("auto", True, "cuda")
    # forward: rows, entry codes, weights out, rows back; the backward adds the transposes
    assert fwd.count(RAGGED) >= 4
    assert bwd.count(RAGGED) > fwd.count(RAGGED)
    assert RAGGED not in _hlo("auto", True, "cpu")  # the CPU lowering keeps all_to_all


def test_ragged_exports_for_cuda():
    fn, args = _traced("auto", True)
    # ragged_all_to_all is a custom call without a serialization-stability promise in jax 0.10
    allow = [jax.export.DisabledSafetyCheck.custom_call(RAGGED)]
    exported = jax.export.export(fn, platforms=("cuda",), disabled_checks=allow)(*args)
    assert exported.platforms == ("cuda",)
    assert RAGGED in exported.mlir_module()


def test_auto_picks_ragged_on_gpu_only_when_it_lowers(monkeypatch):
    assert resolve_dispatcher("auto", "cuda") == "ragged_a2a"
    assert resolve_dispatcher("auto", "cpu") == "a2a"
    assert registry.platform_choices("auto")["cpu"] == "a2a"
    monkeypatch.setattr(registry, "ragged_lowers", lambda platform: False)
    assert resolve_dispatcher("auto", "cuda") == "a2a"
    cfg = _cfg("auto")
    mesh = make_mesh(MeshConfig(expert=8))
    hlo = jax.jit(lambda p, x: layer.apply(p, x, cfg, mesh=mesh)[0]).trace(
        layer.init_params(jax.random.key(0), cfg), jnp.ones((T, D))).lower(
        lowering_platforms=("cuda",)).as_text()
    assert RAGGED not in hlo and "all_to_all" in hlo


def test_explicit_ragged_refused_on_a_cpu_host_but_lowers_when_forced(monkeypatch):
    with pytest.raises(ValueError, match="dispatcher='ragged_a2a' is not supported on cpu"):
        layer.apply(layer.init_params(jax.random.key(0), _cfg("ragged_a2a")), jnp.ones((T, D)),
                    _cfg("ragged_a2a"), mesh=make_mesh(MeshConfig(expert=8)))
    from dropless.moe.dispatch import expert_parallel
    monkeypatch.setattr(expert_parallel, "resolve_dispatcher",
                        lambda name, platform=None, num_nodes=1: "ragged_a2a")
    assert _hlo("ragged_a2a", True, "cuda").count(RAGGED) >= 8
