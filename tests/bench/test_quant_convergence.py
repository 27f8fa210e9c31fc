"""The preset convergence comparison (its loss-gap arithmetic, its config, its flags) and the
regression student trained with the trainer's step (against a plain Adam loop)."""
import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dropless.bench import quant_convergence as qc
from dropless.cli import bench as bench_cli
from dropless.train import step as step_lib


def test_loss_gaps_by_hand():
    # 20 steps compared (the shorter run): the final window is the last 2 of them
    runs = [{"quantization": "none", "steps": 20, "losses": [9.0] * 18 + [2.0, 2.0],
             "final_eval_loss": 1.0},
            {"quantization": "nvfp4", "steps": 21, "losses": [9.0] * 18 + [2.0, 2.2, 0.0],
             "final_eval_loss": 1.25}]
    rec = qc.loss_gaps(runs)
    assert rec["steps_compared"] == 20 and rec["final_window"] == 2
    assert rec["final"] == pytest.approx({"none": 2.0, "nvfp4": 2.1})
    assert rec["final_gap_rel"] == pytest.approx({"nvfp4": 0.05})
    assert rec["eval_gap_rel"] == pytest.approx({"nvfp4": 0.25})


def test_preset_config_changes_only_the_expert_precision(tmp_path):
    a, b = (qc.preset_config("tiny", q, steps=30, run_dir=str(tmp_path), batch=4, seq_len=32)
            for q in ("none", "nvfp4"))
    assert (a.model.moe.gmm_quantization, b.model.moe.gmm_quantization) == ("none", "nvfp4")
    assert a.model.moe.dtype == b.model.moe.dtype == "bfloat16"
    assert a.model.replace(moe=b.model.moe) == b.model
    assert a.checkpoint_every == 0 and a.eval_every == 30


def test_bad_quantizations_and_steps_are_refused():
    kind = bench_cli.KINDS["quant"]
    parser = argparse.ArgumentParser()
    kind.add_arguments(parser)
    args = parser.parse_args(["--convergence", "--preset", "tiny", "--quantizations",
                              "none,fp4"])
    with pytest.raises(ValueError, match="--quantizations: 'fp4'"):
        kind.options(args)
    with pytest.raises(ValueError, match="steps=5"):
        qc.compare_preset(steps=5)


def _plain_adam_losses(task, cfg, steps):
    """The regression student trained by a plain optax.adam loop, data drawn inside the step:
    the reference the trainer's step must reproduce bit for bit."""
    k_teacher, k_student, k_data = jax.random.split(jax.random.key(task.seed), 3)
    target_fn = qc.teacher(k_teacher, task)
    params = qc.init(k_student, cfg)
    opt = optax.adam(task.learning_rate)
    state = opt.init(params)

    def loss_fn(p, x, target):
        y, aux = qc.forward(p, x, cfg)
        mse = jnp.mean((y.astype(jnp.float32) - target) ** 2)
        return mse + aux, mse

    @jax.jit
    def step(p, s, i):
        x = jax.random.normal(jax.random.fold_in(k_data, i), (task.tokens, task.d_model))
        (_, mse), g = jax.value_and_grad(loss_fn, has_aux=True)(p, x, target_fn(x))
        upd, s = opt.update(g, s, p)
        return optax.apply_updates(p, upd), s, mse

    losses = []
    for i in range(steps):
        params, state, mse = step(params, state, jnp.int32(i))
        losses.append(mse)
    return np.asarray(jax.device_get(losses), np.float64)


@pytest.mark.parametrize("quantization", ["none", "mxfp8"])
def test_the_regression_student_trains_as_plain_adam(quantization):
    """The student trained with the trainer's step under `student_config` (constant learning
    rate, no decay, no clipping) has the losses of a plain Adam loop, bit for bit."""
    task = qc.TaskConfig(num_experts=4, top_k=2, d_model=32, d_ff=32, tokens=64,
                         teacher_hidden=32, seed=3)
    cfg = qc.moe_config(task, quantization, "auto", "bfloat16")
    got = qc.train(task, cfg, 6)
    np.testing.assert_array_equal(got, _plain_adam_losses(task, cfg, 6))
    assert got[-1] < got[0]


def test_the_student_config_is_constant_adam():
    task = qc.TaskConfig()
    tcfg = qc.student_config(task, qc.moe_config(task, "none", "auto", "bfloat16"), 50)
    lr = step_lib.lr_schedule(tcfg)
    assert {float(lr(i)) for i in range(0, 60, 7)} == {float(np.float32(task.learning_rate))}
    assert (tcfg.weight_decay, tcfg.grad_clip, tcfg.adam_b1, tcfg.adam_b2, tcfg.adam_eps) == (
        0.0, 0.0, 0.9, 0.999, 1e-8)
