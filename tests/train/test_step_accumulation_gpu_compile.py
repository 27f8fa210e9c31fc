"""Where XLA:GPU puts a step's collectives when it accumulates gradients, which the planner's
step model follows (plan/model.py): compiled for 4 compile-only H100s (the jax CUDA plugin) on a
mesh of data 2 x fsdp 2, once without accumulation and once with two micro-batches,
- data-parallel: the gradients' all-reduce leaves the accumulation loop (XLA accumulates each
  replica's gradients and reduces the sum once, after the loop; only metrics are reduced
  inside), so the replicas' reduction happens once a step;
- FSDP: the weights' all-gathers stay inside the loop, once per micro-batch (on XLA's CPU
  pipeline they are hoisted out instead: a CPU compile does not tell).
On a small model, with jax 0.11.2, what the GPU machines run (jax 0.12.0.1 keeps part of the
gradients' all-reduce inside the loop); what XLA decides at other sizes is what the device run
measures."""
from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp

from dropless.models.arithmetic import param_counts
from dropless.parallel.mesh import NodeMesh, batch_sharding, make_mesh
from dropless.parallel.sharding import state_shardings
from dropless.train import compile_only, step
from tests._support import cuda_compile
from tests.train.test_step_accumulation import config

cuda_compile.require_plugin()

BYTES = {"f32": 4, "bf16": 2, "s32": 4, "u32": 4, "f16": 2, "pred": 1}


def _shape_bytes(text: str) -> int:
    total = 0
    for dt, dims in re.findall(r"(f32|bf16|s32|u32|f16|pred)\[([0-9,]*)\]", text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * BYTES[dt]
    return total


def compiled_step(k: int) -> str:
    """The optimized HLO of the step compiled for 4 compile-only H100s on a mesh of data 2 x
    fsdp 2, k micro-batches of 1 row a device."""
    cfg = config(**{"mesh.data": 2, "mesh.fsdp": 2, "model.moe.gmm_backend": "ragged_dot",
                    "model.dtype": "bfloat16", "model.moe.dtype": "bfloat16"},
                 per_device_batch_size=1, gradient_accumulation_steps=k)
    mesh = NodeMesh(make_mesh(cfg.mesh, compile_only.devices("h100", 4)))
    state = jax.eval_shape(lambda: step.init_state(cfg)[0])
    opt = step.make_optimizer(cfg, state["params"])
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                         state, state_shardings(state, mesh))
    batch = jax.ShapeDtypeStruct((4 * k, cfg.seq_len + 1), jnp.int32,
                                 sharding=batch_sharding(mesh))
    return jax.jit(functools.partial(step.train_step, cfg=cfg, opt=opt, mesh=mesh)).lower(
        state, batch).compile().as_text()


def collective_bytes(txt: str, op: str) -> tuple[int, int]:
    """(bytes `op` moves inside while-loop bodies, elsewhere) in the optimized HLO `txt`."""
    bodies = set(re.findall(r"body=%?([\w.\-]+)", txt))
    inside = outside = 0
    for comp in re.split(r"\n(?=\S)", txt):
        head = re.match(r"%?([\w.\-]+)", comp)
        n = sum(_shape_bytes(m) for m in re.findall(rf"= (\S+|\([^=]*\)) {op}(?:-start)?\(", comp))
        if head and head.group(1) in bodies:
            inside += n
        else:
            outside += n
    return inside, outside


def test_the_replicas_reduce_once_a_step_and_fsdp_gathers_every_micro_batch():
    n = param_counts(config().model)["total"]
    one, acc = compiled_step(1), compiled_step(2)
    # every float32 gradient, at least its fsdp half, reduced over the replicas once
    one_in, one_out = collective_bytes(one, "all-reduce")
    acc_in, acc_out = collective_bytes(acc, "all-reduce")
    assert one_in == 0 and one_out >= 4 * n // 2
    assert acc_out >= 4 * n // 2 and acc_in < 1024   # the same after the loop; metrics inside
    gather_one = collective_bytes(one, "all-gather")
    gather_acc = collective_bytes(acc, "all-gather")
    assert gather_one[0] == 0 and gather_one[1] > 0
    assert gather_acc == (gather_one[1], 0)          # the same gathers, inside the loop
