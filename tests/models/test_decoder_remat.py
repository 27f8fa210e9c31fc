"""What each remat policy keeps for the backward pass, read from jax's own account of a
gradient's residuals (`jax.ad_checkpoint.print_saved_residuals`), and that keeping more changes
no gradient.

`minimal` keeps the outputs of the MoE layer's grouped matmuls (gate and up, or both at once
with fused weights, and down) by their names (`moe.SAVED_NAMES`), as MaxText's `minimal` keeps
`mlpwi_0`, `mlpwi_1`, `mlpwo`: a grouped matmul is a custom call, which the dots policy does not
see, so without the names the backward pass would run each of them again. `full` keeps none.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

from dropless import moe as moe_lib
from dropless.config import ModelConfig, MoEConfig
from dropless.models import decoder


def _cfg(backend: str, prefuse: bool = False, dtype: str = "bfloat16") -> ModelConfig:
    moe = MoEConfig(num_experts=4, top_k=2, d_model=16, d_ff=8, num_shared_experts=1,
                    score_func="sigmoid", gmm_backend=backend, prefuse_moe_weights=prefuse,
                    dtype=dtype)
    return ModelConfig(vocab_size=32, d_model=16, num_layers=2, num_heads=2, d_ff=24,
                       attention="mla", first_k_dense=1, moe=moe, kv_lora_rank=8,
                       qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6,
                       dtype=dtype, scan_layers=False)


def _params(cfg: ModelConfig):
    p = decoder.init_params(jax.random.key(0), cfg)
    return moe_lib.convert_expert_weights(p, prefuse=cfg.moe.prefuse_moe_weights)


TOKENS = (jnp.arange(12, dtype=jnp.int32).reshape(2, 6) * 7) % 32


def _loss(cfg: ModelConfig, remat: str):
    return lambda p: decoder.forward(p, TOKENS, cfg, remat=remat)[0].astype(jnp.float32).mean()


def saved_names(cfg: ModelConfig, remat: str, capsys) -> list[str]:
    """The checkpoint names among the residuals the gradient keeps, one entry per residual."""
    capsys.readouterr()
    print_saved_residuals(_loss(cfg, remat), _params(cfg))
    out = capsys.readouterr().out
    return [line.split("named '")[1].split("'")[0] for line in out.splitlines()
            if "named '" in line]


@pytest.mark.parametrize("backend", ["ragged_dot", "tiled"])
def test_minimal_keeps_the_grouped_matmul_outputs(backend, capsys):
    names = saved_names(_cfg(backend), "minimal", capsys)
    assert sorted(n for n in names if n.startswith("moe_")) == ["moe_down", "moe_gate", "moe_up"]


def test_minimal_keeps_the_fused_gate_up_output_once(capsys):
    names = saved_names(_cfg("ragged_dot", prefuse=True), "minimal", capsys)
    assert sorted(n for n in names if n.startswith("moe_")) == ["moe_down", "moe_gate_up"]


def test_full_keeps_no_grouped_matmul_output(capsys):
    assert not [n for n in saved_names(_cfg("ragged_dot"), "full", capsys)
                if n.startswith("moe_")]


def test_the_names_are_the_layers():
    assert set(moe_lib.SAVED_NAMES) == {"moe_gate", "moe_up", "moe_gate_up", "moe_down"}


@pytest.mark.parametrize("prefuse", [False, True])
def test_keeping_them_changes_no_gradient(prefuse):
    """minimal (outputs kept) and full (everything run again) give the gradients of none (in
    float32: XLA fuses each program differently, so bfloat16 roundings would differ)."""
    cfg = _cfg("ragged_dot", prefuse, "float32")
    p = _params(cfg)
    g = {r: jax.jit(jax.grad(_loss(cfg, r)))(p) for r in ("none", "minimal", "full")}
    for r in ("minimal", "full"):
        for a, b in zip(jax.tree_util.tree_leaves(g["none"]), jax.tree_util.tree_leaves(g[r])):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
