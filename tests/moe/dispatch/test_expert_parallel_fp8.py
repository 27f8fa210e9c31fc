"""MXFP8 on the wire (MoEConfig.dispatch_quantization="mxfp8") == the local MXFP8 path, on 8
host devices, for allgather, a2a and node_a2a (ragged_a2a: its CUDA lowering, below).

Legend: E experts, K top-k, D model dim, F expert hidden, T tokens, P = 8 EP peers.

Forward, to float32 rounding (FWD_ULPS): the local path's per-(token, choice) expert outputs (no
mesh, the MXFP8 grouped matmul quantizing its bf16-free f32 lhs itself), combined as every
dispatcher combines two choices (each weighted output rounded to f32, then one f32 add), equal
the EP layer's output, under uniform, Zipf and all-to-one-device routing; at the buffer factors
of CASES uniform routing fits one round and the skewed one overflows into more. Not bitwise:
the quantized codes and scales are the same on both sides, but each device's grouped matmul
holds other rows than the local one, and XLA:CPU's dot may block its contraction by the
operands' shape on some CPUs (on Intel Sapphire Rapids 16 of 4,096 outputs differ by one ulp;
on AMD EPYC none do). A wrong code or scale moves an output by MXFP8's 2^-4, far above this.
Gradients: the local path with the same option (tokens quantized before the sort), to float32
rounding; the expert weights' only where one round held every row. Their gradient quantizes
each expert's rows in 32-row blocks that restart at group boundaries, so it depends on which
rows one grouped matmul holds and in what order: an overflow round holds part of a group, and
node_a2a receives a group's rows ordered by (peer in the node, node, token), not by token. The
bf16-wire MXFP8 path has both properties too. A group of at most 32 rows is one block
whatever its order, which uniform routing gives here (asserted), so there every dispatcher's
expert-weight gradients are checked to float32 rounding.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless import MoEConfig
from dropless.config import MeshConfig
from dropless.moe import layer, permute as perm, router as rt
from dropless.moe.experts import expert_ffn
from dropless.parallel import NodeMesh, make_mesh, shard_params

E, K, D, F, T, P = 16, 2, 64, 32, 64, 8
REL = 2e-6   # float32 rounding of sums in another order, relative to a leaf's largest entry
FWD_ULPS = 4  # the forward's tolerance: float32 ulps of its largest output
ROUTINGS = ("uniform", "zipf", "one_device")
# (dispatcher, devices per node, buffer factor): node_a2a as 4 nodes of 2 (two hops), its
# hop-1 budget ceil(1.5 * 3.6) = 6 rows per node < the 8 tokens that one_device routing sends
CASES = (("allgather", None, 2.0), ("a2a", None, 2.0), ("node_a2a", 2, 1.5))


def _cfg(dispatcher: str = "local", wire: bool = True, factor: float = 2.0) -> MoEConfig:
    return MoEConfig(num_experts=E, top_k=K, d_model=D, d_ff=F, gmm_backend="ragged_dot",
                     dispatcher=dispatcher, ragged_buffer_factor=factor, gmm_quantization="mxfp8",
                     dispatch_quantization="mxfp8" if wire else "none")


def _bias(kind: str) -> jnp.ndarray:
    if kind == "uniform":
        return jnp.zeros((E,), jnp.float32)
    if kind == "zipf":
        return 0.4 / (jnp.arange(E, dtype=jnp.float32) + 1.0)
    return jnp.asarray([5.0, 5.0] + [0.0] * (E - 2), jnp.float32)   # experts 0, 1: device 0


def _inputs(routing: str):
    params = layer.init_params(jax.random.key(0), _cfg())
    params["router"]["bias_E"] = _bias(routing)
    x = jax.random.normal(jax.random.key(1), (T, D), jnp.float32) * 3.0
    return params, x


def _loss(params, x, cfg, mesh):
    y, aux = layer.apply(params, x, cfg, mesh=mesh)
    w = jnp.sin(jnp.arange(y.size, dtype=jnp.float32)).reshape(y.shape)
    return jnp.sum(y * w), (y, aux)


@functools.lru_cache(maxsize=None)
def _step(cfg: MoEConfig, nodes: int | None, with_mesh: bool = True):
    mesh = None
    if with_mesh:
        mesh = make_mesh(MeshConfig(expert=P))
        mesh = NodeMesh(mesh, devices_per_node=nodes) if nodes else mesh
    return mesh, jax.jit(jax.value_and_grad(lambda p, x: _loss(p, x, cfg, mesh),
                                            argnums=(0, 1), has_aux=True))


@jax.jit
def _choice_outputs(params, x):
    """The local MXFP8 path's expert output of every (token, choice) [T, K, D] and weights."""
    cfg = _cfg(wire=False)
    routing = rt.route(rt.router_logits(x, params["router"]["w_DE"]),
                       params["router"]["bias_E"], cfg)
    p = perm.sort_by_expert(routing.ids_TK, E)
    y_ND = expert_ffn(perm.permute(x, p.order_N, p.inv_N, K), p.group_sizes_E,
                      params["experts"], cfg)
    return perm.unpermute(y_ND, p.order_N, p.inv_N, K), routing.weights_TK


@functools.lru_cache(maxsize=None)
def _reference(routing: str):
    """(y reference, gradients of the local path with the wire option)."""
    params, x = _inputs(routing)
    y_TKD, w_TK = (np.asarray(a) for a in _choice_outputs(params, x))
    parts = [(w_TK[:, k, None] * y_TKD[:, k]).astype(np.float32) for k in range(K)]
    y = parts[0] + parts[1]   # float32 numpy: each product rounded, one add (no FMA)
    _, step = _step(_cfg(), None, with_mesh=False)
    (_, (y_local, _)), grads = step(params, x)
    return y, np.asarray(y_local), grads


@pytest.mark.parametrize("dispatcher,nodes,factor", CASES)
def test_fp8_dispatch_matches_local_mxfp8(dispatcher, nodes, factor):
    mesh, step = _step(_cfg(dispatcher, factor=factor), nodes)
    for routing in ROUTINGS:
        params, x = _inputs(routing)
        (_, (y, aux)), grads = step(shard_params(params, mesh), x)
        y_ref, y_local, grads_ref = _reference(routing)
        tol = FWD_ULPS * float(np.spacing(np.abs(y_ref).max()))
        np.testing.assert_allclose(np.asarray(y), y_ref, rtol=0, atol=tol,
                                   err_msg=f"{routing}: forward")
        assert float(aux["dropped_rows"]) == 0
        rounds, largest = int(aux["rounds"]), int(np.max(aux["tokens_per_expert"]))
        if routing == "one_device" and dispatcher != "allgather":
            assert rounds > 1, (dispatcher, routing)   # the overflow rounds ran
        exact = rounds == 1 and (dispatcher != "node_a2a" or largest <= 32)
        if routing == "uniform":
            assert exact, (dispatcher, rounds, largest)   # every gradient checked at least once
        g, g_ref = grads, grads_ref
        if not exact:
            g, g_ref = _without_expert_weights(grads), _without_expert_weights(grads_ref)
        for got, ref in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
            np.testing.assert_allclose(got, ref, rtol=REL, atol=REL * np.abs(ref).max(),
                                       err_msg=routing)


def _without_expert_weights(grads):
    g_params, g_x = grads
    return {k: v for k, v in g_params.items() if k != "experts"}, g_x


def _row_bytes(hlo: str) -> dict:
    """Bytes of the collectives' row operands (last dim D values or D/32 scales) by type."""
    from dropless.bench.dispatch import collective_bytes
    return collective_bytes(hlo, (D, D // 32))["rows_by_type"]


@pytest.mark.parametrize("dispatcher", ["ragged_a2a", "a2a", "node_a2a", "allgather"])
def test_the_rows_cross_as_one_byte_codes_and_come_back_in_the_activation_dtype(
        dispatcher, monkeypatch):
    """The forward lowered for CUDA (ragged_a2a's platform; the others' too): the dispatch's
    row operands are uint8 (D codes + D/32 scales a row, 0.516 of the bf16 row), and the only
    bf16 rows left are the combine's, as many bytes as without the option."""
    from dropless.moe.dispatch import expert_parallel
    monkeypatch.setattr(expert_parallel, "resolve_dispatcher",
                        lambda name, platform=None, num_nodes=1: name)
    mesh = make_mesh(MeshConfig(expert=P))
    mesh = NodeMesh(mesh, devices_per_node=4) if dispatcher == "node_a2a" else mesh
    got = {}
    for wire in (False, True):
        cfg = _cfg(dispatcher, wire).replace(dtype="bfloat16")
        params, x = _inputs("uniform")
        got[wire] = _row_bytes(jax.jit(lambda p, x: layer.apply(p, x, cfg, mesh=mesh)[0]).trace(
            params, x.astype(jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text(
            dialect="hlo"))
    # (node_a2a's [S, J1] ids and weights, s32 / f32, have the scales' width: left out)
    assert got[True]["u8"] > 0 and "u8" not in got[False]
    if dispatcher == "allgather":   # combine: a reduce-scatter of the gathered rows' sums
        combine = got[True]["bf16"]
        dispatch_bf16 = got[False]["bf16"] - combine
    else:                           # combine: the same rows back
        combine = dispatch_bf16 = got[False]["bf16"] / 2
    assert got[True]["bf16"] == combine
    assert got[True]["u8"] == dispatch_bf16 * (D + D // 32) / (2 * D)


def test_the_backward_replays_no_row_exchange():
    """Compiled for CPU (the allgather case's step, compiled once): forward and backward move
    the gathered rows as uint8 codes and scales once, and activation-dtype rows exactly three
    times: the combine's reduce-scatter, its transpose (an all-gather) and the dispatch's
    transpose (a reduce-scatter). The gradient slot's VJP replays the dispatch; XLA removes its
    unused forward all-gather of activation-dtype rows, which would be a fourth."""
    from dropless.bench.dispatch import collectives
    dispatcher, nodes, factor = CASES[0]
    mesh, step = _step(_cfg(dispatcher, factor=factor), nodes)
    params, x = _inputs("uniform")
    hlo = step.lower(shard_params(params, mesh), x).compile().as_text()
    # rows: [., D] activations, uint8 codes and scales (the all-reduces are weight gradients)
    rows = sorted((op, elem) for op, arrays in collectives(hlo) for elem, dims in arrays
                  if op != "all-reduce" and len(dims) == 2 and (dims[-1] == D or elem == "u8"))
    assert rows == sorted([("all-gather", "u8")] * 2 + [("all-gather", "f32")]
                          + [("reduce-scatter", "f32")] * 2), rows
