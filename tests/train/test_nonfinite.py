"""check_nan=true: the first non-finite loss, gradient or parameter stops the run at that step,
names where it first appeared, and leaves the last good step checkpointed and resumable."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dropless import cli
from dropless.config_file import build_config
from dropless.models.decoder import init_params
from dropless.checkpoint import latest_step
from dropless.train.nonfinite import NonFiniteGuard, _backward_order, locate, nonfinite_leaves

from tests._support.train_mini import MINI, corpus, mini, shared_compilation_cache


@pytest.fixture(scope="module", autouse=True)
def compilation_cache(tmp_path_factory):
    yield from shared_compilation_cache(tmp_path_factory)


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    return mini(tmp_path_factory.mktemp("cfg"), check_nan=True)


@pytest.fixture(scope="module")
def params(cfg):
    """Drawn op by op from init_state's key, as the trainer does: the CLI runs below reuse these
    small compiles, where a jitted init_params is one more compile of seconds."""
    return init_params(jax.random.split(jax.random.PRNGKey(cfg.seed))[0], cfg.model)


def _batch(cfg):
    return jnp.asarray(np.arange(cfg.global_batch_size * (cfg.seq_len + 1)).reshape(
        cfg.global_batch_size, cfg.seq_len + 1) % cfg.model.vocab_size, jnp.int32)


def test_guard_returns_the_input_state_when_anything_is_not_finite(cfg):
    guard = NonFiniteGuard(cfg)
    state = {"params": {"w": jnp.ones(3)}, "step": jnp.array(4)}

    def step(loss, grad_norm, w):
        return lambda s, b: ({"params": {"w": w}, "step": s["step"] + 1},
                             {"loss": jnp.float32(loss), "grad_norm": jnp.float32(grad_norm)})
    cases = [(1.0, 1.0, jnp.full(3, 2.0), False), (np.nan, 1.0, jnp.full(3, 2.0), True),
             (1.0, np.inf, jnp.full(3, 2.0), True),
             (1.0, 1.0, jnp.array([2.0, np.inf, 2.0]), True)]
    for loss, gn, w, bad in cases:
        new, m = jax.jit(guard.wrap(step(loss, gn, w)))(state, None)
        assert int(m["nonfinite"]) == bad
        np.testing.assert_array_equal(new["params"]["w"], state["params"]["w"] if bad else w)
        assert int(new["step"]) == (4 if bad else 5)
    off = NonFiniteGuard(cfg.replace(check_nan=False))
    assert off.wrap(step) is step


def test_parameters_already_non_finite_are_named(cfg, params):
    params = jax.tree.map(lambda x: x, params)
    params["layers"][1]["moe"]["experts"]["w_up_EDF"] = \
        params["layers"][1]["moe"]["experts"]["w_up_EDF"].at[2, 0, :3].set(jnp.nan)
    assert nonfinite_leaves(params) == [("layers/1/moe/experts/w_up_EDF", 3)]
    where = locate(params, None, _batch(cfg), cfg=cfg, opt=None)
    assert where == ("parameters were already non-finite before the step: "
                     "layers/1/moe/experts/w_up_EDF (3 values)")


def test_the_backward_pass_meets_the_deepest_parameter_first():
    names = ["embed/w_VD", "layers/0/attn/w_q", "layers/10/ffn/w_up", "final_norm/w_D",
             "layers/2/moe/router/w_DE", "mtp/0/proj_2DD", "mtp/1/proj_2DD"]
    assert sorted(names, key=_backward_order) == [
        "mtp/1/proj_2DD", "mtp/0/proj_2DD", "final_norm/w_D", "layers/10/ffn/w_up",
        "layers/2/moe/router/w_DE", "layers/0/attn/w_q", "embed/w_VD"]


@pytest.mark.parametrize("accumulate", [1, 2])
def test_an_update_that_overflows_is_named_with_the_learning_rate(cfg, params, accumulate):
    opt = optax.sgd(1e39)     # finite loss and gradients; params - 1e39 * grad is not finite
    # weight_decay=0: the config refuses learning_rate x weight_decay >= 1 (the decay would
    # zero the weights), and the point here is the update's overflow
    cfg = cfg.replace(learning_rate=1e39, weight_decay=0.0,
                      gradient_accumulation_steps=accumulate)
    where = locate(params, opt.init(params), _batch(cfg), cfg=cfg, opt=opt)
    assert where.startswith("loss and gradients finite; the optimizer update made ")
    assert "(learning_rate=1e+39)" in where and "layers/" in where


def test_config_rejects_a_non_boolean():
    with pytest.raises(ValueError, match="config key 'check_nan': 'yes' must be true or false"):
        build_config([("check_nan", "yes")])


@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_cli_stops_at_the_bad_step_and_names_the_layer(tmp_path, capsys, accumulate):
    """learning_rate=1e18: step 1 is finite, its update makes step 2's activations overflow in
    the first attention block. The run stops there with one line and exit 1, step 2 is neither
    applied nor recorded, and step 1 is checkpointed. With gradient accumulation the search
    runs micro-batch by micro-batch and names the first bad one. weight_decay=0: the config
    refuses learning_rate x weight_decay >= 1, and the point here is the guard."""
    items = dict(MINI, data=str(corpus(tmp_path)), run_dir=str(tmp_path / "runs"),
                 run_name="r", steps=3, warmup_steps=0, eval_every=100, checkpoint_every=100,
                 time_kernels=False, check_nan="true", learning_rate="1e18", weight_decay=0,
                 per_device_batch_size=MINI["per_device_batch_size"] // accumulate,
                 gradient_accumulation_steps=accumulate)
    assert cli.main(["train"] + [f"{k}={v}" for k, v in items.items()]) == 1
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("dropless: error")]
    assert len(err) == 1, err
    assert err[0].startswith("dropless: error: step 2: loss nan")
    where = "" if accumulate == 1 else " (micro-batch 1 of 2)"
    assert (f"first non-finite value in the forward pass{where}: layer 0, attention "
            "(layers/0/attn)") in err[0]
    assert "step 2" in err[0] and "step 1, the last with finite values, is checkpointed" in err[0]
    run = tmp_path / "runs" / "r"
    assert latest_step(run / "checkpoints") == 1
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if r["event"] == "step"] == [1]


def test_a_new_run_refused_at_its_first_step_leaves_no_run(tmp_path, capsys):
    """Weights of std 1e30: step 1's gradients are not finite, so no step is ever applied. The
    run was counted as started before the guard refused the step: it left a run directory
    with no checkpoint that `--resume` refuses. Now nothing stays, as for any run that fails
    before its first step."""
    # the settings of the test above (its compiles are cached), with weights that overflow
    items = dict(MINI, data=str(corpus(tmp_path)), run_dir=str(tmp_path / "runs"),
                 run_name="r", steps=3, warmup_steps=0, eval_every=100, checkpoint_every=100,
                 time_kernels=False, check_nan="true", learning_rate="1e18", weight_decay=0,
                 **{"model.init": "normal", "model.init_std": "1e30"})
    assert cli.main(["train"] + [f"{k}={v}" for k, v in items.items()]) == 1
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("dropless: error")]
    assert len(err) == 1 and err[0].startswith("dropless: error: step 1: "), err
    assert "nothing is checkpointed" in err[0]
    assert not (tmp_path / "runs").exists()
