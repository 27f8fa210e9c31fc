"""The trainer on a mesh of 8 host devices gives the same first-step loss as on one device."""
import functools
import importlib.util

import jax
import numpy as np
import pytest

from dropless.config_file import build_config
from dropless.parallel.mesh import batch_sharding, train_mesh
from dropless.parallel.sharding import state_shardings
from dropless.data import corpus as data
from dropless.train import step

# deepseek3-test without its MTP module and its second MoE layer (layers are unrolled, so each
# costs its own compile): compiling twice for 8 devices is the cost here. One dense and one MoE
# layer still place every kind of weight (MLA, dense FFN, router and its bias, routed and shared
# experts) on the mesh and route every token through the dispatcher; a second MoE layer is the
# same code again.
MINI = {"preset": "deepseek3-test", "seq_len": 16, "model.moe.gmm_backend": "ragged_dot",
        "model.mtp_depth": 0, "model.num_layers": 2}


def first_step(cfg, batch):
    mesh = train_mesh(cfg.mesh)
    state, opt = step.init_state(cfg)
    if mesh is not None:
        state = jax.device_put(state, state_shardings(state, mesh))
        batch = jax.device_put(batch, batch_sharding(mesh))
    fn = jax.jit(functools.partial(step.train_step, cfg=cfg, opt=opt, mesh=mesh))
    _, m = fn(state, batch)
    return float(m["loss"]), np.asarray(m["tokens_per_expert_LE"])


@pytest.fixture(scope="module")
def one_device():
    """The batch and the reference first step on one device, shared by every mesh below (the
    one-device step is the same program for each: compile it once)."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 host devices (tests/conftest.py)")
    toks = np.frombuffer(("x = [i * i for i in range(10)]\n" * 40).encode(), np.uint8)
    batch = data.batch_at(toks, 0, batch_size=8, seq_len=16, seed=0)
    one = build_config(list({**MINI, "per_device_batch_size": 8}.items()))
    return one, batch, first_step(one, batch)


@pytest.mark.parametrize("axes", [
    {"data_parallelism": 4, "fsdp_parallelism": 2},
    pytest.param({"ici_expert_parallelism": 4, "ici_fsdp_parallelism": 2},
                 marks=pytest.mark.skipif(importlib.util.find_spec("dropless.moe.dispatch") is None,
                                          reason="expert-parallel dispatcher not merged yet")),
])
def test_mesh_first_step_equals_one_device(one_device, axes):
    one, batch, (loss1, load1) = one_device
    many = build_config(list({**MINI, "per_device_batch_size": 1, **axes}.items()))
    assert many.num_devices == 8 and many.global_batch_size == one.global_batch_size
    loss8, load8 = first_step(many, batch)
    np.testing.assert_allclose(loss8, loss1, rtol=1e-5)
    np.testing.assert_array_equal(load8, load1)


def test_mesh_needs_enough_devices():
    cfg = build_config([("data_parallelism", 64)])
    with pytest.raises(ValueError, match="parallelism = 64 but JAX sees"):
        train_mesh(cfg.mesh)


def test_hybrid_mesh_groups_devices_into_nodes():
    """MaxText ici x dcn: each axis is dcn * ici long, node-major; every ICI block is one node
    (8 devices as 2 nodes of 4: fsdp 2 inside a node, expert 4 = ici 2 x dcn 2)."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 host devices (tests/conftest.py)")
    from dropless.parallel.mesh import NodeMesh, make_hybrid_mesh
    mesh = make_hybrid_mesh((1, 2, 2), (1, 1, 2), jax.devices()[:8])
    assert dict(mesh.shape) == {"data": 1, "fsdp": 2, "expert": 4}
    nodes = NodeMesh(mesh, devices_per_node=4).node_ids()
    # expert positions 0-1 are node 0 and 2-3 node 1, whatever the fsdp row
    np.testing.assert_array_equal(nodes[0], [[0, 0, 1, 1], [0, 0, 1, 1]])
    ids = np.vectorize(lambda d: d.id)(mesh.devices)[0]
    np.testing.assert_array_equal(ids, [[0, 1, 4, 5], [2, 3, 6, 7]])
    with pytest.raises(ValueError, match="needs 16 devices"):
        make_hybrid_mesh((2, 2, 2), (1, 1, 2), jax.devices()[:8])


def test_train_mesh_from_ici_dcn_keys():
    if jax.device_count() < 8:
        pytest.skip("needs 8 host devices (tests/conftest.py)")
    cfg = build_config([("ici_fsdp_parallelism", 2), ("ici_expert_parallelism", 2),
                        ("dcn_expert_parallelism", 2)])
    assert (cfg.mesh.fsdp, cfg.mesh.expert, cfg.mesh.dcn_expert) == (2, 4, 2)
    assert cfg.mesh.devices_per_node == 4
    mesh = train_mesh(cfg.mesh)   # the mesh and its node size, from MeshConfig
    assert dict(mesh.mesh.shape) == {"data": 1, "fsdp": 2, "expert": 4}
    assert mesh.devices_per_node == 4
    assert sorted(np.unique(mesh.node_ids()[0, :, :2])) == [0]


def test_mesh_config_validates_and_derives():
    from dropless.config import MESH_AXES, MeshConfig
    m = MeshConfig(data=2, fsdp=2, expert=4, dcn_expert=2)
    assert (m.shape, m.ici_shape, m.dcn_shape) == ((2, 2, 4), (2, 2, 2), (1, 1, 2))
    assert (m.num_devices, m.num_nodes, m.devices_per_node) == (16, 2, 8)
    assert MESH_AXES == ("data", "fsdp", "expert")
    with pytest.raises(ValueError, match="MeshConfig.dcn_fsdp=3 must divide fsdp=4"):
        MeshConfig(fsdp=4, dcn_fsdp=3)
    with pytest.raises(ValueError, match="MeshConfig.expert=0 must be a positive int"):
        MeshConfig(expert=0)
    with pytest.raises(ValueError, match="MeshConfig.dcn_data=True must be an int"):
        MeshConfig(dcn_data=True)
