"""ep_comm_overlap_chunks = k equals k = 1 and the single-device layer, on 8 host devices.

Legend: E experts, K top-k, D model dim, F expert hidden, T tokens (8 per device), k chunks.

Every dispatcher that XLA:CPU compiles (allgather, a2a, node_a2a in 2 nodes of 4) at k = 2,
under uniform and one-device routing (every token picks experts 0 and 1): with the buffer
factor 1.0 the skewed routing overflows and runs extra rounds in each chunk. The forward pass
must be bitwise equal to k = 1 (a token's output is the same operations in the same order);
the gradients equal it to float32 rounding (the expert weights' gradient sums k partial sums).
One compiled function per (dispatcher, k) covers both routings (they differ only through the
router bias). ragged_a2a compiles for GPU only: its chunked schedule is checked in
test_overlap_schedule.py.
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
from dropless.moe.dispatch.overlap import chunk_tokens, merge_stats
from dropless.parallel import NodeMesh, make_mesh, shard_params

E, K, D, F, T = 16, 2, 8, 16, 64
GRAD_TOL = dict(rtol=2e-5, atol=2e-5)
NODES = {"allgather": None, "a2a": None, "node_a2a": 4}


def _cfg(dispatcher: str, chunks: int) -> MoEConfig:
    return MoEConfig(num_experts=E, top_k=K, d_model=D, d_ff=F, gmm_backend="ragged_dot",
                     dispatcher=dispatcher, ragged_buffer_factor=1.0,
                     ep_comm_overlap_chunks=chunks)


def _loss(params, x, cfg, mesh):
    y, aux = layer.apply(params, x, cfg, mesh=mesh)
    return jnp.sum(y * jnp.sin(jnp.arange(y.size, dtype=jnp.float32)).reshape(y.shape)), (y, aux)


@functools.lru_cache(maxsize=None)
def _step(dispatcher: str, chunks: int, with_mesh: bool = True):
    cfg = _cfg(dispatcher, chunks)
    mesh = (NodeMesh(make_mesh(MeshConfig(expert=8)), devices_per_node=NODES[dispatcher])
            if with_mesh else None)
    return mesh, jax.jit(jax.value_and_grad(lambda p, x: _loss(p, x, cfg, mesh),
                                            argnums=(0, 1), has_aux=True))


def _inputs(routing: str):
    params = layer.init_params(jax.random.key(0), _cfg("a2a", 1))
    if routing == "one_device":
        params["router"]["bias_E"] = jnp.asarray([5.0, 5.0] + [0.0] * (E - 2), jnp.float32)
    return params, jax.random.normal(jax.random.key(1), (T, D), jnp.float32)


def _run(dispatcher: str, chunks: int, routing: str, with_mesh: bool = True):
    mesh, step = _step(dispatcher, chunks, with_mesh)
    params, x = _inputs(routing)
    (_, (y, aux)), grads = step(shard_params(params, mesh) if mesh else params, x)
    return np.asarray(y), [np.asarray(g) for g in jax.tree.leaves(grads)], aux


@pytest.mark.parametrize("dispatcher", list(NODES))
def test_chunks_equal_one_chunk_and_the_local_layer(dispatcher):
    for routing in ("uniform", "one_device"):
        y, grads, aux = _run(dispatcher, 2, routing)
        y_1, grads_1, aux_1 = _run(dispatcher, 1, routing)
        y_local, grads_local, _ = _run("a2a", 1, routing, with_mesh=False)
        np.testing.assert_array_equal(y, y_1, err_msg=routing)            # bitwise
        np.testing.assert_allclose(y, y_local, err_msg=routing, **GRAD_TOL)
        for got, one, local in zip(grads, grads_1, grads_local):
            np.testing.assert_allclose(got, one, err_msg=routing, **GRAD_TOL)
            np.testing.assert_allclose(got, local, err_msg=routing, **GRAD_TOL)
        # the same rows travel, chunked or not; nothing is dropped
        for key in ("rows_sent", "rows_routed", "rows_inter_node", "rows_intra_node"):
            assert float(aux[key]) == float(aux_1[key]), (routing, key)
        assert float(aux["dropped_rows"]) == 0
        if dispatcher == "a2a" and routing == "one_device":
            assert int(aux["rounds"]) > 1 and int(aux_1["rounds"]) > 1   # overflow rounds ran


def test_chunk_count_must_split_the_tokens_of_each_device():
    assert chunk_tokens(64, 8, 4) == 16
    with pytest.raises(ValueError, match="ep_comm_overlap_chunks=3 does not divide"):
        chunk_tokens(64, 8, 3)
    cfg = _cfg("a2a", 16)   # 8 tokens per device
    with pytest.raises(ValueError, match="ep_comm_overlap_chunks=16"):
        # refused while the layer is traced (a shape check): no op needs to compile and run
        jax.eval_shape(lambda: layer.apply(layer.init_params(jax.random.key(0), cfg),
                                           jnp.ones((T, D)), cfg,
                                           mesh=make_mesh(MeshConfig(expert=8))))
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="MoEConfig.ep_comm_overlap_chunks"):
            _cfg("a2a", bad)


def test_merge_stats_adds_counts_and_keeps_the_worst_chunk():
    """Two chunks: rows add up; rounds and the sufficient factor are the worst chunk's, the
    headroom the fullest chunk's."""
    a = {"rows_sent": jnp.float32(3), "rounds": jnp.int32(1), "buffer_headroom": jnp.float32(.5),
         "sufficient_buffer_factor": jnp.float32(1.0)}
    b = {"rows_sent": jnp.float32(4), "rounds": jnp.int32(3), "buffer_headroom": jnp.float32(-2),
         "sufficient_buffer_factor": jnp.float32(3.0)}
    m = merge_stats([a, b])
    assert float(m["rows_sent"]) == 7 and int(m["rounds"]) == 3
    assert float(m["buffer_headroom"]) == -2 and float(m["sufficient_buffer_factor"]) == 3
    assert m["rounds"].dtype == jnp.int32
