"""The memory model's weights on a mesh: each parameter group split as the trainer places it
(`plan.layout.weight_shards`), counted by hand, and checked against the trainer's own placement
(`parallel.sharding.state_shardings` of the abstract train state on a mesh of host devices).

The hand-counted model: vocabulary 16, d 8, two layers (a dense one, then an MoE one), MHA with
2 query heads and 1 key/value head of 4, dense d_ff 16, 4 routed experts of d_ff 4 (top 2) and
one shared expert. Parameters:
  routed experts (split over expert x fsdp): 4 x 3 x 8 x 4 = 384;
  replicated (norm vectors and the router): final norm 8, two norms a layer 2 x 16, router
    8 x 4 + bias 4 = 36: 76;
  sharded over fsdp x expert: embedding 128, head 128, attention 2 x (8x8 + 8x4 + 8x4 + 8x8
    = 192), dense FFN 3 x 8 x 16 = 384, shared expert 3 x 8 x 4 = 96: 1120.
1580 in all. On a device: expert 4: 384/4 + 76 + 1120/4 = 452 (ZeRO-3 over the expert axis
too); fsdp 4: 96 + 76 + 280 = 452; fsdp 2 x expert 2: 96 + 76 + 280 = 452; data 2 x expert 2:
384/2 + 76 + 1120/2 = 828 (the data axis replicates everything).
"""
import math

import jax
import pytest

from dropless.config import MeshConfig, TrainConfig
from dropless.machine import get_profile
from dropless.models.arithmetic import param_counts
from dropless.parallel.mesh import make_mesh
from dropless.parallel.sharding import state_shardings
from dropless.plan import memory
from dropless.plan.layout import weight_shards
from dropless.presets import get_preset
from dropless.train.step import init_state
from tests._support.model_configs import model_config
from tests.plan.plans import plan_of

MOE = model_config(vocab_size=16, d_model=8, num_layers=2, first_k_dense=1, num_heads=2,
                   num_kv_heads=1, head_dim=4, d_ff=16, attention="mha", num_experts=4, top_k=2,
                   moe_d_ff=4, num_shared_experts=1)

# (data, fsdp, expert) -> parameters on one device, by hand (module docstring)
BY_HAND = {(1, 1, 1): 1580, (1, 1, 4): 452, (1, 4, 1): 452, (1, 2, 2): 452, (2, 1, 2): 828}


def test_the_groups_add_up_to_the_model():
    assert memory.weight_groups(MOE) == {"experts": 384, "replicated": 76, "sharded": 1120}
    assert param_counts(MOE)["total"] == 1580


@pytest.mark.parametrize("mesh, per_device", BY_HAND.items())
def test_weights_gradients_and_moments_split_as_the_trainer_places_them(mesh, per_device):
    data, fsdp, ep = mesh
    cfg = plan_of(MOE.replace(scan_layers=True), data=data, fsdp=fsdp, ep=ep, seq=8)
    m = memory.memory_per_device(cfg, get_profile("h100"))
    assert memory.sharded_params(cfg) == per_device
    # float32 weights and moments; scanned, every gradient is alive at the peak
    # the router bias (4, replicated) has no moments
    assert (m["parameters"], m["gradients"], m["optimizer_state"]) == (
        per_device * 4, per_device * 4, (per_device - 4) * 8)


def test_the_gathered_layer_keeps_only_the_devices_experts():
    """The MoE layer gathered: attention 192, norms 16, router 36, shared 96, and the routed
    experts over the expert axis alone (the fsdp all-gather makes them whole again over fsdp):
    340 + 384 / ep, against the dense layer's 192 + 16 + 384 = 592; two of the larger in
    float32 (the model's compute dtype)."""
    for (data, fsdp, ep) in ((1, 1, 4), (1, 4, 1), (1, 2, 2)):
        m = memory.weight_memory(plan_of(MOE, data=data, fsdp=fsdp, ep=ep, seq=8))
        assert m["gathered_weights"] == 2 * max(592, 340 + 384 / ep) * 4
        assert weight_shards(MeshConfig(data=data, fsdp=fsdp, expert=ep), "experts",
                             gathered=True) == ep


def _trainer_bytes(cfg: TrainConfig, root: str) -> tuple[int, int]:
    """(bytes of the state's arrays below `root` on one device as `state_shardings` places
    them on cfg.mesh over host devices, the same arrays' bytes whole); the optimizer's scalar
    counters left out."""
    state = jax.eval_shape(lambda: init_state(cfg)[0])
    mesh = make_mesh(cfg.mesh, jax.devices()[:cfg.mesh.num_devices])
    shardings = state_shardings(state, mesh)
    local = whole = 0
    for leaf, sharding in zip(jax.tree.leaves(state[root]), jax.tree.leaves(shardings[root])):
        if leaf.ndim:
            local += math.prod(sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
            whole += math.prod(leaf.shape) * leaf.dtype.itemsize
    return local, whole


TRAINER_CASES = [(MOE, m) for m in BY_HAND if math.prod(m) > 1] + [
    (MOE.replace(scan_layers=True), (1, 2, 2)),
    # MLA with a query latent, its norm vectors, MTP: deepseek3-test
    (get_preset("deepseek3-test"), (1, 1, 8)), (get_preset("deepseek3-test"), (1, 2, 4)),
    (get_preset("deepseek3-test"), (2, 4, 1)), (get_preset("deepseek3-test"), (1, 8, 1)),
    # dims a mesh axis does not divide, which the trainer keeps whole over that axis: the
    # vocabulary 18 over fsdp 4 (whole) and fsdp 2 x expert 2 (over fsdp alone); d 6 (every
    # matrix's FSDP dim, the experts' too) over fsdp 4; MLA's vocabulary 260 and key/value
    # latent 36 over fsdp 8 (whole) and fsdp 2 x expert 4 (over fsdp), query latent 40 split
    (MOE.replace(vocab_size=18), (1, 4, 1)), (MOE.replace(vocab_size=18), (1, 2, 2)),
    (model_config(vocab_size=16, d_model=6, num_layers=2, first_k_dense=1, num_heads=2,
                  num_kv_heads=1, head_dim=4, d_ff=16, attention="mha", num_experts=4, top_k=2,
                  moe_d_ff=4, num_shared_experts=1), (1, 4, 1)),
    (get_preset("deepseek3-test").replace(vocab_size=260, q_lora_rank=40, kv_lora_rank=36),
     (1, 8, 1)),
    (get_preset("deepseek3-test").replace(vocab_size=260, q_lora_rank=40, kv_lora_rank=36),
     (1, 2, 4))]


@pytest.mark.parametrize("model, mesh", TRAINER_CASES,
                         ids=[f"{'mha' if m.attention == 'mha' else 'mla'}"
                              f"{'-scan' if m.scan_layers else ''}-{'x'.join(map(str, mesh))}"
                              f"-v{m.vocab_size}-d{m.d_model}"
                              for m, mesh in TRAINER_CASES])
def test_parameter_and_moment_bytes_match_the_trainers_placement(model, mesh):
    """The planner's per-device parameter and Adam moment bytes against `state_shardings`
    applied to the trainer's abstract state (`train.step.init_state`), float32 weights and
    moments: what the trainer holds, not what the planner says of itself."""
    data, fsdp, ep = mesh
    run = TrainConfig(model=model.replace(weight_dtype="float32"),
                      mesh=MeshConfig(data=data, fsdp=fsdp, expert=ep), seq_len=8)
    params, params_whole = _trainer_bytes(run, "params")
    moments, moments_whole = _trainer_bytes(run, "opt_state")
    counts = param_counts(run.model)
    assert params_whole == (counts["total"] + counts["mtp"]) * 4
    m = memory.weight_memory(plan_of(run.model, data=data, fsdp=fsdp, ep=ep, seq=8))
    assert m["parameters"] == params
    # mu and nu of every parameter but the router biases (frozen: no moments)
    assert moments_whole == 2 * (params_whole - memory.frozen_params(run.model) * 4)
    assert m["optimizer_state"] == moments
