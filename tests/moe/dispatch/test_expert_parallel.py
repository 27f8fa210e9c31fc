"""Expert-parallel layer == the single-device layer, forward and gradients, on 8 host devices.

Matrix: dispatcher in {allgather, a2a} x mesh in {EP 1, 2, 4, 8 (rest data), FSDP 2 x EP 4},
each under uniform, Zipf and one-device routing. Routing differs only through the router bias,
so one compiled function per (dispatcher, mesh) covers all three. The buffer factor is 1.0 so
that skewed routing overflows the a2a chunks and must take extra rounds.
"""
from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless import MoEConfig
from dropless.config import MeshConfig
from dropless.moe import layer
from dropless.moe.dispatch import expert_parallel as ep
from dropless.parallel import make_mesh, shard_params

E, K, D, F, T = 16, 2, 8, 16, 64
TOL = dict(rtol=2e-5, atol=2e-5)
MESHES = {"ep1": MeshConfig(data=8, expert=1), "ep2": MeshConfig(data=4, expert=2),
          "ep4": MeshConfig(data=2, expert=4), "ep8": MeshConfig(expert=8),
          "fsdp2xep4": MeshConfig(fsdp=2, expert=4)}


def _bias(kind: str) -> jnp.ndarray:
    if kind == "uniform":
        return jnp.zeros((E,), jnp.float32)
    if kind == "zipf":  # expert e preferred ~ 1/(e+1)
        return 0.4 / (jnp.arange(E, dtype=jnp.float32) + 1.0)
    # every token picks experts 0 and 1, which live on device 0 for every EP size here
    return jnp.asarray([5.0, 5.0] + [0.0] * (E - 2), jnp.float32)


def _cfg(dispatcher: str, **kw) -> MoEConfig:
    return MoEConfig(num_experts=E, top_k=K, d_model=D, d_ff=F, gmm_backend="ragged_dot",
                     dispatcher=dispatcher, ragged_buffer_factor=1.0, **kw)


def _loss(params, x, cfg, mesh):
    y, aux = layer.apply(params, x, cfg, mesh=mesh)
    w = jnp.sin(jnp.arange(y.size, dtype=jnp.float32)).reshape(y.shape)
    return jnp.sum(y * w), (y, aux)


@functools.lru_cache(maxsize=None)
def _step(cfg: MoEConfig, mesh_name: str | None):
    mesh = make_mesh(MESHES[mesh_name]) if mesh_name else None
    return mesh, jax.jit(jax.value_and_grad(lambda p, x: _loss(p, x, cfg, mesh),
                                            argnums=(0, 1), has_aux=True))


def _inputs(routing: str):
    params = layer.init_params(jax.random.key(0), _cfg("a2a"))
    params["router"]["bias_E"] = _bias(routing)
    return params, jax.random.normal(jax.random.key(1), (T, D), jnp.float32)


@functools.lru_cache(maxsize=None)
def _reference(routing: str):
    """The single-device layer (no mesh): independent of every dispatcher."""
    params, x = _inputs(routing)
    _, step = _step(_cfg("a2a"), None)
    (loss, (y, aux)), grads = step(params, x)
    return y, grads, aux["tokens_per_expert"]


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("dispatcher", ["allgather", "a2a"])
def test_expert_parallel_matches_single_device(dispatcher, mesh_name):
    cfg = _cfg(dispatcher)
    mesh, step = _step(cfg, mesh_name)
    for routing in ("uniform", "zipf", "one_device"):
        params, x = _inputs(routing)
        (_, (y, aux)), grads = step(shard_params(params, mesh), x)
        y_ref, grads_ref, sizes_ref = _reference(routing)
        np.testing.assert_allclose(y, y_ref, err_msg=routing, **TOL)
        for got, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
            np.testing.assert_allclose(got, ref, err_msg=routing, **TOL)
        np.testing.assert_array_equal(aux["tokens_per_expert"], sizes_ref)
        assert float(aux["dropped_rows"]) == 0
        assert float(aux["rows_routed"]) == T * K
        if dispatcher == "a2a":
            # nothing is lost: every deduplicated row was sent, over however many rounds
            assert float(aux["rows_sent"]) <= T * K
            if routing == "one_device" and mesh_name in ("ep4", "ep8", "fsdp2xep4"):
                assert int(aux["rounds"]) > 1, (mesh_name, aux["rounds"])


def test_one_device_routing_rounds_and_stats_hand_counted():
    """EP=8, T_local=8, K=2, E=16, factor 1: Br = ceil(1.93) = 2 rows and Be = 8*2/8 = 2
    entries per peer per round. Every token picks experts 0 and 1 (both on device 0), so each
    row carries 2 entries and fills a round alone: 8 rounds. Buffers hold Cr = 4 rows per peer:
    64 rows sent of 8 rounds * 8 devices * 8 peers * 4 slots = 2048; 7 rows per device travel
    after round 0; device 0's load is 8 rounds' worth, so factor 8 would have been enough."""
    cfg = _cfg("a2a")
    mesh, step = _step(cfg, "ep8")
    params, x = _inputs("one_device")
    (_, (_, aux)), _ = step(shard_params(params, mesh), x)
    assert int(aux["rounds"]) == 8
    assert float(aux["rows_sent"]) == 64 and float(aux["rows_routed"]) == 128
    assert float(aux["padding_rows"]) == 2048 - 64
    assert float(aux["overflow_rows"]) == 8 * 7
    assert float(aux["buffer_headroom"]) == pytest.approx(1 - 8)
    assert float(aux["sufficient_buffer_factor"]) == pytest.approx(8.0)


def test_a_local_batch_whose_round_accounting_needs_rounding_matches_one_device():
    """16384 tokens a device over EP 4 of 64 experts, top-8, factor 2.0 (deepseek3-1gpu's batch
    of 4 x 4096 on four GPUs): the budget is rounded so its int32 accounting fits
    (send_plan.make_budget; the plan itself at DeepSeek-V3's layout: test_send_plan.py). Every
    token on the first peer's experts, the costliest routing for that accounting, takes several
    rounds, and the layer equals the single-device layer, outputs and gradients."""
    e, k, d, f, t = 64, 8, 4, 4, 16384 * 4
    mesh = make_mesh(MeshConfig(expert=4), jax.devices()[:4])
    cfg = MoEConfig(num_experts=e, top_k=k, d_model=d, d_ff=f, gmm_backend="ragged_dot",
                    dispatcher="a2a", ragged_buffer_factor=2.0)
    params = layer.init_params(jax.random.key(0), cfg)
    params["router"]["bias_E"] = jnp.asarray([5.0] * (e // 4) + [0.0] * (3 * e // 4),
                                             jnp.float32)
    x = jax.random.normal(jax.random.key(1), (t, d), jnp.float32)
    (_, (y, aux)), grads = jax.jit(jax.value_and_grad(
        lambda p, x: _loss(p, x, cfg, mesh), argnums=(0, 1), has_aux=True))(
        shard_params(params, mesh), x)
    (_, (y_ref, _)), grads_ref = jax.jit(jax.value_and_grad(
        lambda p, x: _loss(p, x, cfg, None), argnums=(0, 1), has_aux=True))(params, x)
    np.testing.assert_allclose(y, y_ref, **TOL)
    for got, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
        np.testing.assert_allclose(got, ref, **TOL)
    assert float(aux["dropped_rows"]) == 0 and float(aux["rows_routed"]) == t * k
    assert int(aux["rounds"]) > 1, aux["rounds"]


def _collective_shapes(hlo: str, op: str) -> list[str]:
    """The result shapes of every `op` in compiled HLO text (a tuple's elements each), layouts
    dropped."""
    found = re.finditer(rf"= (\([^)]*\)|\S+) {op}(?:-start)?\(", hlo)
    return sorted(re.sub(r"\{[^}]*\}|/\*[^*]*\*/", "", one).strip()
                  for m in found for one in m.group(1).strip("()").split(", "))


@pytest.mark.parametrize("dispatcher", ["allgather", "a2a"])
def test_on_fsdp_the_experts_gradients_are_reduce_scattered_not_all_reduced(dispatcher):
    """FSDP 2 x EP 4: each device holds 4 experts with D split in two, as `shard_params`
    places them; the dispatcher's shard_map takes them so (`expert_weight_specs`) and gathers
    D inside, so XLA's compiled gradient reduce-scatters each expert weight over fsdp to that
    shard, [4, D/2, F] and [4, F, D/2], and all-reduces no expert-sized array. (Values: the
    fsdp2xep4 case of test_expert_parallel_matches_single_device.)"""
    mesh, step = _step(_cfg(dispatcher), "fsdp2xep4")
    params, x = _inputs("uniform")
    placed = shard_params(params, mesh)
    specs = ep.expert_weight_specs(placed["experts"], ep.make_context(_cfg(dispatcher), mesh,
                                                                      T, jnp.float32))
    for k, w in placed["experts"].items():
        assert w.sharding.spec == specs[k][0], (k, w.sharding.spec, specs[k])
    hlo = step.lower(placed, x).compile().as_text()
    shard = {f"f32[{E // 4},{D // 2},{F}]", f"f32[{E // 4},{F},{D // 2}]"}
    assert shard <= set(_collective_shapes(hlo, "reduce-scatter"))   # allgather: + tokens
    whole = {f"f32[{E // 4},{D},{F}]", f"f32[{E // 4},{F},{D}]"}
    assert not whole & set(_collective_shapes(hlo, "all-reduce"))


def test_the_boundary_takes_an_expert_weight_whole_over_fsdp_only_where_it_must():
    """fsdp 4 x expert 2: D = 8 splits over fsdp; D = 6 does not (shard_params keeps it whole
    too), nor does a key outside the placement table; fsdp 1 gathers nothing."""
    def specs(mesh_cfg, d, keys=("w_gate_EDF", "w_down_EFD")):
        mesh = make_mesh(mesh_cfg)
        cfg = MoEConfig(num_experts=E, top_k=K, d_model=d, d_ff=F)
        ws = {k: jnp.zeros((E, d, F) if k.endswith("EDF") else (E, F, d)) for k in keys}
        return ep.expert_weight_specs(ws, ep.make_context(cfg, mesh, T, jnp.float32))

    P = jax.sharding.PartitionSpec
    assert specs(MeshConfig(fsdp=4, expert=2), 8) == {
        "w_gate_EDF": (P("expert", "fsdp", None), 1), "w_down_EFD": (P("expert", None, "fsdp"), 2)}
    assert specs(MeshConfig(fsdp=4, expert=2), 6) == {
        "w_gate_EDF": (P("expert"), None), "w_down_EFD": (P("expert"), None)}
    assert specs(MeshConfig(fsdp=4, expert=2), 8, ("w_mine_EDF",)) == {
        "w_mine_EDF": (P("expert"), None)}
    assert specs(MeshConfig(data=4, expert=2), 8)["w_gate_EDF"] == (P("expert"), None)
