"""node_a2a (node-level dedup, two hops) == the single-device layer, and its row counting.

Legend: E experts, K top-k, D model dim, F expert hidden, T tokens, P = 8 EP peers, El = 2
experts per peer, G devices per node, M = P/G nodes.

8 host devices, EP 8, arranged as 4 nodes of 2 or 2 nodes of 4 (the NodeMesh's
`devices_per_node`), under uniform, Zipf and all-to-one-node routing (experts 0-3, all on node 0
in both layouts). The buffer factor is 1.0 so skewed routing needs extra hop-1 rounds. One
compiled function per layout covers the three routings (they differ only through the router
bias).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless import MoEConfig
from dropless.config import MeshConfig
from dropless.moe import layer
from dropless.moe.dispatch import resolve_dispatcher
from dropless.moe.dispatch.context import multi_node_groups, node_layout
from dropless.parallel import NodeMesh, make_mesh, shard_params

E, K, D, F, T, P = 16, 4, 8, 16, 64, 8
TOL = dict(rtol=2e-5, atol=2e-5)
ROUTINGS = ("uniform", "zipf", "one_node")


def _cfg(dispatcher: str = "node_a2a") -> MoEConfig:
    return MoEConfig(num_experts=E, top_k=K, d_model=D, d_ff=F, gmm_backend="ragged_dot",
                     dispatcher=dispatcher, ragged_buffer_factor=1.0)


def _bias(kind: str):
    if kind == "uniform":
        return jnp.zeros((E,), jnp.float32)
    if kind == "zipf":
        return 0.4 / (jnp.arange(E, dtype=jnp.float32) + 1.0)
    return jnp.asarray([5.0] * 4 + [0.0] * (E - 4), jnp.float32)   # node 0 in both layouts


def _loss(params, x, cfg, mesh):
    y, aux = layer.apply(params, x, cfg, mesh=mesh)
    return jnp.sum(y * jnp.sin(jnp.arange(y.size, dtype=jnp.float32)).reshape(y.shape)), (y, aux)


@functools.lru_cache(maxsize=None)
def _step(cfg: MoEConfig, with_mesh: bool, nodes: int | None = None):
    mesh = NodeMesh(make_mesh(MeshConfig(expert=P)), devices_per_node=nodes) if with_mesh else None
    return mesh, jax.jit(jax.value_and_grad(lambda p, x: _loss(p, x, cfg, mesh),
                                            argnums=(0, 1), has_aux=True))


def _inputs(routing: str):
    params = layer.init_params(jax.random.key(0), _cfg())
    params["router"]["bias_E"] = _bias(routing)
    return params, jax.random.normal(jax.random.key(1), (T, D), jnp.float32)


@functools.lru_cache(maxsize=None)
def _reference(routing: str):
    params, x = _inputs(routing)
    _, step = _step(_cfg(), False)
    (_, (y, aux)), grads = step(params, x)
    ids = jax.jit(lambda p, x: layer.rt.route(layer.rt.router_logits(x, p["router"]["w_DE"]),
                                               p["router"]["bias_E"], _cfg()).ids_TK)(params, x)
    return y, grads, aux["tokens_per_expert"], np.asarray(ids)


def _rows_by_loop(ids_TK: np.ndarray, g: int) -> tuple[int, int, int]:
    """Slow reference of the two-hop accounting: token t lives on device t // (T/P); device
    (m, l) sends one row per other node the token picks (to (m', l)), which forwards one row
    per picked device of its node other than itself. Returns (inter, intra, device-dedup
    inter-node rows)."""
    inter = intra = dev_inter = 0
    for t, ids in enumerate(ids_TK):
        me = t // (T // P)
        devs = {int(e) // (E // P) for e in ids}
        inter += len({d // g for d in devs} - {me // g})
        intra += sum(1 for d in devs if d % g != me % g)
        dev_inter += sum(1 for d in devs if d // g != me // g)
    return inter, intra, dev_inter


@pytest.mark.parametrize("devices_per_node", [2, 4])
def test_node_dedup_matches_single_device(devices_per_node):
    mesh, step = _step(_cfg(), True, devices_per_node)
    assert node_layout(mesh) == (P // devices_per_node, devices_per_node)
    for routing in ROUTINGS:
        params, x = _inputs(routing)
        (_, (y, aux)), grads = step(shard_params(params, mesh), x)
        y_ref, grads_ref, sizes_ref, ids = _reference(routing)
        np.testing.assert_allclose(y, y_ref, err_msg=routing, **TOL)
        for got, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
            np.testing.assert_allclose(got, ref, err_msg=routing, **TOL)
        np.testing.assert_array_equal(aux["tokens_per_expert"], sizes_ref)
        assert float(aux["dropped_rows"]) == 0 and float(aux["rows_routed"]) == T * K
        inter, intra, dev_inter = _rows_by_loop(ids, devices_per_node)
        assert float(aux["rows_inter_node"]) == inter, routing
        assert float(aux["rows_intra_node"]) == intra, routing
        assert float(aux["rows_inter_node_device_dedup"]) == dev_inter, routing
        assert float(aux["bytes_inter_node"]) == inter * D * 4
        assert inter <= dev_inter
        if routing == "uniform":   # node dedup measurably cuts inter-node rows
            assert inter < 0.8 * dev_inter, (inter, dev_inter)
        if routing == "one_node" and devices_per_node == 2:
            # 4 nodes: Br1 = ceil(8 * (1 - C(12,4)/C(16,4))) = 6 rows per node per round, but
            # all 8 local tokens go to node 0: two hop-1 rounds. (2 nodes: Br1 = 8 = T, one.)
            assert int(aux["rounds"]) == 2


def test_auto_picks_node_a2a_only_across_nodes():
    mesh = make_mesh(MeshConfig(expert=P))
    nodes = lambda n: multi_node_groups(NodeMesh(mesh, devices_per_node=n))
    assert nodes(2) == 4 and nodes(4) == 2
    assert nodes(8) == 1 and nodes(1) == 1
    assert nodes(None) == 1 and multi_node_groups(mesh) == 1   # a plain mesh: one node
    assert resolve_dispatcher("auto", "cpu", num_nodes=2) == "node_a2a"
    assert resolve_dispatcher("auto", "cpu", num_nodes=1) == "a2a"


def test_misaligned_nodes_are_a_clear_error():
    with pytest.raises(ValueError, match=r"devices_per_node=3 \(MeshConfig: mesh.dcn_\*\) does "
                                         r"not split the expert axis \(8 peers\)"):
        layer.apply(layer.init_params(jax.random.key(0), _cfg()), jnp.ones((T, D)), _cfg(),
                    mesh=NodeMesh(make_mesh(MeshConfig(expert=P)), devices_per_node=3))
