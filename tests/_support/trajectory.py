"""The training-trajectory fixtures (tests/fixtures/hf/trajectory/<family>/): their models and
optimizer settings, written once here and read by both halves that use them.

Each family's folder holds what `dropless.hf.save` wrote for a seeded model (config.json and
the safetensors of the initial weights), `batches.npy` ([steps, B, S + 1] int32 token
windows, one per step), `setup.json` (the optimizer settings: the trainer's TrainConfig fields)
and `trajectory.json`, written by `tools/make_hf_fixtures.py --trajectory` with transformers +
`torch.optim.AdamW`: per transformers version, the lr, loss, pre-clip gradient norm and whether
the step clipped, for every step. tests/train/test_trajectory.py trains the same in dropless.

Write the dropless half (weights, batches, setup) with

    PYTHONPATH=src python -m tests._support.trajectory

then the torch half with the transformers venvs (tools/make_hf_fixtures.py's docstring).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dropless.config import ModelConfig, MoEConfig
from tests._support.paths import HF_FIXTURES

ROOT = HF_FIXTURES / "trajectory"
STEPS, BATCH, SEQ = 30, 4, 16
VOCAB = 64

# (a) DeepSeek-V3: MLA with a low-rank q, a dense layer then an MoE layer with group-limited
# sigmoid routing (4 groups, 2 kept), a shared expert and routed scaling. (b) Qwen3-MoE: GQA
# with per-head q/k norms, softmax routing without top-k renormalisation, a dense layer first.
MODELS = {
    "deepseek_v3": ModelConfig(
        vocab_size=VOCAB, d_model=32, num_layers=2, num_heads=4, d_ff=48, attention="mla",
        first_k_dense=1, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=12, norm_eps=1e-5,
        moe=MoEConfig(num_experts=8, top_k=2, d_model=32, d_ff=16, num_shared_experts=1,
                      score_func="sigmoid", routed_scaling_factor=2.5, n_groups=4,
                      topk_groups=2, bias_update_speed=0.0)),
    "qwen3_moe": ModelConfig(
        vocab_size=VOCAB, d_model=32, num_layers=2, num_heads=4, d_ff=40, attention="mha",
        num_kv_heads=2, head_dim=12, qk_norm=True, layer_pattern="DM", rope_theta=1e6,
        norm_eps=1e-6,
        moe=MoEConfig(num_experts=8, top_k=2, d_model=32, d_ff=16, score_func="softmax",
                      norm_topk_prob=False)),
}
# the trainer's optimizer keys (TrainConfig fields); grad_clip sits inside the range of the
# family's gradient norms, so some steps clip and some do not (trajectory.json records which)
OPTIMIZER = {"steps": STEPS, "learning_rate": 3e-3, "warmup_steps": 5, "min_lr_ratio": 0.1,
             "weight_decay": 0.1, "adam_b1": 0.9, "adam_b2": 0.95, "adam_eps": 1e-8}
SETUP = {"deepseek_v3": {**OPTIMIZER, "grad_clip": 0.85},
         "qwen3_moe": {**OPTIMIZER, "grad_clip": 0.8}}
SEEDS = {"deepseek_v3": 0, "qwen3_moe": 1}


def folder(family: str) -> Path:
    return ROOT / family


def batches(seed: int) -> np.ndarray:
    """[STEPS, BATCH, SEQ + 1] int32 windows of a random Markov chain over VOCAB tokens (each
    token has 4 likely successors), so there is something to learn."""
    rs = np.random.RandomState(seed)
    succ = rs.randint(0, VOCAB, size=(VOCAB, 4))
    out = np.empty((STEPS, BATCH, SEQ + 1), np.int32)
    out[:, :, 0] = rs.randint(0, VOCAB, size=(STEPS, BATCH))
    for i in range(1, SEQ + 1):
        pick = succ[out[:, :, i - 1], rs.randint(0, 4, size=(STEPS, BATCH))]
        noise = rs.randint(0, VOCAB, size=(STEPS, BATCH))
        out[:, :, i] = np.where(rs.rand(STEPS, BATCH) < 0.1, noise, pick)
    return out


def initial_params(family: str):
    """The seeded model of `family`: dropless's init, with norm weights around 1 (not 1, so a
    misplaced norm shows) and, for sigmoid routing, a random routing bias (the experts' choice
    depends on it)."""
    from dropless.models import decoder
    cfg = MODELS[family]
    key = jax.random.PRNGKey(SEEDS[family])
    params = decoder.init_params(key, cfg)
    leaves, tree = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(jax.random.fold_in(key, 1), len(leaves))
    out = []
    for k, (path, x) in zip(keys, leaves):
        last = getattr(path[-1], "key", "")
        if last == "bias_E":
            x = 0.05 * jax.random.uniform(k, x.shape) if cfg.moe.score_func == "sigmoid" else x
        elif x.ndim == 1:
            x = 1 + 0.2 * jax.random.normal(k, x.shape)
        out.append(jnp.asarray(x, x.dtype))
    return jax.tree_util.tree_unflatten(tree, out)


def write(family: str) -> Path:
    """The dropless half of `family`'s fixture: hf.save of the seeded model, the batches and
    setup.json (trajectory.json, the torch half's, is kept)."""
    from dropless import hf
    d = folder(family)
    keep = (d / "trajectory.json").read_bytes() if (d / "trajectory.json").is_file() else None
    shutil.rmtree(d, ignore_errors=True)
    hf.save(MODELS[family], initial_params(family), d)
    np.save(d / "batches.npy", batches(SEEDS[family]))
    (d / "setup.json").write_text(json.dumps(SETUP[family], indent=1) + "\n")
    if keep is not None:
        (d / "trajectory.json").write_bytes(keep)
    return d


def train_config(family: str, **changes):
    """The trainer's TrainConfig for `family`: init_from=hf:<its folder>, setup.json's
    optimizer, the router bias never updated (transformers does not update it); `changes`
    (dotted keys) override."""
    from dropless.config_file import build_config
    d = folder(family)
    items = {"init_from": f"hf:{d}", "tokenizer": "byte", "per_device_batch_size": BATCH,
             "seq_len": SEQ, "model.moe.bias_update_speed": 0.0,
             **json.loads((d / "setup.json").read_text()), **changes}
    return build_config(list(items.items()))


if __name__ == "__main__":
    for name in MODELS:
        print(write(name))
