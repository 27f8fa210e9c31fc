"""One process of the 2-process loader test (tests/data/test_loader_multiprocess.py).

Usage: python loader_worker.py COORDINATOR NUM_PROCESSES PROCESS_ID DATA_DIR OUT_NPZ
Each process has 2 host CPU devices (XLA_FLAGS from the parent); the batch is sharded over all
4. Each process builds only its rows of batches `INDICES` of the prepared dataset in DATA_DIR
(data.loader.Loader with the batch sharding), the trainer's loss (train.step.loss_fn) is computed
on the global batch,
and process 0 writes the gathered batches, the losses and each process's row range to OUT_NPZ.
"""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

B, S, SEED, PACKING = 8, 16, 7, "documents"
INDICES = (0, 3, 11)


def loss(batch):
    """The trainer's objective (train.step.loss_fn: the model's masked cross-entropy, MTP and
    balance losses) of a small MLA model with MoE layers, fixed weights, on `batch` (call
    `_model()` once outside jit first)."""
    from dropless.train import step
    cfg, params = _model()
    return step.loss_fn(jax.tree.map(jnp.asarray, params), batch, cfg)[0]


_MODEL = []


def _model():
    """(TrainConfig, params as host arrays): the same in every process, built once."""
    if not _MODEL:
        from dropless.config import ModelConfig, MoEConfig, TrainConfig
        from dropless.models import decoder
        moe = MoEConfig(num_experts=4, top_k=2, d_model=32, d_ff=16, gmm_backend="ragged_dot")
        model = ModelConfig(vocab_size=256, d_model=32, num_layers=2, num_heads=2, d_ff=64,
                            kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                            v_head_dim=8, mtp_depth=1, moe=moe)
        cfg = TrainConfig(model=model, seq_len=S, packing=PACKING, seed=SEED)
        params = jax.tree.map(np.asarray, decoder.init_params(jax.random.PRNGKey(0), model))
        _MODEL.append((cfg, params))
    return _MODEL[0]


def batches(data_dir: str, sharding):
    """(the placed batches at INDICES, this process's rows)."""
    from dropless.data import corpus, loader
    c = corpus.load_corpus(data_dir, vocab_size=256)
    addr = loader.Addressing(loader.as_stream(c.train_TOK), seq_len=S, packing=PACKING,
                             seed=SEED)
    out = []
    for i in INDICES:   # a loader started at each index: where a resume would start
        ld = loader.Loader(addr, batch_size=B, sharding=sharding, prefetch=2, start=i)
        out.append(ld.next())
        rows = ld.rows
        ld.close()
    return out, rows


def main(argv: list[str]) -> int:
    coordinator, nproc, pid, data_dir, out = argv[1], int(argv[2]), int(argv[3]), argv[4], argv[5]
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=nproc,
                               process_id=pid, initialization_timeout=60,
                               shutdown_timeout_seconds=30)
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    mesh = Mesh(np.array(jax.devices()), ("data",))
    got, rows = batches(data_dir, NamedSharding(mesh, PartitionSpec("data")))
    _model()
    losses = [float(jax.jit(loss)(b)) for b in got]
    fields = [multihost_utils.process_allgather(b, tiled=True) for b in got]
    all_rows = multihost_utils.process_allgather(np.array(rows))
    if pid == 0:
        np.savez(out, losses=np.array(losses), rows=np.asarray(all_rows),
                 **{f"{name}_{k}": np.asarray(getattr(f, name)) for k, f in enumerate(fields)
                    for name in f._fields})
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
