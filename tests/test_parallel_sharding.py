"""Whole-train-state placement: MoE weights by the table, other matrices FSDP, rest replicated."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from dropless import MeshConfig
from dropless.parallel import sharding
from dropless.parallel.mesh import make_mesh


def test_state_shardings_split_params_and_moments():
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, expert=2))
    params = {"layer0": {"moe": {"experts": {"w_gate_EDF": jnp.zeros((4, 8, 6)),
                                             "w_down_EFD": jnp.zeros((4, 6, 8))},
                                 "router": {"w_DE": jnp.zeros((8, 4)), "bias_E": jnp.zeros(4)}},
                         "attn": {"wq": jnp.zeros((8, 12)), "odd": jnp.zeros((3, 5))}}}
    state = {"params": params, "opt": {"mu": params, "count": jnp.zeros((), jnp.int32)}}
    specs = jax.tree.map(lambda s: s.spec, sharding.state_shardings(state, mesh))
    for tree in (specs["params"], specs["opt"]["mu"]):
        assert tree["layer0"]["moe"]["experts"]["w_gate_EDF"] == P("expert", "fsdp", None)
        assert tree["layer0"]["moe"]["experts"]["w_down_EFD"] == P("expert", None, "fsdp")
        assert tree["layer0"]["moe"]["router"]["w_DE"] == P(None, None)
        assert tree["layer0"]["moe"]["router"]["bias_E"] == P(None)
        assert tree["layer0"]["attn"]["wq"] == P(None, "fsdp")   # largest dim divisible by 2
        assert tree["layer0"]["attn"]["odd"] == P()              # nothing divides: replicated
    assert specs["opt"]["count"] == P()
    placed = jax.device_put(state, sharding.state_shardings(state, mesh))
    shard = placed["params"]["layer0"]["moe"]["experts"]["w_gate_EDF"].addressable_shards[0]
    assert shard.data.shape == (2, 4, 6)  # really split: experts over 2, D over 2
    np.testing.assert_array_equal(np.asarray(placed["params"]["layer0"]["attn"]["wq"]),
                                  np.zeros((8, 12)))
