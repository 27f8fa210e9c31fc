"""scan_layers: runs of same-kind layers under one lax.scan equal the unrolled loop (loss, aux,
gradients) for every remat policy and a general dense/MoE pattern; the layouts convert both ways
(checkpoints included); stacked parameters shard with an unsharded leading layer axis."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.config import ModelConfig
from dropless.models import decoder, scan
from tests._support import param_count as count
from dropless.presets import get_preset


@dataclasses.dataclass(frozen=True, kw_only=True)
class Patterned(ModelConfig):
    """A ModelConfig whose MoE layers follow an explicit pattern (not a dense prefix); the model
    and the scan only ever ask `is_moe_layer(i)`."""

    moe_pattern: tuple[bool, ...] = ()

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and self.moe_pattern[layer]


PATTERN = (False, True, False, True, True)     # runs: D | M | D | M M


def patterned(**kw) -> Patterned:
    base = dataclasses.asdict(get_preset("deepseek3-test").replace(mtp_depth=0))
    base["moe"] = get_preset("deepseek3-test").moe
    return Patterned(**{**base, "num_layers": len(PATTERN), "first_k_dense": 0,
                        "moe_pattern": PATTERN, **kw})


def test_layer_runs_follow_is_moe_layer():
    assert scan.layer_runs(patterned()) == [(0, 1, False), (1, 2, True), (2, 3, False),
                                            (3, 5, True)]
    ds = get_preset("deepseek3-671b")
    assert scan.layer_runs(ds) == [(0, 3, False), (3, 61, True)]
    assert scan.layer_runs(get_preset("mixtral-8x7b")) == [(0, 32, True)]


@pytest.fixture(scope="module")
def both():
    cfg = patterned()
    per_layer = decoder.init_params(jax.random.key(0), cfg)
    scanned = decoder.init_params(jax.random.key(0), cfg.replace(scan_layers=True))
    return cfg, per_layer, scanned


def test_layouts_hold_the_same_values_and_convert_both_ways(both):
    cfg, per_layer, scanned = both
    assert "layers" not in scanned and len(scanned["layer_runs"]) == 4
    assert scanned["layer_runs"][3]["moe"]["experts"]["w_gate_EDF"].shape == (2, 8, 64, 32)
    eq = functools.partial(jax.tree.map, np.testing.assert_array_equal)
    eq(scan.to_layout(scanned, False), per_layer)
    eq(scan.to_layout(per_layer, True), scanned)
    eq(scan.unstack_layers(scan.stack_layers(per_layer, cfg), cfg), per_layer)
    assert scan.to_layout(per_layer, False) is not None and scan.is_scanned(per_layer) is False
    assert count.param_counts(cfg) == count.param_counts(cfg.replace(scan_layers=True))


def test_conversion_checks_the_config(both):
    cfg, per_layer, scanned = both
    with pytest.raises(ValueError, match="4 decoder layers but ModelConfig.num_layers=5"):
        scan.stack_layers({**per_layer, "layers": per_layer["layers"][:4]}, cfg)
    wrong = patterned(moe_pattern=(True, True, False, True, True))
    with pytest.raises(ValueError, match=r"dense layer 0 but ModelConfig.is_moe_layer\(0\)=True"):
        scan.unstack_layers(scanned, wrong)


@pytest.fixture(scope="module")
def loss_and_grads(both):
    cfg, per_layer, scanned = both
    tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, cfg.vocab_size)

    def run(params, c, remat):
        def f(p):
            logits, _, aux = decoder.forward(p, tokens, c, remat=remat)
            return jnp.mean(logits ** 2) + aux["moe_loss"], aux
        return jax.jit(jax.value_and_grad(f, has_aux=True))(params)
    return lambda remat: (run(per_layer, cfg, remat),
                          run(scanned, cfg.replace(scan_layers=True), remat))


# "none" and "offload" (named, offloaded residuals: the policy most likely to differ under a
# scan); "full" and "minimal" go through the same jax.checkpoint wrapper per layer.
@pytest.mark.parametrize("remat", ["none", "offload"])
def test_scan_equals_unrolled(remat, loss_and_grads):
    ((l1, aux1), g1), ((l2, aux2), g2) = loss_and_grads(remat)
    # one float32 ulp apart with today's packages (0.027167508 vs 0.027167512; on main too,
    # same jax 0.10.2): XLA sums the two layouts' losses in another order
    np.testing.assert_allclose(float(l2), float(l1), rtol=1e-6, atol=0)
    assert sorted(aux1) == sorted(aux2) and aux1["tokens_per_expert_LE"].shape == (3, 8)
    for k in aux1:   # routing is identical; losses agree to the last float bit or so
        np.testing.assert_allclose(aux2[k], aux1[k], rtol=1e-6, atol=0, err_msg=k)
    np.testing.assert_array_equal(aux2["tokens_per_expert_LE"], aux1["tokens_per_expert_LE"])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                 scan.to_layout(g2, False), g1)


def test_merge_aux_stacks_every_per_layer_key():
    layers = [{"loss": jnp.float32(i), "dropped_tokens": jnp.int32(i), "z_loss": jnp.float32(i),
               "load_balance_loss": jnp.float32(0), "seq_aux_loss": jnp.float32(0),
               "tokens_per_expert": jnp.full((4,), i), "dropped_rows": jnp.int32(10 + i),
               "rows_inter_E": jnp.arange(4) + i} for i in range(3)]
    out = decoder._merge_aux(layers)
    assert float(out["moe_loss"]) == 3 and int(out["dropped_tokens"]) == 3
    assert float(out["z_loss"]) == 1.0
    np.testing.assert_array_equal(out["dropped_rows_L"], [10, 11, 12])
    assert out["rows_inter_LE"].shape == out["tokens_per_expert_LE"].shape == (3, 4)
    assert "dropped_rows" not in out and "loss" not in out


def test_router_bias_update_is_the_same_in_both_layouts(both):
    from dropless.config import TrainConfig
    from dropless.train import step
    cfg, per_layer, scanned = both
    rows = jnp.asarray(np.random.default_rng(0).integers(0, 9, (3, 8)), jnp.int32)
    tc = TrainConfig(model=cfg)
    a = step._update_biases(per_layer, {"tokens_per_expert_LE": rows}, tc)
    b = step._update_biases(scanned, {"tokens_per_expert_LE": rows}, tc)
    jax.tree.map(np.testing.assert_array_equal, scan.to_layout(b, False), a)
    assert not np.array_equal(a["layers"][4]["moe"]["router"]["bias_E"],
                              per_layer["layers"][4]["moe"]["router"]["bias_E"])


@pytest.mark.parametrize("saved_scanned", [False, True])
def test_checkpoint_restores_into_either_layout(tmp_path, both, saved_scanned):
    from dropless import checkpoint as ckpt
    _, per_layer, scanned = both
    saved, want = (scanned, per_layer) if saved_scanned else (per_layer, scanned)
    mngr = ckpt.manager(tmp_path, keep=1, async_save=False)
    meta = {"next_batch": 1, "corpus": {"train_tokens": 1}}   # as the trainer stores it
    ckpt.save(mngr, 1, {"params": saved, "step": jnp.int32(1)}, meta)
    mngr.wait_until_finished()
    like = {"params": jax.tree.map(jnp.zeros_like, want), "step": jnp.int32(0)}
    state, got = ckpt.restore(mngr, 1, like)
    jax.tree.map(np.testing.assert_array_equal, state["params"], want)
    assert {k: got[k] for k in meta} == meta and "hashes" in got and int(state["step"]) == 1


def test_stacked_params_shard_with_an_unsharded_layer_axis():
    from jax.sharding import PartitionSpec as P

    from dropless.parallel.sharding import state_shardings
    if jax.device_count() < 8:
        pytest.skip("needs 8 host devices (tests/conftest.py)")
    mesh = jax.make_mesh((1, 2, 4), ("data", "fsdp", "expert"))
    cfg = get_preset("deepseek3-test").replace(scan_layers=True)
    shapes = jax.eval_shape(lambda k: decoder.init_params(k, cfg), jax.random.key(0))
    stacked = state_shardings({"params": shapes}, mesh)["params"]["layer_runs"]
    flat_shapes = jax.eval_shape(lambda t: scan.to_layout(t, False), shapes)
    flat = state_shardings({"params": flat_shapes}, mesh)["params"]["layers"]
    assert tuple(stacked[1]["moe"]["experts"]["w_gate_EDF"].spec)[:2] == (None, "expert")
    for run, layer in ((stacked[0], flat[0]), (stacked[1], flat[2])):
        jax.tree.map(lambda s, f: s.spec == P(None, *f.spec) or pytest.fail(f"{s} vs {f}"),
                     run, layer)


def test_scan_equals_unrolled_expert_parallel():
    """On the 8-host-device mesh (expert 4 x fsdp 2), stacked weights placed by state_shardings,
    the MoE layers expert-parallel inside the scan: loss and gradients as unrolled."""
    from dropless.config_file import build_config
    from dropless.parallel.mesh import batch_sharding, train_mesh
    from dropless.parallel.sharding import state_shardings
    from dropless.train import step
    if jax.device_count() < 8:
        pytest.skip("needs 8 host devices (tests/conftest.py)")
    settings = {"preset": "deepseek3-test", "seq_len": 8, "per_device_batch_size": 1,
                "model.mtp_depth": 0, "model.moe.gmm_backend": "ragged_dot",
                "ici_expert_parallelism": 4, "ici_fsdp_parallelism": 2}
    batch = np.asarray(jax.random.randint(jax.random.key(2), (8, 9), 0, 256), np.int32)
    out = []
    for scanned in (False, True):
        cfg = build_config(list({**settings, "model.scan_layers": scanned}.items()))
        mesh = train_mesh(cfg.mesh)
        params = decoder.init_params(jax.random.key(0), cfg.model)
        params = jax.device_put(params, state_shardings(params, mesh))
        fn = jax.jit(jax.value_and_grad(functools.partial(
            step.loss_fn, cfg=cfg, mesh=mesh), has_aux=True))
        (loss, aux), grads = fn(params, jax.device_put(batch, batch_sharding(mesh)))
        out.append((float(loss), aux, scan.to_layout(grads, False)))
    (l1, a1, g1), (l2, a2, g2) = out
    assert l1 == pytest.approx(l2, rel=1e-6) and sorted(a1) == sorted(a2)
    np.testing.assert_array_equal(a1["tokens_per_expert_LE"], a2["tokens_per_expert_LE"])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), g2, g1)
