"""Write tests/fixtures/init/legacy_sha256.json: the sha256 of every leaf of
the model's `init_params` for a few configs and seeds. Run it at the commit whose init
`legacy` must reproduce (4443fd4, before init schemes existed):

    PYTHONPATH=<that checkout>/src python tools/make_legacy_init_fixture.py

It reads only what that commit already had (presets, ModelConfig, init_params), so the same
script runs there and here; Each case holds its ModelConfig (as that commit wrote it: no init keys), its seed and the leaf
hashes; tests/models/test_init.py rebuilds each config with init=legacy and compares.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import subprocess
import sys

import jax
import numpy as np

from dropless.config import ModelConfig, MoEConfig
from dropless.models import init_params   # models.decoder (models.deepseek at 4443fd4)
from dropless.presets import get_preset

OUT = pathlib.Path(__file__).resolve().parents[1] / "tests/fixtures/init/legacy_sha256.json"


def cases() -> dict[str, ModelConfig]:
    """name -> the ModelConfig: MLA with and without q low-rank, MTP, groups, scanned layers,
    GQA with qk-norm, tied embeddings, fused experts and bfloat16 weights."""
    mha = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=8, qk_norm=True, d_ff=48, attention="mha", tie_embeddings=True,
                      weight_dtype="bfloat16",
                      moe=MoEConfig(num_experts=4, top_k=2, d_model=32, d_ff=16,
                                    score_func="softmax", prefuse_moe_weights=True,
                                    weight_dtype="bfloat16"))
    return {"tiny": get_preset("tiny"), "deepseek3-test": get_preset("deepseek3-test"),
            "tiny-scan": get_preset("tiny").replace(scan_layers=True), "mha-bf16-fused": mha}


SEEDS = {"tiny": (0, 1), "deepseek3-test": (0,), "tiny-scan": (0,), "mha-bf16-fused": (3,)}


def leaf_hashes(params) -> dict[str, str]:
    """'/'-joined tree path -> "dtype shape sha256" of the leaf's bytes."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = "/".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path)
        a = np.asarray(leaf)
        out[name] = f"{a.dtype} {list(a.shape)} {hashlib.sha256(a.tobytes()).hexdigest()}"
    return out


def main() -> None:
    import dropless
    src = pathlib.Path(dropless.__file__).resolve().parents[2]
    commit = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    table = {"commit": commit, "jax": jax.__version__, "cases": {}}
    for name, cfg in cases().items():
        for seed in SEEDS[name]:
            table["cases"][f"{name}/seed{seed}"] = {
                "config": dataclasses.asdict(cfg), "seed": seed,
                "leaves": leaf_hashes(init_params(jax.random.key(seed), cfg))}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"wrote {OUT} ({len(table['cases'])} cases) at {commit}", file=sys.stderr)


if __name__ == "__main__":
    main()
