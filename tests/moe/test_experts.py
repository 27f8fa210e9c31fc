"""prefuse_moe_weights: one [E, D, 2F] gate+up weight, exact against the unfused layer.

Legend: E experts, D model dim, F expert hidden dim, 2F gate and up side by side, T tokens.
Same seed -> init_params(fused) == fuse_expert_weights(init_params(unfused)), so the fused layer
must give the unfused outputs, and its gradient must be the fused unfused gradient.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless import MoEConfig
from dropless.config import MeshConfig
from dropless.moe import (convert_expert_weights, expert_layout, fuse_expert_weights,
                          unfuse_expert_weights)
from dropless.moe import layer
from dropless.parallel import NodeMesh, make_mesh, param_specs, shard_params

E, K, D, F, T = 8, 2, 32, 32, 64
TOL = dict(rtol=1e-5, atol=1e-5)


def _cfg(**kw) -> MoEConfig:
    base = dict(num_experts=E, top_k=K, d_model=D, d_ff=F, gmm_backend="ragged_dot",
                num_shared_experts=1)
    base.update(kw)
    return MoEConfig(**base)


@functools.lru_cache(maxsize=None)
def _grad_fn(cfg: MoEConfig, mesh_name: str | None, nodes: int | None = None):
    mesh = (NodeMesh(make_mesh(MeshConfig(data=2, expert=4)), devices_per_node=nodes)
            if mesh_name else None)

    def loss(p, x):
        y, aux = layer.apply(p, x, cfg, mesh=mesh)
        return jnp.sum(y * jnp.cos(jnp.arange(y.size, dtype=jnp.float32)).reshape(y.shape)), y
    return mesh, jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


def _run(cfg, mesh_name=None, nodes=None):
    mesh, f = _grad_fn(cfg, mesh_name, nodes)
    params = layer.init_params(jax.random.key(0), cfg)
    params["router"]["bias_E"] = 0.3 / (jnp.arange(E, dtype=jnp.float32) + 1)   # skewed
    x = jax.random.normal(jax.random.key(1), (T, D), jnp.float32)
    if mesh is not None:
        params = shard_params(params, mesh)
    (_, y), (g_params, g_x) = f(params, x)
    return params, y, g_params, g_x


def _assert_fused_matches(unfused_cfg, mesh_name=None, tol=TOL, nodes=None):
    p_u, y_u, g_u, gx_u = _run(unfused_cfg, mesh_name, nodes)
    p_f, y_f, g_f, gx_f = _run(unfused_cfg.replace(prefuse_moe_weights=True), mesh_name, nodes)
    assert sorted(p_f["experts"]) == ["w_down_EFD", "w_gate_up_ED2F"]
    np.testing.assert_array_equal(p_f["experts"]["w_gate_up_ED2F"],
                                  fuse_expert_weights(p_u)["experts"]["w_gate_up_ED2F"])
    np.testing.assert_allclose(y_f, y_u, **tol)
    np.testing.assert_allclose(gx_f, gx_u, **tol)
    for a, b in zip(jax.tree.leaves(g_f), jax.tree.leaves(fuse_expert_weights(g_u))):
        np.testing.assert_allclose(a, b, **tol)


@pytest.mark.parametrize("variant", ["dropless", "capacity", "mxfp8"])
def test_fused_equals_unfused_single_device(variant):
    kw = {"capacity": dict(capacity_factor=1.0), "mxfp8": dict(gmm_quantization="mxfp8"),
          "dropless": {}}[variant]
    # MXFP8: F = 32 is one scale block, so the fused weight's blocks are the unfused ones
    _assert_fused_matches(_cfg(**kw))


@pytest.mark.parametrize("dispatcher", ["allgather", "a2a", "node_a2a"])
def test_fused_equals_unfused_expert_parallel(dispatcher):
    _assert_fused_matches(_cfg(dispatcher=dispatcher, ragged_buffer_factor=1.0), "ep4",
                          nodes=2)   # nodes of 2 devices (the node size the caller passes)


def test_fused_mxfp8_expert_parallel():
    _assert_fused_matches(_cfg(dispatcher="a2a", gmm_quantization="mxfp8"), "ep4")


def test_conversion_is_pure_and_exact_on_any_tree():
    cfg = _cfg()
    p = layer.init_params(jax.random.key(0), cfg)
    tree = {"layers": [{"moe": p}, {"ffn": {"w": jnp.ones(3)}}], "opt": (p, jnp.zeros(2))}
    fused = fuse_expert_weights(tree)
    assert expert_layout(tree) is False and expert_layout(fused) is True
    assert expert_layout({"ffn": {"w": 1}}) is None
    assert "w_gate_EDF" in tree["layers"][0]["moe"]["experts"]     # input untouched
    assert fused["layers"][0]["moe"]["experts"]["w_gate_up_ED2F"].shape == (E, D, 2 * F)
    back = unfuse_expert_weights(fused)
    assert jax.tree.structure(back) == jax.tree.structure(tree)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(tree)):
        np.testing.assert_array_equal(a, b)
    assert convert_expert_weights(fused, prefuse=True) is not None
    abstract = fuse_expert_weights(jax.eval_shape(lambda: p))
    assert abstract["experts"]["w_gate_up_ED2F"].shape == (E, D, 2 * F)


def test_layout_mismatch_is_a_clear_error():
    cfg = _cfg(prefuse_moe_weights=True)
    params = layer.init_params(jax.random.key(0), cfg.replace(prefuse_moe_weights=False))
    with pytest.raises(ValueError, match=r"prefuse_moe_weights=True but the expert parameters "
                                         r"are \['w_down_EFD', 'w_gate_EDF', 'w_up_EDF'\]"):
        layer.apply(params, jnp.ones((4, D)), cfg)
    with pytest.raises(ValueError, match="prefuse_moe_weights=1 must be true or false"):
        _cfg(prefuse_moe_weights=1)


def test_fused_weight_sharding_entry():
    mesh = make_mesh(MeshConfig(fsdp=2, expert=4))
    specs = param_specs(layer.init_params(jax.random.key(0), _cfg(prefuse_moe_weights=True)),
                        mesh)
    assert specs["experts"]["w_gate_up_ED2F"] == jax.sharding.PartitionSpec("expert", "fsdp", None)


@pytest.mark.parametrize("saved_fused", [False, True])
def test_checkpoint_written_either_way_loads_either_way(tmp_path, saved_fused):
    """Through the trainer's checkpoint.restore, which reads the stored layout from the
    checkpoint's tree metadata and converts to `like`'s."""
    from dropless import checkpoint as ckpt
    p = layer.init_params(jax.random.key(0), _cfg())
    state = {"params": p, "mu": jax.tree.map(lambda a: a * 2, p)}
    written = fuse_expert_weights(state) if saved_fused else state
    mngr = ckpt.manager(tmp_path, keep=1, async_save=False)
    # the meta the trainer stores beside every step
    ckpt.save(mngr, 3, written, {"step": 3, "next_batch": 3, "corpus": {"train_tokens": 1}})
    mngr.wait_until_finished()
    assert expert_layout(mngr.item_metadata(3)["state"].tree) is saved_fused
    for want_fused in (False, True):
        like = fuse_expert_weights(state) if want_fused else state
        got, _ = ckpt.restore(mngr, 3, like)
        assert expert_layout(got) is want_fused
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(like)):
            np.testing.assert_array_equal(a, b)
