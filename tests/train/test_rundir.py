"""Run directories (train/rundir.py): a folder is a run only if dropless made it (its marker),
or a run from before the marker (recognised by its structure); every other non-empty folder is
refused, saying what it looks like, and left byte-identical; path mistakes are ValueErrors
before anything is made. No JAX here: the checks come before any compile."""
import json
import os

import pytest

from dropless.train import rundir

from tests._support.paths import HF_FIXTURES
from tests._support.train_mini import mini, snapshot


def _open(tmp_path, name, **kw):
    return rundir.open_run_dir(mini(tmp_path, run_name=name, **kw))


def test_a_new_run_gets_its_marker(tmp_path):
    run = _open(tmp_path, "new")
    marker = json.loads((run.path / rundir.MARKER).read_text())
    assert marker["dropless"] and marker["created"] and run.created
    run.discard()
    assert not (tmp_path / "runs").exists()


def _hf(path):
    import shutil
    shutil.copytree(HF_FIXTURES / "qwen3_moe", path)


def _converted(path):
    (path / "params").mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model": {}, "steps": 10}))


def _other(path):
    path.mkdir(parents=True)
    for name in ("a.txt", "b.txt", "c.txt", "d.txt"):
        (path / name).write_text(name)


@pytest.mark.parametrize("make, words", [
    (_hf, ("Hugging Face model folder", "init_from=hf:")),
    (_converted, ("dropless model directory", "init_from=")),
    (_other, ("something else (it holds a.txt, b.txt, c.txt and 1 more)", "new run_name")),
])
def test_a_folder_dropless_did_not_make_is_refused_and_left_alone(tmp_path, make, words):
    path = tmp_path / "runs" / "x"
    make(path)
    before = snapshot(tmp_path / "runs")
    with pytest.raises(ValueError) as e:
        _open(tmp_path, "x")
    msg = str(e.value)
    assert "is not a dropless run" in msg and "nothing was changed" in msg and "\n" not in msg
    assert all(w in msg for w in words), msg
    assert snapshot(tmp_path / "runs") == before


def test_a_run_from_before_the_marker_is_recognised_and_marked(tmp_path):
    path = tmp_path / "runs" / "old"
    (path / "checkpoints").mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model": {}, "steps": 4}))
    before = snapshot(path)
    run = _open(tmp_path, "old")
    assert not run.created and snapshot(path) == before        # nothing written on opening
    run.mark()
    assert (path / rundir.MARKER).is_file()
    run.release()


def test_an_empty_folder_is_used_and_left_empty_when_the_run_fails(tmp_path):
    path = tmp_path / "runs" / "empty"
    path.mkdir(parents=True)
    run = _open(tmp_path, "empty")
    assert (path / rundir.MARKER).is_file() and not run.created
    run.discard()
    assert path.is_dir() and list(path.iterdir()) == []


def _started(path):
    """What a run writes before its first step is done: the start record, orbax's folder."""
    (path / "metrics.jsonl").write_text('{"event": "start"}\n')
    (path / "checkpoints" / "1.orbax-checkpoint-tmp-0").mkdir(parents=True)
    (path / "tb").mkdir(exist_ok=True)
    (path / "tb" / "events.out.tfevents.1").write_bytes(b"x")


@pytest.mark.parametrize("prepared", [(), ("checkpoints",), ("checkpoints", "tb")])
def test_an_empty_folder_is_left_as_found_when_the_run_fails_in_its_first_step(tmp_path,
                                                                              prepared):
    # once the start record was written the folder held a metrics.jsonl and no marker: not a
    # run, not empty, so the next run there was refused
    path = tmp_path / "runs" / "empty"
    path.mkdir(parents=True)
    for name in prepared:
        (path / name).mkdir()
    before = snapshot(path)
    run = _open(tmp_path, "empty")
    _started(path)
    run.discard()
    assert snapshot(path) == before
    rundir.open_run_dir(mini(tmp_path, run_name="empty")).release()   # usable again


def test_a_signal_at_start_up_leaves_an_empty_folder_as_found(tmp_path):
    from dropless.train.loop import _startup_exit_words
    path = tmp_path / "runs" / "empty"
    path.mkdir(parents=True)
    run = _open(tmp_path, "empty")
    words = _startup_exit_words(run, "SIGTERM")
    assert list(path.iterdir()) == [] and "checkpoints" not in words and "left" in words


@pytest.mark.parametrize("name", ["a/b", "..", ".", "/abs", " x"])
def test_a_run_name_is_one_folder_name(tmp_path, name):
    with pytest.raises(ValueError, match="must be one folder name"):
        _open(tmp_path, name)
    assert not (tmp_path / "runs").exists()


def test_a_file_in_the_way_or_an_unwritable_run_dir(tmp_path, monkeypatch):
    (tmp_path / "f").write_text("x")
    for run_dir in (tmp_path / "f", tmp_path / "f" / "runs"):
        with pytest.raises(ValueError, match=r"run_dir=.* is a file, not a folder"):
            rundir.open_run_dir(mini(tmp_path, run_dir=str(run_dir), run_name="r"))
    (tmp_path / "ro").mkdir()
    monkeypatch.setattr(os, "access", lambda p, mode: False)    # as a non-root user sees it
    with pytest.raises(ValueError, match="is not writable"):
        rundir.open_run_dir(mini(tmp_path, run_dir=str(tmp_path / "ro"), run_name="r"))
    assert list((tmp_path / "ro").iterdir()) == []


def test_a_folder_prepared_with_an_empty_checkpoints_mount_point_is_empty(tmp_path):
    """A checkpoints/ folder made (or mounted) before the run counts as empty; one holding
    files does not."""
    path = tmp_path / "runs" / "m"
    (path / "checkpoints").mkdir(parents=True)
    run = _open(tmp_path, "m")
    assert (path / rundir.MARKER).is_file()
    run.discard()
    assert sorted(p.name for p in path.iterdir()) == ["checkpoints"]
    (path / "checkpoints" / "x").write_text("x")
    with pytest.raises(ValueError, match="it looks like something else"):
        _open(tmp_path, "m")


# -- a run started from a model keeps that model's Hugging Face config.json keys (hf_kept_config)

def _from(tmp_path, name, init_from):
    import dataclasses
    return rundir.open_run_dir(dataclasses.replace(mini(tmp_path, run_name=name),
                                                   init_from=init_from))


def test_a_run_from_a_model_keeps_its_config_keys_at_start(tmp_path):
    from dropless.model_dir.kept_config import KEPT_FILE, kept_of_hf_folder
    conv = tmp_path / "conv"
    _converted(conv)
    (conv / KEPT_FILE).write_text(json.dumps({"max_position_embeddings": 777, "eos_token_id": 2}))
    run = _from(tmp_path, "a", str(conv))
    assert json.loads((run.path / KEPT_FILE).read_text()) == {"max_position_embeddings": 777,
                                                              "eos_token_id": 2}
    hf = tmp_path / "hf"
    _hf(hf)
    other = _from(tmp_path, "b", f"hf:{hf}")
    assert json.loads((other.path / KEPT_FILE).read_text()) == kept_of_hf_folder(hf)
    for r in (other, run):    # a start-up undone removes it with the folder
        r.discard()
    assert not (tmp_path / "runs").exists()
    assert not (_open(tmp_path, "scratch").path / KEPT_FILE).exists()   # nothing to keep


def test_a_found_empty_folder_keeps_the_config_keys_until_the_start_is_undone(tmp_path):
    from dropless.model_dir.kept_config import KEPT_FILE
    conv = tmp_path / "conv"
    _converted(conv)
    (conv / KEPT_FILE).write_text(json.dumps({"max_position_embeddings": 777}))
    path = tmp_path / "runs" / "empty"
    (path / "checkpoints").mkdir(parents=True)
    before = snapshot(path)
    run = _from(tmp_path, "empty", str(conv))
    assert (path / KEPT_FILE).is_file() and (path / rundir.MARKER).is_file()
    assert run.undo() == f"{path} was left empty, as it was found" and snapshot(path) == before


def test_a_side_file_that_is_no_object_refuses_the_start_and_leaves_nothing(tmp_path):
    from dropless.model_dir.kept_config import KEPT_FILE
    conv = tmp_path / "conv"
    _converted(conv)
    (conv / KEPT_FILE).write_text("[1, 2]")
    with pytest.raises(ValueError, match=rf"init_from='{conv}': {conv / KEPT_FILE} holds an "
                                         "array, not a JSON object"):
        _from(tmp_path, "a", str(conv))
    assert not (tmp_path / "runs").exists()
    empty = tmp_path / "runs" / "e"
    empty.mkdir(parents=True)
    with pytest.raises(ValueError, match="holds an array"):
        _from(tmp_path, "e", str(conv))
    assert list(empty.iterdir()) == []
