"""`decoder.compute_weights`: the blocks' matmul weights cast to the compute dtype once, before
the (rematerialised) blocks run, against the same model with every weight cast where it is used
(the reference: `compute_weights` replaced by the identity). Loss, logits and every gradient must
be equal bit for bit (each weight is cast once per block either way), and the backward pass must
no longer cast a weight a second time.
"""
from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless import moe as moe_lib
from dropless.config import ModelConfig, MoEConfig
from dropless.models import decoder

from tests._support.jaxpr_walk import traced


def _cfg(attention: str = "mla", *, scan: bool = False, prefuse: bool = False, mtp: int = 0,
         tie: bool = False, dtype: str = "bfloat16", moe_dtype: str | None = None,
         layers: int = 3) -> ModelConfig:
    """A dense first layer, then MoE layers: unrolled, one MoE layer is every kind of weight and
    cast once (`layers=2`, a compile less of the same code); scanned, the default 3 runs two MoE
    layers through the scan's stacked weights."""
    moe = MoEConfig(num_experts=4, top_k=2, d_model=16, d_ff=8, num_shared_experts=1,
                    score_func="sigmoid", gmm_backend="tiled", prefuse_moe_weights=prefuse,
                    dtype=moe_dtype or dtype)
    kw = (dict(kv_lora_rank=8, q_lora_rank=12, qk_nope_head_dim=4, qk_rope_head_dim=4,
               v_head_dim=6) if attention == "mla"
          else dict(num_kv_heads=1, head_dim=8, qk_norm=True))
    return ModelConfig(vocab_size=32, d_model=16, num_layers=layers, num_heads=2, d_ff=24,
                       attention=attention, first_k_dense=1, moe=moe, dtype=dtype,
                       scan_layers=scan, mtp_depth=mtp, tie_embeddings=tie, **kw)


def _params(cfg: ModelConfig):
    p = decoder.init_params(jax.random.key(0), cfg)
    return moe_lib.convert_expert_weights(p, prefuse=cfg.moe.prefuse_moe_weights)


TOKENS = (jnp.arange(16, dtype=jnp.int32).reshape(2, 8) * 7) % 32


def _loss(cfg: ModelConfig, remat: str):
    def loss(p):
        logits, h, aux = decoder.forward(p, TOKENS, cfg, remat=remat)
        total = logits.astype(jnp.float32).mean() + aux["moe_loss"]
        if cfg.mtp_depth:
            mtp, _ = decoder.mtp_logits(p, h, TOKENS, cfg, remat=remat)
            total = total + sum(m.astype(jnp.float32).mean() for m in mtp)
        return total
    return loss


def _value_and_grad(cfg: ModelConfig, remat: str):
    return jax.jit(jax.value_and_grad(_loss(cfg, remat)))(_params(cfg))


CASES = [
    pytest.param(_cfg(layers=2), "minimal", id="mla-unrolled-minimal"),
    pytest.param(_cfg(scan=True), "minimal", id="mla-scanned-minimal"),
    pytest.param(_cfg(scan=True, prefuse=True), "full", id="mla-scanned-prefused-full"),
    pytest.param(_cfg(mtp=1, tie=True, layers=2), "none", id="mla-mtp-tied-none"),
    pytest.param(_cfg("mha", layers=2), "minimal", id="gqa-qknorm-minimal"),
    pytest.param(_cfg("mha", scan=True, moe_dtype="float32"), "full", id="gqa-moe-f32-full"),
]


@pytest.mark.parametrize("cfg,remat", CASES)
def test_same_loss_and_gradients_bit_for_bit(cfg, remat, monkeypatch):
    loss, grads = _value_and_grad(cfg, remat)
    monkeypatch.setattr(decoder, "compute_weights", lambda blocks, cfg: blocks)
    ref_loss, ref_grads = _value_and_grad(cfg, remat)
    assert np.asarray(loss) == np.asarray(ref_loss)
    flat, ref_flat = jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)
    assert len(flat) == len(ref_flat)
    for (path, g), r in zip(flat, ref_flat):
        assert g.dtype == r.dtype, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(g), np.asarray(r),
                                      err_msg=jax.tree_util.keystr(path))


def _dtypes(tree) -> dict[str, str]:
    return {jax.tree_util.keystr(p): str(x.dtype)
            for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def test_which_leaves_are_cast():
    cfg = _cfg()
    got = _dtypes(decoder.compute_weights(_params(cfg)["layers"], cfg))
    moe = {k: v for k, v in got.items() if "[1]" in k and "moe" in k}
    assert moe == {"[1]['moe']['experts']['w_down_EFD']": "bfloat16",
                   "[1]['moe']['experts']['w_gate_EDF']": "bfloat16",
                   "[1]['moe']['experts']['w_up_EDF']": "bfloat16",
                   "[1]['moe']['router']['bias_E']": "float32",
                   "[1]['moe']['router']['w_DE']": "float32",
                   "[1]['moe']['shared']['w_down_FD']": "bfloat16",
                   "[1]['moe']['shared']['w_gate_DF']": "bfloat16",
                   "[1]['moe']['shared']['w_up_DF']": "bfloat16"}
    for k, v in got.items():
        norm = k.endswith(("_norm_D']", "_norm_L']", "_norm_Q']"))
        assert v == ("float32" if norm or "router" in k else "bfloat16"), k


def test_moe_weights_follow_the_moe_dtype():
    cfg = _cfg(moe_dtype="float32")
    got = _dtypes(decoder.compute_weights(_params(cfg)["layers"][1], cfg))
    assert got["['moe']['experts']['w_gate_EDF']"] == "float32"
    assert got["['moe']['shared']['w_up_DF']"] == "float32"
    assert got["['attn']['wkv_a_DL']"] == "bfloat16"


def test_float32_compute_changes_nothing():
    cfg = _cfg(dtype="float32")
    layers = _params(cfg)["layers"]
    out = decoder.compute_weights(layers, cfg)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(layers)):
        assert a is b


def _weight_casts(cfg: ModelConfig, remat: str) -> int:
    """convert_element_type equations in the gradient's jaxpr (nested ones included) that take a
    float32 array of the expert weights' shape to bfloat16."""
    shape = (cfg.moe.num_experts, cfg.moe.d_model, cfg.moe.d_ff)
    return sum(eqn.primitive.name == "convert_element_type"
               and eqn.invars[0].aval.shape[-3:] == shape
               and eqn.invars[0].aval.dtype == jnp.float32
               and eqn.outvars[0].aval.dtype == jnp.bfloat16
               for eqn in traced(jax.grad(_loss(cfg, remat)), _params(cfg)))


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
@pytest.mark.parametrize("remat", ["minimal", "full"])
def test_the_backward_pass_casts_no_weight_again(scan, remat, monkeypatch):
    cfg = _cfg(scan=scan, layers=2)   # one MoE layer
    assert _weight_casts(cfg, remat) == 2            # gate and up: [E, D, F]; once each
    monkeypatch.setattr(decoder, "compute_weights", lambda blocks, cfg: blocks)
    assert _weight_casts(cfg, remat) == 4            # and again in the rematerialised pass


def test_only_one_device_casts_once():
    """Across devices the cast's gradient would be reduced in bfloat16 (the GPU-leg
    tests/train/test_step_accumulation_gpu_compile.py checks the float32 all-reduce)."""
    from jax.sharding import Mesh
    from dropless.parallel.mesh import NodeMesh
    one = Mesh(np.array(jax.devices()[:1]), ("data",))
    assert decoder.casts_weights_once(None) and decoder.casts_weights_once(one)
    assert decoder.casts_weights_once(NodeMesh(one))
    if jax.device_count() >= 4:
        four = Mesh(np.array(jax.devices()[:4]), ("data",))
        assert not decoder.casts_weights_once(four)
        assert not decoder.casts_weights_once(NodeMesh(four))
