"""`checkpoint.read_params`: the parameters of a step alone, against the full restore (the same
arrays, bitwise), from a checkpoint written in either parameter layout, and refusing a damaged
step as the full restore does; a run directory's weights load without optimizer state; a step
written in another placement restores onto the trainer's."""
import json
import shutil

import jax
import numpy as np
import pytest

from dropless import checkpoint as ckpt
from dropless.config_file import build_config
from dropless.model_dir import load_dropless, to_dict
from dropless.models import scan
from dropless.models.decoder import init_params
from dropless.moe import expert_layout
from dropless.train import step as step_lib

from tests._support import ckpt_damage

META = {"next_batch": 3, "corpus": {"train_tokens": 1}}   # what the trainer stores beside a step
FLAGS = {"scan": "model.scan_layers", "fused": "model.moe.prefuse_moe_weights"}


def _cfg(*flags):
    return build_config([("model.num_layers", 3)] + [(FLAGS[f], True) for f in flags])


def _like_params(cfg):
    return jax.eval_shape(lambda k: init_params(k, cfg.model), jax.random.key(0))


def _like_state(cfg):
    return jax.eval_shape(lambda: step_lib.init_state(cfg)[0])


def _assert_bitwise(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.array_equal(np.atleast_1d(x).view(np.uint8), np.atleast_1d(y).view(np.uint8))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(cfg, state, checkpoints dir): the whole train state of a per-layer, unfused model, saved
    at step 3 with its hashes."""
    cfg = _cfg()
    state, _ = step_lib.init_state(cfg)
    state["params"] = jax.tree.map(lambda x: x + 1, state["params"])   # not the init values
    d = tmp_path_factory.mktemp("ckpt") / "checkpoints"
    mngr = ckpt.manager(d, keep=1, async_save=False)
    ckpt.save(mngr, 3, state, META)
    mngr.wait_until_finished()
    mngr.close()
    return cfg, state, d


def _restore(d, step, like):
    mngr = ckpt.manager(d, keep=5, async_save=False)
    try:
        return ckpt.restore(mngr, step, like)
    finally:
        mngr.close()


def test_params_alone_are_the_full_restores_params(saved):
    cfg, state, d = saved
    got = ckpt.read_params(d, 3, _like_params(cfg))
    full, meta = _restore(d, 3, _like_state(cfg))
    _assert_bitwise(got, full["params"])
    _assert_bitwise(got, state["params"])
    assert {k: meta[k] for k in META} == META


@pytest.mark.parametrize("flags", [("scan",), ("fused",), ("scan", "fused")])
def test_params_alone_in_the_other_layout(saved, flags):
    """Written per-layer and unfused, read scanned and/or fused: converted as the full
    restore converts them."""
    _, state, d = saved
    cfg = _cfg(*flags)
    got = ckpt.read_params(d, 3, _like_params(cfg))
    assert scan.is_scanned(got) is ("scan" in flags)
    assert expert_layout(got) is ("fused" in flags)
    _assert_bitwise(got, _restore(d, 3, _like_state(cfg))[0]["params"])
    _assert_bitwise(_unconverted(got, flags), state["params"])


def _fsdp_alone(spec):
    """`spec` with `expert` left out of every dim that splits over more than it (the FSDP
    dims of the non-expert weights): the placement before ZeRO-3 over fsdp x expert."""
    from jax.sharding import PartitionSpec
    return PartitionSpec(*[tuple(a for a in d if a != "expert") or None
                           if isinstance(d, tuple) else d for d in spec])


def test_a_step_written_in_another_placement_restores_onto_the_trainers(saved, tmp_path):
    """The saved state placed on an expert 4 x fsdp 2 mesh with every non-expert matrix over
    fsdp alone (whole on each expert rank), written, and restored with the trainer's
    `state_shardings` on that mesh (those matrices over fsdp x expert): the same arrays,
    bitwise, each on its target sharding."""
    from jax.sharding import NamedSharding
    from dropless.config import MeshConfig
    from dropless.parallel.mesh import make_mesh
    from dropless.parallel.sharding import state_shardings
    _, state, _ = saved
    mesh = make_mesh(MeshConfig(fsdp=2, expert=4), jax.devices()[:8])
    target = state_shardings(state, mesh)
    before = jax.tree.map(lambda t: NamedSharding(mesh, _fsdp_alone(t.spec)), target)
    moved = [t for t, b in zip(jax.tree.leaves(target), jax.tree.leaves(before))
             if t.spec != b.spec]
    assert len(moved) > 10                          # attention, FFN, embedding, head, moments
    mngr = ckpt.manager(tmp_path, keep=1, async_save=False)
    ckpt.save(mngr, 3, jax.device_put(state, before), META)
    mngr.wait_until_finished()
    mngr.close()
    like = jax.tree.map(lambda x, t: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=t),
                        state, target)
    got, _ = _restore(tmp_path, 3, like)
    _assert_bitwise(got, state)
    for x, t in zip(jax.tree.leaves(got), jax.tree.leaves(target)):
        assert x.sharding.is_equivalent_to(t, x.ndim), (x.sharding, t)


def _unconverted(params, flags):
    from dropless.moe import convert_expert_weights
    out = scan.to_layout(params, False) if "scan" in flags else params
    return convert_expert_weights(out, prefuse=False) if "fused" in flags else out


def _flip_bits(step_dir):
    """One byte of an array chunk changed where it still decodes, to other values."""
    ckpt_damage.flip_values(step_dir)


def _empty_chunk(step_dir):
    next(iter(sorted((step_dir / "state").glob("**/d/*")))).write_bytes(b"")


def _no_manifest(step_dir):
    (step_dir / "state" / "manifest.ocdbt").unlink()


@pytest.mark.parametrize("damage, reason", [(_flip_bits, "hash-mismatch"),
                                            (ckpt_damage.break_framing, "unreadable"),
                                            (_empty_chunk, "truncated"),
                                            (_no_manifest, "no-manifest")])
def test_a_damaged_step_is_refused_as_the_full_restore_refuses_it(tmp_path, damage, reason):
    """The state holds the parameters only, so the damage is in the arrays read."""
    cfg = _cfg()
    params = jax.tree.map(lambda x: x + 1, init_params(jax.random.key(1), cfg.model))
    mngr = ckpt.manager(tmp_path, keep=1, async_save=False)
    ckpt.save(mngr, 2, {"params": params}, META)
    mngr.wait_until_finished()
    mngr.close()
    damage(tmp_path / "2")
    with pytest.raises(ckpt.CheckpointDamaged) as alone:
        ckpt.read_params(tmp_path, 2, _like_params(cfg))
    with pytest.raises(ckpt.CheckpointDamaged) as full:
        _restore(tmp_path, 2, {"params": _like_params(cfg)})
    assert alone.value.damage == full.value.damage
    assert alone.value.damage.reason == reason and "checkpoint 2 is damaged" in str(alone.value)


def test_a_run_directory_loads_without_optimizer_state(saved, tmp_path, monkeypatch):
    """`model_dir.load_dropless` of a run directory: its newest step's parameters, read with
    neither `init_state` nor the optimizer (both made to fail here)."""
    cfg, state, d = saved
    run = tmp_path / "run"
    shutil.copytree(d, run / "checkpoints")
    (run / "config.json").write_text(json.dumps(to_dict(cfg)))

    def refuse(*_, **__):
        raise AssertionError("loading a model built optimizer state")
    monkeypatch.setattr(step_lib, "init_state", refuse)
    monkeypatch.setattr(step_lib, "make_optimizer", refuse)
    got_cfg, params = load_dropless(run)
    assert got_cfg == cfg
    _assert_bitwise(params, state["params"])


def test_a_run_whose_config_describes_another_model_is_refused_in_one_line(saved, tmp_path):
    """A run directory whose config.json no longer describes its checkpoints (edited, or a step
    copied in from another run): one line naming the array, both shapes and config.json; the
    intact step stays where it is (it is not damage) and loads again under the right config."""
    cfg, state, d = saved
    run = tmp_path / "run"
    shutil.copytree(d, run / "checkpoints")
    other = cfg.replace(model=cfg.model.replace(d_ff=cfg.model.d_ff * 2))
    (run / "config.json").write_text(json.dumps(to_dict(other)))
    with pytest.raises(ValueError) as e:
        load_dropless(run, what="dropless eval run")
    text = str(e.value)
    assert text.startswith("dropless eval run: checkpoint 3 in ") and "\n" not in text
    d, f = cfg.model.d_model, cfg.model.d_ff
    assert f"params/layers/0/ffn/w_down_FD is ({f}, {d}) float32 in the checkpoint, " \
           f"({2 * f}, {d}) float32 asked for" in text and f"{run / 'config.json'}" in text, text
    assert "damaged" not in text and "nothing was changed" in text
    assert ckpt.all_steps(run / "checkpoints") == [3]
    assert not (run / "checkpoints" / ckpt.DAMAGED).exists()
    (run / "config.json").write_text(json.dumps(to_dict(cfg)))
    _assert_bitwise(load_dropless(run)[1], state["params"])
