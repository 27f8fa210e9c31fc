"""overflow="error" really raises; bad meshes, configs and dispatchers raise naming the value."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

from dropless import MoEConfig
from dropless.config import MeshConfig
from dropless.config_file import build_config
from dropless.moe import layer
from dropless.moe.dispatch import dispatcher_names, resolve_dispatcher
from dropless.parallel import logical_to_spec, make_mesh, param_specs
from dropless.train.overflow import BufferOverflowError, OverflowGuard


def _cfg(**kw) -> MoEConfig:
    base = dict(num_experts=16, top_k=2, d_model=8, d_ff=16, gmm_backend="ragged_dot",
                dispatcher="a2a", ragged_buffer_factor=1.0, overflow="error")
    base.update(kw)
    return MoEConfig(**base)


def _one_device_params(cfg):
    params = layer.init_params(jax.random.key(0), cfg)
    params["router"]["bias_E"] = jnp.asarray([5.0, 5.0] + [0.0] * 14, jnp.float32)
    return params


def _train_cfg(**moe):
    """A TrainConfig whose one MoE layer is layer 3, with these model.moe values."""
    return build_config([("model.num_layers", 4), ("model.first_k_dense", 3),
                         ("model.mtp_depth", 0)]
                        + [(f"model.moe.{k}", v) for k, v in moe.items()])


def _guard_check(aux, cfg: MoEConfig) -> None:
    """The trainer's check (train/overflow.py) of one step whose one MoE layer reported `aux`:
    the guarded step runs, then the host reads the flag after step 1 (raises on overflow)."""
    guard = OverflowGuard(_train_cfg(overflow=cfg.overflow,
                                     ragged_buffer_factor=cfg.ragged_buffer_factor))
    assert guard.names == ["layer 3"]
    metrics = {"dropped_rows_L": aux["dropped_rows"], "sufficient_buffer_factor_L":
               aux["sufficient_buffer_factor"]}
    step = guard.wrap(lambda s, b: ({**s, "step": s["step"] + 1}, dict(metrics)))
    state, _ = step(guard.attach({"step": jnp.zeros((), jnp.int32)}), None)
    guard.check(state, 1)


def test_error_policy_raises_with_layer_rows_and_factor():
    """EP=8, T_local=8, K=2, factor 1: a round takes one 2-entry row per peer (see
    test_one_device_routing_rounds_and_stats_hand_counted); all 8 rows of each device go to
    device 0, so 7 per device overflow, 56 in all, and a factor of 8.0 would have been enough."""
    cfg = _cfg()
    mesh = make_mesh(MeshConfig(expert=8))
    x = jax.random.normal(jax.random.key(1), (64, 8), jnp.float32)
    _, aux = jax.jit(lambda p, x: layer.apply(p, x, cfg, mesh=mesh))(_one_device_params(cfg), x)
    assert float(aux["dropped_rows"]) == 56 and int(aux["rounds"]) == 1
    with pytest.raises(BufferOverflowError, match=r"step 1: .* in layer 3 \(56 rows\) with "
                       r"model.moe.ragged_buffer_factor=1.0 .* ragged_buffer_factor=8\.0 would"):
        _guard_check(aux, cfg)
    # with the sufficient factor nothing overflows, nothing raises, and the output is exact
    big = cfg.replace(ragged_buffer_factor=8.0)
    y, aux = jax.jit(lambda p, x: layer.apply(p, x, big, mesh=mesh))(_one_device_params(big), x)
    _guard_check(aux, big)
    y_ref, _ = jax.jit(lambda p, x: layer.apply(p, x, big))(_one_device_params(big), x)
    np.testing.assert_allclose(y, y_ref, rtol=2e-5, atol=2e-5)


def test_overflow_check_every_n_steps():
    """The trainer reads the flag after every n-th step, counted from 1."""
    guard = OverflowGuard(_train_cfg(overflow="error", overflow_check_every_n_steps=3))
    assert [guard.due(s) for s in range(1, 7)] == [False, False, True, False, False, True]
    assert not OverflowGuard(_train_cfg(overflow="rounds", overflow_check_every_n_steps=3)).due(3)


def test_overflow_check_quiet_without_drops():
    _guard_check({"dropped_rows": jnp.float32(0), "sufficient_buffer_factor": jnp.float32(0.5)},
                 _cfg())


def _apply(cfg, mesh, tokens=64):
    params = layer.init_params(jax.random.key(0), cfg)
    return jax.jit(lambda p, x: layer.apply(p, x, cfg, mesh=mesh))(
        params, jnp.ones((tokens, cfg.d_model)))


def _trace(cfg, mesh, tokens=64):
    """`_apply` traced on shapes only: the checks below raise while tracing, as under jit, and
    nothing is initialised or compiled first."""
    return jax.eval_shape(lambda: _apply(cfg, mesh, tokens))


def test_mesh_without_expert_axis():
    mesh = Mesh(np.asarray(jax.devices()), ("data",))
    with pytest.raises(ValueError, match="no 'expert' axis"):
        _trace(_cfg(), mesh)


def test_experts_not_divisible_by_ep():
    with pytest.raises(ValueError, match="num_experts=12 is not divisible by expert "
                                         "parallelism 8"):
        _trace(_cfg(num_experts=12), make_mesh(MeshConfig(expert=8)))


def test_tokens_not_divisible_by_devices():
    with pytest.raises(ValueError, match="token count 60 is not divisible by the 8 devices"):
        _trace(_cfg(), make_mesh(MeshConfig(expert=8)), tokens=60)


def test_ragged_a2a_refused_on_cpu():
    with pytest.raises(ValueError, match="dispatcher='ragged_a2a' is not supported on cpu"):
        resolve_dispatcher("ragged_a2a", platform="cpu")
    assert resolve_dispatcher("ragged_a2a", platform="gpu") == "ragged_a2a"
    assert resolve_dispatcher("auto", platform="cpu") == "a2a"
    with pytest.raises(ValueError, match="dispatcher='nccl' is unknown"):
        resolve_dispatcher("nccl")
    assert set(dispatcher_names()) == {"auto", "local", "allgather", "a2a", "ragged_a2a",
                                       "node_a2a"}


def test_mesh_config_validation():
    with pytest.raises(ValueError, match=r"MeshConfig.expert=0 must be a positive int"):
        MeshConfig(expert=0)
    with pytest.raises(ValueError, match=r"needs 16 devices \(data\*fsdp\*expert\) but 8"):
        make_mesh(MeshConfig(data=2, expert=8))


def test_make_mesh_layout():
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, expert=2))
    assert mesh.axis_names == ("data", "fsdp", "expert")
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "expert": 2}
    # expert varies fastest: an EP group is neighbouring devices (one node when it fits)
    assert [d.id for d in mesh.devices[0, 0]] == [0, 1]
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def test_param_specs_table():
    cfg = _cfg(num_shared_experts=1)
    mesh = make_mesh(MeshConfig(fsdp=2, expert=4))
    specs = param_specs(jax.eval_shape(lambda: layer.init_params(jax.random.key(0), cfg)), mesh)
    assert specs["experts"]["w_gate_EDF"] == PartitionSpec("expert", "fsdp", None)
    assert specs["experts"]["w_down_EFD"] == PartitionSpec("expert", None, "fsdp")
    assert specs["router"]["w_DE"] == PartitionSpec(None, None)
    # the shared expert is ZeRO-3 over fsdp x expert (D = 8 divides 2 x 4), outside the shard_map
    assert specs["shared"]["w_up_DF"] == PartitionSpec(("fsdp", "expert"), None)
    assert logical_to_spec(("batch", None), mesh) == PartitionSpec(("data", "fsdp", "expert"),
                                                                    None)
    with pytest.raises(ValueError, match="'extra/w' has no entry in PARAM_AXES"):
        param_specs({"extra": {"w": jnp.ones(2)}}, mesh)
    with pytest.raises(ValueError, match="logical axis 'sequence' has no rule"):
        logical_to_spec(("sequence",), mesh)   # ('heads' has a rule now: unsharded)


def test_local_dispatcher_with_mesh_runs_unsharded_path():
    cfg = _cfg(dispatcher="local", overflow="rounds")
    y, aux = _apply(cfg, make_mesh(MeshConfig(expert=8)))
    y_ref, _ = _apply(cfg, None)
    np.testing.assert_allclose(y, y_ref, rtol=1e-6, atol=1e-6)
