"""Streaming load: one tensor at a time on the host, parameters placed shard by shard on a mesh."""
import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from dropless import hf
from dropless.config import MeshConfig, ModelConfig, MoEConfig
from dropless.models.decoder import init_params
from dropless.parallel.mesh import make_mesh
from tests._support.paths import HF_FIXTURES, SRC

FIX = HF_FIXTURES

PROBE = r"""
import json, resource, sys, tracemalloc
import jax, numpy as np
from dropless import hf
from dropless.models.decoder import init_params
jax.device_put(np.zeros(4)).block_until_ready()
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
tracemalloc.start()
if sys.argv[2] == "load":
    cfg, params = hf.load(sys.argv[1])
else:   # the floor: the same parameters placed from memory, no checkpoint at all
    cfg = hf.read_config(sys.argv[1])[0]
    shapes = jax.eval_shape(lambda k: init_params(k, cfg), jax.random.key(0))
    params = jax.tree.map(lambda s: jax.device_put(np.ones(s.shape, s.dtype)).block_until_ready(),
                          shapes)
jax.block_until_ready(params)
cur, peak = tracemalloc.get_traced_memory()
leaves = jax.tree.leaves(params)
print(json.dumps({"rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base,
                  "transient": peak - cur, "total": sum(x.nbytes for x in leaves),
                  "largest": max(x.nbytes for x in leaves), "count": len(leaves)}))
"""


def _probe(folder: Path, mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, str(folder), mode], check=True,
                         capture_output=True, text=True, env={"PYTHONPATH": SRC,
                                                              "JAX_PLATFORMS": "cpu",
                                                              "PATH": "/usr/bin:/bin"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_peak_host_memory_is_one_tensor_not_the_model(tmp_path):
    """A ~50 MB checkpoint of 260 tensors: host memory above the loaded parameters stays
    within a few of the largest tensor (a stacked [E, D, F] expert weight, 2 MB)."""
    cfg = ModelConfig(vocab_size=512, d_model=256, num_layers=8, num_heads=4, d_ff=256,
                      attention="mha", moe=MoEConfig(num_experts=8, top_k=2, d_model=256,
                                                     d_ff=256, score_func="softmax"))
    shapes = jax.eval_shape(lambda k: init_params(k, cfg), jax.random.key(0))
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: rng.standard_normal(s.shape, np.float32), shapes)
    for blk in params["layers"]:
        blk["moe"]["router"]["bias_E"][:] = 0
    hf.save(cfg, params, tmp_path, max_shard_bytes=8_000_000)
    del params
    load, floor = _probe(tmp_path, "load"), _probe(tmp_path, "floor")
    assert load["count"] == floor["count"] and load["total"] > 40e6
    largest = load["largest"]
    # numpy buffers alive at the peak beyond the parameters themselves, against what placing
    # the same arrays from memory leaves (device_put's own host copy: ~2 tensors)
    assert load["transient"] <= floor["transient"] + 2 * largest, (load, floor)
    # resident memory: what placing the same parameters from memory costs, plus a few tensors
    assert load["rss"] <= floor["rss"] + 4 * largest, (load, floor)


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(MeshConfig(data=1, fsdp=2, expert=4))


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3_yarn"])
def test_mesh_placement_matches_host_load(name, mesh):
    cfg, ref = hf.load(FIX / name, dtype="float32")
    cfg2, placed = hf.load(FIX / name, dtype="float32", mesh=mesh)
    assert cfg2 == cfg
    moe_layer = next(i for i in range(cfg.num_layers) if cfg.is_moe_layer(i))
    w = placed["layers"][moe_layer]["moe"]["experts"]["w_gate_EDF"]
    assert w.sharding.spec[0] == "expert"
    assert len({str(s.index) for s in w.addressable_shards}) > 1   # really split
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(placed)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
