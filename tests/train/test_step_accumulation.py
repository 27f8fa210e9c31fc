"""Gradient accumulation (`gradient_accumulation_steps` k): a step over k micro-batches is the
step over the whole batch in one pass (the reference): the cross-entropy and MTP terms, their
gradients, the expert loads and the router-bias update, with packed documents whose counted
targets differ between micro-batches; the balance losses are each micro-batch's own, averaged
(MaxText's rule, src/maxtext/utils/gradient_accumulation.py at e591f30). On a mesh of 4 host
devices the same. The eval loss reads a batch in the same micro-batches, giving the one-pass
number. Through the loop: the global batch is k times the micro-batch, the header and the tokens
a step say so. Bad values are refused in one
line. The trajectory against transformers with accumulation is in test_step_trajectory.py."""
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dropless.cli.main import main
from dropless.config import TrainConfig
from dropless.config_file import build_config
from dropless.data.batch import Batch
from dropless.parallel.mesh import batch_sharding, train_mesh
from dropless.parallel.sharding import state_shardings
from dropless.train import step
from dropless.train.loop import train

from tests._support.train_mini import STEP_KEYS, mini

KEYS = STEP_KEYS   # the train step: an MLA model, a dense and an MoE layer, MTP 1


def config(**kw) -> TrainConfig:
    return build_config(list({**KEYS, **kw}.items()))


def packed_batch(rows: int, seq: int, seed: int = 0) -> Batch:
    """Rows of 1-3 documents each, a padded tail and an uneven loss mask: micro-batches count
    different numbers of targets."""
    rng = np.random.default_rng(seed)
    seg = np.zeros((rows, seq), np.int32)
    pos = np.zeros((rows, seq), np.int32)
    for r in range(rows):
        cuts = np.sort(rng.choice(np.arange(1, seq - 1), size=r % 3, replace=False))
        end = seq - (r % 4)                     # 0-3 padding positions
        bounds = [0, *[c for c in cuts if c < end], end]
        for d, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]), start=1):
            seg[r, a:b], pos[r, a:b] = d, np.arange(b - a)
    tokens = rng.integers(0, 200, (rows, seq), dtype=np.int32)
    targets = rng.integers(0, 200, (rows, seq), dtype=np.int32)
    mask = ((seg > 0) & (rng.random((rows, seq)) > 0.3 * (np.arange(rows)[:, None] % 2)))
    return Batch(tokens, targets, seg, pos, mask.astype(np.float32))


@functools.lru_cache(maxsize=None)
def params_of(model):
    return jax.device_get(step.init_state(config().replace(model=model))[0]["params"])


def grads_of(cfg: TrainConfig, batch, mesh=None):
    """(metrics, gradients) of `step.loss_and_grads` at the model's initial parameters."""
    params = params_of(cfg.model)
    if mesh is not None:
        params = jax.device_put(params, state_shardings({"params": params}, mesh)["params"])
        batch = jax.device_put(batch, batch_sharding(mesh))
    return jax.device_get(jax.jit(functools.partial(step.loss_and_grads, cfg=cfg, mesh=mesh))(
        params, batch))


def close(a, b, rtol=1e-5):
    """Every leaf within rtol of its largest entry: float32 gradients summed over the
    micro-batches add the same terms in another order, and how far that moves a sum depends on
    the CPU's vector width (2.05e-6 of the largest entry seen on an AMD EPYC, under 2e-6 on a
    Xeon); a lost or doubled micro-batch moves it by tens of percent."""
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        scale = max(float(np.max(np.abs(y))), 1e-30)
        assert float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) <= rtol * scale


def test_micro_batches_interleave_rows():
    b = packed_batch(6, 5)
    micro = step.micro_batches(b, 3)
    for m in range(3):
        for got, whole in zip(micro, b):
            np.testing.assert_array_equal(got[m], whole[m::3])
    with pytest.raises(ValueError, match="gradient_accumulation_steps=4 does not divide the "
                                         "batch's 6 rows"):
        step.micro_batches(b, 4)


# balance losses off, the router-bias update on: every term is the whole batch's
WHOLE = {"model.moe.seq_aux_coef": 0.0, "model.moe.load_balance_coef": 0.0,
         "model.moe.z_loss_coef": 0.0, "model.moe.bias_update_speed": 0.01}


@functools.lru_cache(maxsize=None)
def one_pass():
    """The reference: the 8-row batch's metrics and gradients in one pass."""
    return grads_of(config(**WHOLE, per_device_batch_size=8), packed_batch(8, 12))


@functools.lru_cache(maxsize=None)
def one_pass_eval(model):
    """The reference eval loss: the 8-row batch in one pass at `model`'s initial parameters
    (the same for every k: compiled once)."""
    return jax.device_get(jax.jit(functools.partial(
        step.eval_loss, cfg=config(**WHOLE, per_device_batch_size=8)))(
            params_of(model), packed_batch(8, 12)))


@pytest.mark.parametrize("k", [2, 4])
def test_accumulated_step_is_the_whole_batch_step(k):
    batch = packed_batch(8, 12)
    m1, g1 = one_pass()
    cfgk = config(**WHOLE, per_device_batch_size=8 // k, gradient_accumulation_steps=k)
    mk, gk = grads_of(cfgk, batch)
    assert set(mk) == set(m1)
    for key in ("loss", "ce_loss", "mtp_loss"):
        np.testing.assert_allclose(mk[key], m1[key], rtol=2e-6, err_msg=key)
    for key in ("tokens_per_expert_LE", "mtp_tokens_per_expert_LE", "dropped_tokens"):
        np.testing.assert_array_equal(mk[key], m1[key], err_msg=key)
    close(gk, g1)
    # the eval loss reads the batch in the same micro-batches: the one-pass number
    params = params_of(cfgk.model)
    np.testing.assert_allclose(
        jax.jit(functools.partial(step.eval_loss, cfg=cfgk))(params, batch),
        one_pass_eval(cfgk.model), rtol=2e-6)


def test_the_step_moves_router_biases_by_the_whole_batchs_loads():
    """train_step with 2 micro-batches: the biases move by the summed loads, bit for bit the
    one-pass update; the gradient norm is the one-pass gradients'; one step is counted."""
    m1, g1 = one_pass()
    cfg1 = config(**WHOLE, per_device_batch_size=8)
    cfg = config(**WHOLE, per_device_batch_size=4, gradient_accumulation_steps=2)
    state, opt = step.init_state(cfg)
    batch = packed_batch(8, 12)
    new, m = jax.device_get(jax.jit(functools.partial(step.train_step, cfg=cfg, opt=opt))(
        state, batch))
    # the step's real tokens: the whole batch's positions that are not padding
    assert int(m["real_tokens"]) == int((batch.segment_ids_BS > 0).sum()) < 8 * 12
    want = step._update_biases(state["params"], m1, cfg1)

    def biases(params):
        return [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(params)
                if getattr(path[-1], "key", None) == "bias_E"]
    assert biases(want) and len(biases(want)) == len(biases(new["params"]))
    for got, ref, old in zip(biases(new["params"]), biases(want), biases(state["params"])):
        np.testing.assert_array_equal(got, ref)
        assert not np.array_equal(got, old)
    np.testing.assert_allclose(m["grad_norm"], optax.tree.norm(g1), rtol=2e-6)
    assert int(new["step"]) == 1


def test_balance_losses_are_each_micro_batchs_own_averaged():
    """With the balance losses on, the CE terms are still the whole batch's and `moe_loss` is
    the mean of what each micro-batch alone gives (rows m, m + 2, ...)."""
    keys = {"model.moe.seq_aux_coef": 0.01, "model.moe.load_balance_coef": 0.01}
    batch = packed_batch(4, 12, seed=3)
    cfg1, cfg2 = config(**keys), config(**keys, per_device_batch_size=2,
                                        gradient_accumulation_steps=2)
    m1, _ = grads_of(cfg1, batch)
    m2, _ = grads_of(cfg2, batch)
    np.testing.assert_allclose(m2["ce_loss"], m1["ce_loss"], rtol=2e-6)
    np.testing.assert_allclose(m2["mtp_loss"], m1["mtp_loss"], rtol=2e-6)
    loss = jax.jit(functools.partial(step.loss_fn, cfg=cfg1))
    alone = [jax.device_get(loss(params_of(cfg1.model),
                                 jax.tree.map(lambda a, m=m: a[m::2], batch))[1])
             for m in range(2)]
    for key in ("moe_loss", "mtp_moe_loss", "seq_aux_loss", "load_balance_loss"):
        np.testing.assert_allclose(m2[key], (alone[0][key] + alone[1][key]) / 2, rtol=2e-6,
                                   err_msg=key)
    assert float(m2["moe_loss"]) > 0 and float(m2["mtp_moe_loss"]) > 0
    for m in (m1, m2, *alone):   # the recorded terms add up to the objective
        np.testing.assert_allclose(
            m["loss"], m["ce_loss"] + m["moe_loss"] + cfg1.model.mtp_loss_coef * m["mtp_loss"]
            + m["mtp_moe_loss"], rtol=2e-6)


def test_on_a_mesh_the_accumulated_step_is_the_whole_batch_step():
    """4 host devices (data 2 x expert 2): each device's rows stay on it, same numbers."""
    keys = {"model.moe.seq_aux_coef": 0.0, "mesh.data": 2, "mesh.expert": 2,
            "model.moe.gmm_backend": "auto"}
    batch = packed_batch(8, 12, seed=1)
    cfg1 = config(**keys, per_device_batch_size=2)
    cfg2 = config(**keys, per_device_batch_size=1, gradient_accumulation_steps=2)
    assert (cfg1.global_batch_size, cfg2.global_batch_size, cfg2.micro_batch_size) == (8, 8, 4)
    m1, g1 = grads_of(cfg1, batch, train_mesh(cfg1.mesh))
    m2, g2 = grads_of(cfg2, batch, train_mesh(cfg2.mesh))
    np.testing.assert_allclose(m2["loss"], m1["loss"], rtol=2e-6)
    np.testing.assert_array_equal(m2["tokens_per_expert_LE"], m1["tokens_per_expert_LE"])
    close(g2, g1)


def test_the_loop_trains_the_global_batch(tmp_path):
    lines = []
    cfg = mini(tmp_path, steps=2, per_device_batch_size=2, gradient_accumulation_steps=2,
               run_name="acc", checkpoint_every=0, eval_every=2)
    assert (cfg.global_batch_size, cfg.micro_batch_size) == (4, 2)
    res = train(cfg, echo=lines.append)
    assert "batch 4 x 32 (2 micro-batches of 2)" in "\n".join(lines)
    recs = [json.loads(x) for x in (res.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if r["event"] == "step"]
    assert len(steps) == 2 and all(np.isfinite(r["loss"]) for r in steps)
    fpt = recs[0]["flops_per_token"]["model"]
    for r in steps:   # the step's tokens and FLOPs: the global batch's (no padding here)
        assert r["tokens_per_s"] * r["step_time_s"] == pytest.approx(4 * 32, rel=1e-9)
        assert r["padded_tokens_per_s"] * r["step_time_s"] == pytest.approx(4 * 32, rel=1e-9)
        assert r["tflops_per_device"] * 1e12 * r["step_time_s"] * cfg.num_devices == (
            pytest.approx(4 * 32 * fpt, rel=1e-9))


@pytest.mark.parametrize("value", ["0", "-1", "x"])
def test_bad_values_are_refused_in_one_line(value, capsys):
    code = main(["train", "--preset", "tiny", f"gradient_accumulation_steps={value}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "gradient_accumulation_steps" in err[0], err
