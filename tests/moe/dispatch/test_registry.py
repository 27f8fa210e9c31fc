"""Every registered dispatcher is data: its spec has the fields the shard_map boundary reads,
and what its functions return is its own NamedTuple (state from prepare, metadata from
dispatch, consumed by combine).

Legend: T tokens, D model dim, E experts, K top-k, P = 8 EP peers (the conftest's host devices),
G = 4 devices per node (node_a2a runs on 2 nodes of 4).

Each strategy's round 0 is traced on shapes only (jax.eval_shape of the shard_map), so
ragged_a2a, which XLA:CPU cannot compile, is checked here too; nothing is compiled or run.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec

from dropless import MoEConfig
from dropless.config import MeshConfig
from dropless.moe import layer
from dropless.moe.dispatch import DISPATCHERS, DispatcherSpec
from dropless.moe.dispatch.context import make_context, split_expert_axis
from dropless.moe.dispatch.send_plan import SendPlan
from dropless.moe.experts import expert_ffn
from dropless.parallel import NodeMesh, make_mesh

E, K, D, F, T, P, G = 16, 4, 8, 16, 64, 8, 4


def _is_namedtuple(t) -> bool:
    return isinstance(t, type) and issubclass(t, tuple) and bool(getattr(t, "_fields", ()))


def test_every_spec_has_the_fields_the_boundary_reads():
    fields = {f.name for f in dataclasses.fields(DispatcherSpec)}
    assert {"state_type", "meta_type", "device_plan", "replicates_tokens", "overflows",
            "buffer_rows", "split_nodes", "traffic", "unsupported_on"} <= fields
    for name, spec in DISPATCHERS.items():
        assert spec.name == name
        assert callable(spec.prepare) and callable(spec.rounds)
        assert callable(spec.dispatch) and callable(spec.combine) and callable(spec.device_plan)
        assert _is_namedtuple(spec.state_type) and _is_namedtuple(spec.meta_type), name
        assert isinstance(spec.replicates_tokens, bool) and isinstance(spec.overflows, bool)
        assert spec.description
    metas = [spec.meta_type for spec in DISPATCHERS.values()]
    assert len(set(metas)) == len(metas)     # a metadata type of its own, per strategy
    # the reference strategy replicates tokens and never overflows; the fused ones do not
    assert DISPATCHERS["allgather"].replicates_tokens and not DISPATCHERS["allgather"].overflows
    assert all(s.overflows and not s.replicates_tokens
               for n, s in DISPATCHERS.items() if n != "allgather")


@pytest.mark.skipif(jax.device_count() < P, reason="needs 8 host devices (tests/conftest.py)")
@pytest.mark.parametrize("name", sorted(DISPATCHERS))
def test_state_and_metadata_are_the_specs_namedtuples(name):
    spec = DISPATCHERS[name]
    cfg = MoEConfig(num_experts=E, top_k=K, d_model=D, d_ff=F, gmm_backend="ragged_dot",
                    dispatcher=name)
    mesh = NodeMesh(make_mesh(MeshConfig(expert=P)), devices_per_node=G)
    if spec.split_nodes:
        mesh = split_expert_axis(mesh)
    ctx = make_context(cfg, mesh, T, jnp.float32)
    experts = layer.init_params(jax.random.key(0), cfg)["experts"]
    seen = {}

    def body(x_TD, w_TK, ids_TK, experts):
        state = spec.prepare(ids_TK, ctx)
        x_ND, sizes_El, meta = spec.dispatch(x_TD, w_TK, state, 0, ctx)
        seen.update(state=state, meta=meta, plan=spec.device_plan(state))
        return spec.combine(expert_ffn(x_ND, sizes_El, experts, cfg), meta, ctx)

    tok = PartitionSpec(ctx.all_axes)
    fn = jax.shard_map(body, mesh=mesh.mesh, in_specs=(tok, tok, tok, {k: PartitionSpec(
        ctx.expert_axis) for k in experts}), out_specs=tok, check_vma=False)
    ids_TK = (jnp.arange(T * K, dtype=jnp.int32) % E).reshape(T, K)
    y = jax.eval_shape(fn, jnp.ones((T, D)), jnp.ones((T, K)), ids_TK, experts)
    assert y.shape == (T, D) and y.dtype == jnp.float32
    assert type(seen["state"]) is spec.state_type
    assert type(seen["meta"]) is spec.meta_type
    assert type(seen["plan"]) is SendPlan and seen["plan"].hit_TP.shape == (T // P, P)
