"""One process of the 2-process expert-parallel test (run by test_dispatch_multiprocess.py).

Usage: python ep_multiprocess_worker.py COORDINATOR NUM_PROCESSES PROCESS_ID OUT_NPZ DISPATCHER
Each process has 4 host CPU devices (set by the parent through XLA_FLAGS); the mesh spans all 8.
Builds the same parameters and tokens as `case()` in every process, runs the EP layer forward
and backward, and process 0 writes the loss, output and gradients to OUT_NPZ.
"""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np


def case(dispatcher: str):
    """The shared test case: config, params and tokens, identical in every process."""
    from dropless import MoEConfig
    from dropless.moe import layer
    cfg = MoEConfig(num_experts=16, top_k=2, d_model=8, d_ff=16, gmm_backend="ragged_dot",
                    dispatcher=dispatcher, ragged_buffer_factor=1.0)
    params = layer.init_params(jax.random.key(0), cfg)
    # skew routing toward device 0 so the a2a path needs several rounds
    params["router"]["bias_E"] = jnp.asarray([0.3, 0.3] + [0.0] * 14, jnp.float32)
    x = jax.random.normal(jax.random.key(1), (64, 8), jnp.float32)
    return cfg, params, x


def loss_fn(params, x, cfg, mesh):
    """A loss whose gradient touches every output element differently."""
    from dropless.moe import layer
    y, aux = layer.apply(params, x, cfg, mesh=mesh)
    w = jnp.sin(jnp.arange(y.size, dtype=jnp.float32)).reshape(y.shape)
    return jnp.sum(y * w), (y, aux["rounds"] if "rounds" in aux else jnp.int32(1))


def main(argv: list[str]) -> int:
    coordinator, nproc, pid, out, dispatcher = argv[1], int(argv[2]), int(argv[3]), argv[4], argv[5]
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=nproc,
                               process_id=pid, initialization_timeout=60,
                               shutdown_timeout_seconds=30)
    from jax.sharding import NamedSharding, PartitionSpec

    from dropless.config import MeshConfig
    from dropless.parallel import make_mesh, param_shardings
    cfg, params, x = case(dispatcher)
    mesh = make_mesh(MeshConfig(expert=jax.device_count()))
    rep = NamedSharding(mesh, PartitionSpec())

    def globalize(a, sharding):
        a = np.asarray(a)
        return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])

    params_g = jax.tree.map(globalize, params, param_shardings(params, mesh))
    x_g = globalize(x, NamedSharding(mesh, PartitionSpec(mesh.axis_names)))
    step = jax.jit(jax.value_and_grad(lambda p, x: loss_fn(p, x, cfg, mesh), argnums=(0, 1),
                                      has_aux=True), out_shardings=rep)
    (loss, (y, rounds)), (g_params, g_x) = step(params_g, x_g)
    if pid == 0:
        flat = {"/".join(str(getattr(k, "key", k)) for k in path): np.asarray(v)
                for path, v in jax.tree_util.tree_flatten_with_path(g_params)[0]}
        np.savez(out, loss=np.asarray(loss), y=np.asarray(y), g_x=np.asarray(g_x),
                 rounds=np.asarray(rounds), **{"g_" + k.replace("/", "."): v
                                               for k, v in flat.items()})
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
