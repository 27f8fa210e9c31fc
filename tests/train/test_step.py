"""The step's view of a batch: under packing="stream" (and for a [B, S + 1] windows array) the
plain causal row of the runs made before packing, bit for bit; under "documents" / "pad" the
batch's segment ids, positions and loss mask."""
import functools

import jax
import numpy as np
import pytest

from dropless.config import ModelConfig, TrainConfig
from dropless.data.batch import Batch, from_windows
from dropless.models import decoder
from dropless.train import step

MODEL = ModelConfig(vocab_size=32, d_model=16, num_layers=1, num_heads=2, d_ff=24,
                    attention="mha", num_kv_heads=1, head_dim=4, mtp_depth=1)


def _packed() -> Batch:
    seg = np.int32([[1, 1, 1, 2, 2, 0]])
    return Batch(np.int32([[3, 4, 5, 6, 7, 0]]), np.int32([[4, 5, 9, 7, 8, 0]]), seg,
                 np.int32([[0, 1, 2, 0, 1, 0]]), np.float32([[1, 1, 0, 1, 1, 0]]))


def test_stream_reads_neither_segments_nor_positions():
    cfg = TrainConfig(model=MODEL, packing="stream")
    x = step.step_inputs(_packed(), cfg)
    assert x.segment_ids_BS is None and x.positions_BS is None and x.loss_mask_BS is None
    with pytest.raises(ValueError, match="packing='stream' cannot hold SFT"):
        cfg.replace(sft=True)
    for packing in ("documents", "pad"):
        x = step.step_inputs(_packed(), cfg.replace(packing=packing))
        assert x.segment_ids_BS is not None and x.positions_BS is not None
        assert x.loss_mask_BS is not None
    w = np.arange(2 * 7, dtype=np.int32).reshape(2, 7)
    x = step.step_inputs(w, cfg.replace(packing="documents"))
    np.testing.assert_array_equal(x.tokens_BS, w[:, :-1])
    np.testing.assert_array_equal(x.targets_BS, w[:, 1:])
    assert x.segment_ids_BS is None and x.loss_mask_BS is None
    with pytest.raises(ValueError, match="data.batch.Batch"):
        step.step_inputs(np.zeros(3, np.int32), cfg)


def test_mtp_mask_stays_inside_each_document():
    """Depth 1 at position i counts target i + 1 when it is counted and of i's segment."""
    x = step.step_inputs(_packed(), TrainConfig(model=MODEL))
    # targets counted [1 1 0 1 1 0]; segments [1 1 1 2 2 0]
    # i=0: t1 counted, same seg -> 1; i=1: t2 not counted -> 0; i=2: next is seg 2 -> 0;
    # i=3: t4 counted, same seg -> 1; i=4: next is padding -> 0; i=5: past the row -> 0
    np.testing.assert_array_equal(step.mtp_mask(x, 1), [[1, 0, 0, 1, 0, 0]])
    np.testing.assert_array_equal(step.mtp_mask(x, 2), [[0, 0, 0, 0, 0, 0]])


def test_stream_batch_is_bitwise_the_windows_step():
    """The loop hands the step `from_windows` batches: under "stream" the loss and every
    gradient are those of the [B, S + 1] windows the step took before, bit for bit."""
    model = MODEL.replace(mtp_depth=0)   # the MTP masks are the same code under "stream"
    cfg = TrainConfig(model=model, packing="stream")
    params = decoder.init_params(jax.random.key(0), model)
    w = np.asarray(jax.random.randint(jax.random.key(1), (2, 9), 0, 32), np.int32)
    fn = jax.jit(jax.value_and_grad(functools.partial(step.loss_fn, cfg=cfg), has_aux=True))
    (l1, m1), g1 = fn(params, w)
    (l2, m2), g2 = fn(params, from_windows(w))
    assert np.asarray(l1).tobytes() == np.asarray(l2).tobytes()
    assert m1["ce_loss"] == m2["ce_loss"]
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("mtp_depth", [1, 0])
def test_a_decoder_of_dense_layers_only_trains(mtp_depth):
    """first_k_dense = num_layers: no MoE layer in the decoder (a MoE config all the same). With
    MTP its block's MoE layer is the model's only one and its router bias moves by the
    aux-free rule from that block's own loads (bias + speed * sign(mean load - load),
    recomputed here in NumPy); without MTP no expert metric exists and nothing else moves."""
    from dropless.presets import get_preset
    base = get_preset("deepseek3-test")
    model = base.replace(first_k_dense=base.num_layers, mtp_depth=mtp_depth)
    cfg = TrainConfig(model=model, per_device_batch_size=2, seq_len=16)
    state, opt = step.init_state(cfg)
    assert not any("moe" in blk for blk in state["params"]["layers"])
    w = np.asarray(jax.random.randint(jax.random.key(1), (2, 17), 0, model.vocab_size), np.int32)
    new, m = jax.jit(functools.partial(step.train_step, cfg=cfg, opt=opt))(state, w)
    assert np.isfinite(float(m["loss"])) and "tokens_per_expert_LE" not in m
    assert float(m["moe_loss"]) == 0
    if mtp_depth == 0:
        assert not any(k.startswith("mtp_") for k in m)
        return
    # the objective is the recorded terms: the MTP block's balance loss is its own metric
    assert float(m["mtp_moe_loss"]) > 0
    np.testing.assert_allclose(float(m["loss"]), float(
        m["ce_loss"] + model.mtp_loss_coef * m["mtp_loss"] + m["mtp_moe_loss"]), rtol=1e-6)
    load = np.asarray(m["mtp_tokens_per_expert_LE"], np.float64)
    assert load.shape == (1, model.moe.num_experts)
    assert load.sum() == 2 * 16 * model.moe.top_k   # every position's top-k choices, none dropped
    old = np.asarray(state["params"]["mtp"][0]["block"]["moe"]["router"]["bias_E"])
    got = np.asarray(new["params"]["mtp"][0]["block"]["moe"]["router"]["bias_E"])
    speed = model.moe.bias_update_speed
    np.testing.assert_allclose(got, old + speed * np.sign(load[0].mean() - load[0]), rtol=1e-6)
    assert not np.array_equal(got, old)
