"""The planner's weight collectives of one layer (plan/model.py `fsdp_collectives`,
`gradient_all_reduces`) against the trainer's own placement of that layer's parameters
(`parallel.sharding.state_shardings` of the abstract train state on a mesh of host devices).

From each parameter's PartitionSpec, counted here: it is all-gathered (and its gradient
reduce-scattered) over the mesh axes that split its dims, but a routed expert weight not over
those of its expert dim E (each device computes its own experts); its gradient shard (its
elements over every axis that splits it) is all-reduced over the axes that split none of its
dims. A dim a mesh axis does not divide is whole over that axis (`parallel.mesh.split_axes`),
which moves that axis from its gather to its replicas. The router's bias has no gradient; the
count of tokens per expert that updates it is summed over every device, as its gradient would
be (the same elements). Element counts are compared, in the planner's groups of devices
(`plan.layout.axes_group`).
"""
import math
from collections import Counter

import jax
import pytest

from dropless.config import MESH_AXES, MeshConfig, TrainConfig
from dropless.machine import get_profile
from dropless.parallel.mesh import make_mesh
from dropless.parallel.sharding import state_shardings
from dropless.plan import model as plan_model
from dropless.plan.layout import axes_group, node_size
from dropless.train.step import init_state
from tests.plan.plans import plan_of
from tests.plan.test_memory_mesh import TRAINER_CASES

CASES = [(m, mesh) for m, mesh in TRAINER_CASES if not m.scan_layers]
HW = get_profile("h100")


def _spec_axes(spec, ndim: int) -> list[tuple[str, ...]]:
    dims = [() if s is None else (s,) if isinstance(s, str) else tuple(s) for s in spec]
    return dims + [()] * (ndim - len(dims))


def _trainer_collectives(run: TrainConfig, layer: int, cfg) -> tuple[Counter, Counter]:
    """({(routed expert?, gather group): gathered elements}, {replicas group: gradient shard
    elements}) of `params.layers[layer]` as the trainer places it."""
    state = jax.eval_shape(lambda: init_state(run)[0])
    mesh = make_mesh(run.mesh, jax.devices()[:run.mesh.num_devices])
    shardings = state_shardings(state, mesh)
    sizes = {a: int(n) for a, n in mesh.shape.items()}
    node = node_size(cfg, HW)
    params = state["params"]["layers"][layer]
    specs = shardings["params"]["layers"][layer]
    gathers, reduces = Counter(), Counter()
    for (path, leaf), sharding in zip(jax.tree_util.tree_leaves_with_path(params),
                                      jax.tree.leaves(specs)):
        dims = _spec_axes(sharding.spec, leaf.ndim)
        routed = "experts" in jax.tree_util.keystr(path)
        split = {a for axes in dims for a in axes if sizes[a] > 1}
        gather = {a for i, axes in enumerate(dims) if not (routed and i == 0)
                  for a in axes if sizes[a] > 1}
        n = math.prod(leaf.shape)
        local = n / math.prod(sizes[a] for a in dims[0]) if routed else n
        if gather:
            key = (routed, axes_group(cfg.mesh, tuple(a for a in MESH_AXES if a in gather), node))
            gathers[key] += local
        replicas = tuple(a for a in MESH_AXES if sizes[a] > 1 and a not in split)
        if replicas:
            reduces[axes_group(cfg.mesh, replicas, node)] += n / math.prod(sizes[a] for a in split)
    return gathers, reduces


def _order(item):
    n, g = item
    return n, g.size, g.stride, g.inner


@pytest.mark.parametrize("model, mesh", CASES,
                         ids=[f"{'mha' if m.attention == 'mha' else 'mla'}-{'x'.join(map(str, mesh))}"
                              f"-v{m.vocab_size}-d{m.d_model}" for m, mesh in CASES])
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_a_layers_gathers_and_all_reduces_are_the_trainers(model, mesh, moe):
    data, fsdp, ep = mesh
    model = model.replace(weight_dtype="float32")
    run = TrainConfig(model=model, mesh=MeshConfig(data=data, fsdp=fsdp, expert=ep), seq_len=8)
    cfg = plan_of(model, data=data, fsdp=fsdp, ep=ep, seq=8)
    layer = model.num_layers - 1 if moe else 0
    assert model.is_moe_layer(layer) == moe
    gathers, reduces = _trainer_collectives(run, layer, cfg)

    layer_b = plan_model._layer_weight_bytes(cfg, moe)
    ab, wb = cfg.activation_bytes, cfg.weight_bytes
    planned_gathers = sorted(((b / ab, g) for b, g in plan_model.fsdp_collectives(layer_b, cfg, HW)),
                             key=_order)
    expected = sorted(((n, g) for (_, g), n in gathers.items()), key=_order)
    assert [g for _, g in planned_gathers] == [g for _, g in expected]
    assert [n for n, _ in planned_gathers] == pytest.approx([n for n, _ in expected], rel=1e-12)

    planned = plan_model.gradient_all_reduces(layer_b, cfg, HW, wb / ab)
    assert {g: b / wb for b, g in planned} == pytest.approx(dict(reduces), rel=1e-12)
