"""The one checkpoint reader (`checkpoint.reader`): malformed metadata is damage, the fall-back
to the newest intact step, steps not yet committed skipped (never called damaged), leases that
rotation respects, and a reader running beside a writer that saves and rotates as fast as it
can (every read is a whole step with its own values)."""
import json
import shutil
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless import checkpoint as ckpt
from dropless.checkpoint import reader

from tests._support import ckpt_damage

META = {"next_batch": 3, "corpus": {"train_tokens": 1}}


def _state(step: int) -> dict:
    """A small state whose values name its step (a mixed-up read shows)."""
    w = np.random.default_rng(step).standard_normal((64, 48)).astype(np.float32)
    return {"params": {"w": jnp.asarray(w), "b": jnp.full((8,), float(step))}}


LIKE = jax.eval_shape(lambda: _state(0))


def _save(directory, steps, keep=10):
    mngr = ckpt.manager(directory, keep=keep, async_save=False)
    for s in steps:
        ckpt.save(mngr, s, _state(s), dict(META, next_batch=s))
    mngr.wait_until_finished()
    mngr.close()


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    d = tmp_path_factory.mktemp("reader") / "checkpoints"
    _save(d, (2, 4))
    return d


@pytest.fixture
def steps(pristine, tmp_path):
    d = tmp_path / "checkpoints"
    shutil.copytree(pristine, d)
    return d


def _read(d):
    return lambda s: ckpt.read_params(d, s, LIKE["params"])


def _meta_edit(key, value):
    def edit(step):
        path = step / "meta" / "metadata"
        meta = json.loads(path.read_text())
        meta[key] = value
        path.write_text(json.dumps(meta))
    return edit


MALFORMED = {
    "next-batch-a-string": (_meta_edit("next_batch", "3"), "bad-meta", "next_batch='3'"),
    "next-batch-a-bool": (_meta_edit("next_batch", True), "bad-meta", "not an int"),
    "corpus-a-list": (_meta_edit("corpus", [1, 2]), "bad-meta", "corpus entry that is a list"),
    "hashes-a-list": (_meta_edit("hashes", ["x"]), "bad-meta", "hashes entry"),
    "next-sample-negative": (_meta_edit("next_sample", -1), "bad-meta", "next_sample='-1'"),
    "global-batch-zero": (_meta_edit("global_batch_size", 0), "bad-meta",
                          "global_batch_size='0', not an int >= 1"),
    "data-order-a-list": (_meta_edit("data_order", [32]), "bad-meta", "data_order entry"),
    "meta-a-list": (lambda s: (s / "meta" / "metadata").write_text("[1]"), "bad-meta",
                    "not a JSON object"),
    "checkpoint-metadata-empty-object": (
        lambda s: (s / "_CHECKPOINT_METADATA").write_text("{}"), "bad-checkpoint-metadata",
        "not a non-empty JSON object"),
    "checkpoint-metadata-a-list": (
        lambda s: (s / "_CHECKPOINT_METADATA").write_text("[]"), "bad-checkpoint-metadata",
        "_CHECKPOINT_METADATA"),
    "state-metadata-a-list": (lambda s: (s / "state" / "_METADATA").write_text("[]"),
                              "bad-state-metadata", "tree_metadata"),
    "state-metadata-empty-object": (lambda s: (s / "state" / "_METADATA").write_text("{}"),
                                    "bad-state-metadata", "tree_metadata"),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_metadata_is_damage_and_the_reader_falls_back(steps, name):
    edit, reason, words = MALFORMED[name]
    edit(steps / "4")
    damage = ckpt.inspect(steps, 4)
    assert damage is not None and damage.reason == reason and words in damage.detail, damage
    found = ckpt.read_newest(steps, _read(steps), writer_may_run=False)
    assert found.step == 2 and [d.step for d in found.damaged] == [4]
    np.testing.assert_array_equal(found.value["b"], np.full(8, 2.0))


@pytest.mark.parametrize("damage, reason", [(ckpt_damage.flip_values, "hash-mismatch"),
                                            (ckpt_damage.break_framing, "unreadable")])
def test_damaged_arrays_fall_back_and_are_set_aside(steps, damage, reason):
    damage(steps / "4")
    found = ckpt.read_newest(steps, _read(steps), writer_may_run=True)
    assert found.step == 2 and [d.reason for d in found.damaged] == [reason]
    moved = ckpt.set_aside(steps, found.damaged)
    assert moved[0][1] == steps / "damaged" / f"4-{reason}" and moved[0][1].is_dir()
    line = ckpt.fallback_words(found, moved)
    assert "checkpoint 4 is damaged" in line and "step 2, the newest intact" in line
    assert "\n" not in line
    assert ckpt.all_steps(steps) == [2]


def test_no_intact_step_is_a_one_line_value_error(steps):
    for s in (2, 4):
        (steps / str(s) / "meta" / "metadata").write_text("{not json")
    with pytest.raises(ckpt.NoIntactStep) as e:
        ckpt.read_newest(steps, _read(steps), writer_may_run=False)
    assert isinstance(e.value, ValueError) and [d.step for d in e.value.damaged] == [4, 2]
    assert "checkpoint 4 is damaged" in str(e.value) and "\n" not in str(e.value)


def test_a_step_not_yet_committed_is_skipped_not_damaged(steps):
    """Beside a live trainer (writer_may_run) a step without commit_success.txt is being
    written: skipped and left in place; the trainer's own resume counts it as damage."""
    (steps / "6").mkdir()
    found = ckpt.read_newest(steps, _read(steps), writer_may_run=True)
    assert (found.step, found.damaged, found.incomplete) == (4, (), (6,))
    assert "not complete yet" in ckpt.fallback_words(found, [])
    found = ckpt.read_newest(steps, _read(steps), writer_may_run=False)
    assert found.step == 4 and [d.reason for d in found.damaged] == ["empty"]


def test_a_step_gone_before_it_is_leased_is_passed_over(steps, monkeypatch):
    monkeypatch.setattr(reader, "all_steps", lambda d: [9, 4, 2])   # 9 rotated away meanwhile
    found = ckpt.read_newest(steps, _read(steps), writer_may_run=True)
    assert (found.step, found.damaged) == (4, ())


def test_rotation_and_set_aside_leave_a_held_step(steps):
    with ckpt.lease(steps, 2) as held:
        assert held
        assert ckpt.rotate(steps, 1) == []                 # 2 is held: kept for later
        assert ckpt.set_aside(steps, (ckpt.Damage(2, "x", "y"),)) == [
            (ckpt.Damage(2, "x", "y"), None)]
        assert ckpt.all_steps(steps) == [4, 2]
    assert ckpt.rotate(steps, 1) == [2]
    assert ckpt.all_steps(steps) == [4]
    assert not [p for p in steps.iterdir() if p.name.startswith(".removing")]


def test_a_reader_beside_a_writer_that_saves_and_rotates(tmp_path):
    """One thread saves steps 1..N keeping one (rotation after every save), another reads the
    newest step again and again: every read is a whole, intact step with its own values, none
    is called damaged or incomplete, and every old step is removed once no read holds it."""
    d = tmp_path / "checkpoints"
    saver = ckpt.Saver(ckpt.manager(d, keep=1, async_save=False))
    n, done, reads, errors = 16, threading.Event(), [], []
    saver.save(1, _state(1), dict(META, next_batch=1))

    def read_loop():
        try:
            while not done.is_set():
                found = ckpt.read_newest(d, _read(d), writer_may_run=True)
                assert not found.damaged and not found.incomplete, found
                np.testing.assert_array_equal(found.value["b"], np.full(8, float(found.step)))
                np.testing.assert_array_equal(found.value["w"], _state(found.step)["params"]["w"])
                reads.append(found.step)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)
    t = threading.Thread(target=read_loop)
    t.start()
    try:
        for s in range(2, n + 1):
            saver.save(s, _state(s), dict(META, next_batch=s))
    finally:
        saver.finish()
        done.set()
        t.join()
    assert not errors, errors[0]
    assert len(reads) >= 3 and reads == sorted(reads), reads
    ckpt.rotate(d, 1)         # a step a read held at the last save goes now, nothing is held
    assert ckpt.all_steps(d) == [n]


@pytest.mark.parametrize("like, words", [
    ({"w": jax.ShapeDtypeStruct((64, 96), jnp.float32), "b": LIKE["params"]["b"]},
     "params/w is (64, 48) float32 in the checkpoint, (64, 96) float32 asked for"),
    ({"w": LIKE["params"]["w"], "b": jax.ShapeDtypeStruct((8,), jnp.bfloat16)},
     "params/b is (8,) float32 in the checkpoint, (8,) bfloat16 asked for"),
    ({"w": LIKE["params"]["w"]}, "params/b is in the checkpoint but not asked for"),
])
def test_a_step_of_another_model_is_refused_not_called_damage(steps, like, words):
    """Intact steps whose arrays differ from the ones asked for (a run's config.json edited, a
    step copied in from another run): one line naming the array and both shapes and dtypes,
    nothing read, nothing moved aside (the files are not damaged: the question is wrong)."""
    with pytest.raises(ckpt.DoesNotFit) as e:
        ckpt.read_newest(steps, lambda s: ckpt.read_params(steps, s, like), writer_may_run=True)
    assert not isinstance(e.value, ckpt.NoIntactStep) and isinstance(e.value, ValueError)
    assert words in str(e.value) and "checkpoint 4 " in str(e.value), str(e.value)
    assert "\n" not in str(e.value) and "damaged" not in str(e.value)
    assert ckpt.all_steps(steps) == [4, 2] and not (steps / ckpt.DAMAGED).exists()
