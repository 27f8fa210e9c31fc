"""A resume continues at the first sample the run has not trained on, whatever the new global
batch, and refuses a data order that would name other rows (train/resume.data_position).

The reference is the obvious one: the sample numbers the steps of the interrupted run and of
its resume were built from, taken at the loader (prefetch=0, so nothing is built ahead),
together cover 0..N-1 once each, as one uninterrupted run over N samples does.
"""
import json
import shutil

import pytest

from dropless import checkpoint as ckpt
from dropless import cli
from dropless.data import loader as loader_lib
from dropless.train.loop import train

from tests._support.train_mini import mini, shared_compilation_cache, snapshot

QUIET = dict(echo=lambda s: None)


@pytest.fixture(scope="module", autouse=True)
def compilation_cache(tmp_path_factory):
    yield from shared_compilation_cache(tmp_path_factory)


@pytest.fixture
def samples(monkeypatch):
    """The sample numbers of every batch the loader builds, in order."""
    seen = []
    build = loader_lib.Loader.build

    def record(self, index):
        seen.extend(range(self.sample_of(index), self.sample_of(index) + self.b))
        return build(self, index)
    monkeypatch.setattr(loader_lib.Loader, "build", record)
    return seen


def _run(tmp_path, name, steps, batch, **kw):
    return mini(tmp_path, steps=steps, run_name=name, per_device_batch_size=batch, prefetch=0,
                time_kernels=False, **kw)


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    """2 steps of 4 rows (checkpoint at 2), as the runs below resume them."""
    tmp = tmp_path_factory.mktemp("pos")
    res = train(_run(tmp, "a", 2, 4, checkpoint_every=2), **QUIET)
    return tmp, res.run_dir


def _copy(first, tmp_path, name):
    run = tmp_path / "runs" / name
    shutil.copytree(first[1], run)
    return run


@pytest.mark.parametrize("batch, k", [(8, 1), (1, 3)])
def test_a_new_global_batch_continues_at_the_first_untrained_sample(tmp_path, first, samples,
                                                                    batch, k):
    run = _copy(first, tmp_path, "b")
    meta = ckpt.read_meta(run / "checkpoints", 2)
    assert (meta["next_batch"], meta["next_sample"], meta["global_batch_size"]) == (2, 8, 4)
    assert meta["data_order"] == {"seq_len": 32, "packing": "documents", "seed": 0}
    lines = []
    cfg = _run(tmp_path, "b", 4, batch, checkpoint_every=1, gradient_accumulation_steps=k)
    res = train(cfg, echo=lines.append)
    rows = batch * k
    assert res.start_step == 2 and sorted(res.losses) == [3, 4]
    # the interrupted run's 8 samples, then these 2 steps' rows: each sample once, in order
    assert samples == list(range(8, 8 + 2 * rows))
    said = [x for x in lines if "global batch" in x]
    assert said == [f"  global batch {rows} rows (was 4): the data continues at sample 8, "
                    "the first the run has not trained on"], lines
    for step, nxt in ((3, 8 + rows), (4, 8 + 2 * rows)):
        m = ckpt.read_meta(run / "checkpoints", step)
        assert (m["next_batch"], m["next_sample"], m["global_batch_size"]) == (step, nxt, rows)
    # a second resume at this batch says nothing and goes on from there
    samples.clear()
    lines.clear()
    train(cfg.replace(steps=5), echo=lines.append)
    assert samples == list(range(8 + 2 * rows, 8 + 3 * rows))
    assert not [x for x in lines if "global batch" in x]


def test_the_same_batch_keeps_the_runs_own_numbering(tmp_path, first, samples):
    run = _copy(first, tmp_path, "same")
    lines = []
    train(_run(tmp_path, "same", 3, 4), echo=lines.append)
    assert samples == list(range(8, 12)) and not [x for x in lines if "global batch" in x]
    assert ckpt.read_meta(run / "checkpoints", 3)["next_sample"] == 12


def _as_written_before(run):
    """Checkpoint 2's record as the trainer wrote it before it recorded the data position."""
    path = run / "checkpoints" / "2" / "meta" / "metadata"
    meta = json.loads(path.read_text())
    for key in ("next_sample", "global_batch_size", "data_order"):
        del meta[key]
    path.write_text(json.dumps(meta))


def test_a_checkpoint_without_the_sample_number_takes_it_from_config_json(tmp_path, first,
                                                                          samples):
    run = _copy(first, tmp_path, "old")
    _as_written_before(run)
    before = snapshot(run)
    # its data order comes from config.json, and is held
    with pytest.raises(ValueError, match=r"^seq_len=16: the run's checkpoint 2 was trained with seq_len=32"):
        train(_run(tmp_path, "old", 4, 2, seq_len=16), **QUIET)
    assert snapshot(run) == before
    lines = []
    # 8 rows: the global batch the test above trains at, so its compiled step is reused; a
    # position taken from the new batch (2 x 8) would start at 16, not 8
    train(_run(tmp_path, "old", 3, 8), echo=lines.append)
    assert samples == list(range(8, 16))   # next_batch 2 x config.json's 4 rows, then 8 rows
    assert any("(was 4): the data continues at sample 8" in x for x in lines), lines


@pytest.mark.parametrize("key, value", [("seq_len", 16), ("packing", "stream"),
                                        ("seed", 7)])
def test_another_data_order_is_refused_and_changes_nothing(tmp_path, first, key, value):
    run = _copy(first, tmp_path, "order")
    before = snapshot(run)
    with pytest.raises(ValueError) as e:
        train(_run(tmp_path, "order", 4, 4, **{key: value}), **QUIET)
    msg = str(e.value)
    assert msg.startswith(f"{key}={value!r}: the run's checkpoint 2 was trained with {key}="), msg
    assert f"init_from={run}" in msg and "nothing was changed" in msg and "\n" not in msg
    assert snapshot(run) == before


def test_the_refusal_is_one_line_from_the_command_line(tmp_path, first, capsys):
    run = _copy(first, tmp_path, "cli")
    before = snapshot(run)
    status = cli.main(["train", "--resume", str(run), "steps=4", "seq_len=16"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1, err
    assert err[0].startswith("dropless: error: seq_len=16: the run's checkpoint 2 was trained "
                             "with seq_len=32") and "..." not in err[0]
    assert err[0].endswith(f"Resume with seq_len=32, or start a new run from its weights: "
                           f"init_from={run}")
    assert snapshot(run) == before
