"""overflow='error' in the loop: an overflowing step is never applied, the flag is read only
every overflow_check_every_n_steps steps, and the run stops naming layer, rows and the buffer
factor that fits, leaving a resumable checkpoint of the last good step. The same run then
resumes under the recipe's CPU variant (overflow='rounds'): 8 host devices, EP over two
"nodes", nothing dropped."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.config_file import build_config
from dropless import checkpoint as ckpt
from dropless.train import step as step_lib
from dropless.train.loop import train
from dropless.train.overflow import BufferOverflowError, OverflowGuard
from tests._support.paths import EXAMPLES

CPU8 = str(EXAMPLES / "deepseek3_cpu8.yml")


def _fake_step(state, batch):
    """Adds 1 to the parameter; `batch` says how many rows each of 2 layers dropped."""
    new = {**state, "params": state["params"] + 1, "step": state["step"] + 1}
    return new, {"dropped_rows_L": batch, "sufficient_buffer_factor_L": batch * 0.1 + 1.0}


def test_guard_freezes_state_from_the_first_overflow_until_the_check():
    cfg = build_config([("model.moe.overflow", "error"),
                        ("model.moe.overflow_check_every_n_steps", 4),
                        ("model.num_layers", 3), ("model.first_k_dense", 1)])
    guard = OverflowGuard(cfg)
    assert guard.names == ["layer 1", "layer 2"]
    fn = jax.jit(guard.wrap(_fake_step))
    state = guard.attach({"params": jnp.zeros(()), "step": jnp.zeros((), jnp.int32)})
    rows = [[0, 0], [0, 0], [0, 7], [0, 0], [3, 3]]   # step 3 overflows in layer 2
    skipped = []
    for i, r in enumerate(rows, start=1):
        state, m = fn(state, jnp.asarray(r, jnp.float32))
        skipped.append(int(m["overflow_skipped"]))
        if i < 4:
            guard.check(state, i)             # not due: no read, no raise
    assert skipped == [0, 0, 1, 1, 1]
    assert float(state["params"]) == 2.0 and int(state["step"]) == 2   # the last good step
    with pytest.raises(BufferOverflowError, match=r"step 3: .* in layer 2 \(7 rows\) with "
                       r"model.moe.ragged_buffer_factor=2.0 .* ragged_buffer_factor=2.1 would "
                       r"have fitted"):
        guard.check(state, 4)
    assert set(guard.strip(state)) == {"params", "step"}


@pytest.mark.parametrize("skipped", [0, 1])
def test_a_step_record_says_whether_the_step_was_applied(skipped):
    # between the first overflowing step and the check, steps are recorded as they ran: the
    # record must say the update was not applied, or metrics.jsonl reads as a normal step
    from dropless.train.step_metrics import step_metrics
    cfg = build_config([("model.moe.overflow", "error"), ("steps", 4)])
    m = {"loss": np.float32(2.5), "dropped_tokens": np.int32(0),
         "overflow_skipped": np.int32(skipped)}
    rec = step_metrics(m, step=3, dt=0.5, cfg=cfg, fpt={"model": 1e6, "executed": 1e6},
                       peak=None)
    assert rec["overflow_skipped"] == skipped and type(rec["overflow_skipped"]) is int
    assert "overflow_skipped" not in step_metrics(
        {k: v for k, v in m.items() if k != "overflow_skipped"}, step=3, dt=0.5, cfg=cfg,
        fpt={"model": 1e6, "executed": 1e6}, peak=None)


def test_per_layer_overflow_reaches_the_step_metrics():
    """The model keeps each MoE layer's dispatcher stats: rows dropped (overflow='error'),
    the buffer factor that fits, and rounds beyond the first (counted under 'rounds')."""
    from dropless.models.decoder import _merge_aux
    def aux(dropped, factor, rounds):
        return {"loss": jnp.zeros(()), "dropped_tokens": jnp.zeros((), jnp.int32),
                "tokens_per_expert": jnp.ones((4,)), "load_balance_loss": jnp.zeros(()),
                "seq_aux_loss": jnp.zeros(()), "z_loss": jnp.zeros(()),
                "dropped_rows": jnp.float32(dropped), "sufficient_buffer_factor":
                jnp.float32(factor), "rounds": jnp.int32(rounds)}
    out = _merge_aux([aux(0, 1.2, 1), aux(5, 2.3, 3)])
    np.testing.assert_array_equal(out["dropped_rows_L"], [0, 5])
    np.testing.assert_allclose(out["sufficient_buffer_factor_L"], [1.2, 2.3])
    assert int(out["overflow_rounds"]) == 2


def test_guard_is_a_pass_through_under_rounds():
    guard = OverflowGuard(build_config())
    assert not guard.active and guard.wrap(_fake_step) is _fake_step
    state = {"params": jnp.zeros(())}
    assert guard.attach(state) is state


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 host devices (tests/conftest.py)")
def test_overflow_stops_with_a_resumable_checkpoint_then_the_cpu_recipe_resumes(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def add(a, b):\n    return a + b\n\n" * 300)
    small = [("data", str(corpus)), ("eval_fraction", 0.1), ("eval_batches", 1),
             ("max_target_length", 16), ("per_device_batch_size", 1), ("model.num_layers", 2),
             ("model.mtp_depth", 0), ("run_dir", str(tmp_path)), ("run_name", "run")]
    # (plain bf16 grouped matmuls here: one compile less of the MXFP8 emulation)
    tight = build_config(small + [("steps", 4), ("model.moe.overflow", "error"),
                                  ("ragged_buffer_factor", 1.0), ("te_gmm_quantization", ""),
                                  ("te_ep_overflow_check_every_n_steps", 2)], yaml_path=CPU8)
    with pytest.raises(BufferOverflowError) as e:
        train(tight, echo=lambda s: None)
    msg = str(e.value)
    assert "layer 1 (" in msg and "ragged_buffer_factor=1.0 and overflow='error'" in msg
    assert "would have fitted" in msg and "\n" not in msg
    bad = int(msg.split(":")[0].split()[1])
    good = bad - 1
    assert f"step {good} (the last good one) is checkpointed" in msg
    # the checkpoint is the last good step's state, unchanged by the overflowing step
    mngr = ckpt.manager(tmp_path / "run" / "checkpoints", keep=3, async_save=False)
    assert mngr.latest_step() == good
    like, _ = step_lib.init_state(tight)
    state, meta = ckpt.restore(mngr, good, like)
    mngr.close()
    assert meta["next_batch"] == good and int(state["step"]) == good
    if good == 0:   # nothing was applied: the initial parameters, bitwise
        jax.tree.map(np.testing.assert_array_equal, state["params"], like["params"])
    # resume the same run with the CPU recipe as shipped: rounds, factor 2.0, nothing dropped
    ok = build_config(small + [("steps", good + 2)], yaml_path=CPU8)
    assert ok.model.moe.gmm_quantization == "mxfp8"
    assert ok.mesh.devices_per_node == 4 and ok.mesh.dcn_expert == 2
    result = train(ok, echo=lambda s: None)
    assert result.start_step == good and sorted(result.losses) == [good + 1, good + 2]
    recs = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if r["event"] == "step" and r["step"] > good]
    assert steps and all(r["dropped_tokens"] == 0 for r in steps)
    assert all(np.isfinite(r["loss"]) for r in steps)
    assert all(r["overflow_rounds"] >= 0 for r in steps)   # counted under overflow='rounds'
