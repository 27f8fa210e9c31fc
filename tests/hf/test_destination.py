"""Writes that never destroy: `dropless convert` killed part-way over an
existing folder of another model leaves that folder byte-identical and the source intact, and
what it half-wrote does not load; a later convert replaces the folder whole.

The convert runs in a subprocess that is made to stall once it has written some of its files
(a wrapper around safetensors' `save_file` / orbax's save, not a hook in dropless), and is then
killed with SIGKILL, as a user's Ctrl-\\ or the OOM killer would.
"""
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests._support.fault import SRC, snapshot
from dropless import cli, hf
from dropless.hf import destination
from tests._support.paths import HF_FIXTURES

FIX = HF_FIXTURES

STALL = r"""
import os, sys, time
mark, stage = sys.argv[1], sys.argv[2]
def stall():
    open(mark, "w").close()
    time.sleep(600)
if stage == "shards":            # after the second safetensors shard
    import safetensors.numpy as sn
    orig, count = sn.save_file, [0]
    def save_file(*a, **k):
        orig(*a, **k)
        count[0] += 1
        if count[0] == 2:
            stall()
    sn.save_file = save_file
else:                            # after orbax has written params/, before config.json
    import orbax.checkpoint as ocp
    orig, count = ocp.StandardCheckpointer.wait_until_finished, [0]
    def wait(self):              # save() itself waits first, for earlier saves
        orig(self)
        count[0] += 1
        if count[0] == 2:
            stall()
    ocp.StandardCheckpointer.wait_until_finished = wait
from dropless import cli
sys.exit(cli.main(sys.argv[3:]))
"""


def _killed_convert(tmp_path, stage, argv) -> None:
    """Run `dropless convert argv` until it stalls at `stage`, then SIGKILL it."""
    mark = tmp_path / "stalled"
    env = dict(os.environ, PYTHONPATH=SRC, JAX_PLATFORMS="cpu")
    p = subprocess.Popen([sys.executable, "-c", STALL, str(mark), stage, "convert", *argv],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.time() + 120
    while not mark.exists():
        assert p.poll() is None, p.stdout.read().decode()
        assert time.time() < deadline, "the convert never reached the stall point"
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait()
    p.stdout.close()


@pytest.fixture(scope="module")
def qwen_dropless(tmp_path_factory):
    out = tmp_path_factory.mktemp("conv") / "qwen"
    assert cli.main(["convert", str(FIX / "qwen3_moe"), str(out)]) == 0
    return out


def _partials(dst: Path) -> list[Path]:
    return sorted(dst.parent.glob(f".{dst.name}.partial-*"))


def test_export_killed_over_another_hf_folder_leaves_it_intact(qwen_dropless, tmp_path):
    dst = tmp_path / "hf_out"
    shutil.copytree(FIX / "mixtral", dst)        # an HF folder of another model
    before, src_before = snapshot(dst), snapshot(qwen_dropless)
    _killed_convert(tmp_path, "shards", [str(qwen_dropless), str(dst), "--overwrite",
                                         "--shard-size", "20000"])
    assert snapshot(dst) == before and snapshot(qwen_dropless) == src_before
    [part] = _partials(dst)
    assert len(list(part.glob("*.safetensors"))) == 2 and not (part / "config.json").exists()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        hf.load(part)
    # the next convert removes the dead writer's partial folder and replaces dst whole
    assert cli.main(["convert", str(qwen_dropless), str(dst), "--overwrite"]) == 0
    assert _partials(dst) == [] and not list(tmp_path.glob(".hf_out.old-*"))
    assert hf.read_config(dst)[0] == hf.read_config(FIX / "qwen3_moe")[0]
    assert not (dst / "model-00006-of-00006.safetensors").exists()   # nothing of mixtral's


def test_import_killed_over_a_dropless_dir_leaves_it_intact(qwen_dropless, tmp_path):
    dst = tmp_path / "dl"
    shutil.copytree(qwen_dropless, dst)
    before = snapshot(dst)
    _killed_convert(tmp_path, "params", [str(FIX / "mixtral"), str(dst), "--overwrite"])
    assert snapshot(dst) == before
    [part] = _partials(dst)
    assert (part / "params").is_dir() and not (part / "config.json").exists()
    from dropless.model_dir import load_dropless
    with pytest.raises(ValueError, match="no config.json"):
        load_dropless(part)
    from dropless.model_dir.weights import load_model
    cfg, params = load_model(str(dst))         # the old folder still loads, and is qwen
    assert cfg == hf.read_config(FIX / "qwen3_moe")[0]


def test_refusals_change_nothing(qwen_dropless, tmp_path, capsys):
    hf_copy = tmp_path / "hfcopy"
    shutil.copytree(FIX / "mixtral", hf_copy)
    link = tmp_path / "link"
    link.symlink_to(hf_copy)
    cases = [([str(hf_copy), str(hf_copy)], "is the source"),
             ([str(hf_copy), str(link)], "is the source"),
             ([str(hf_copy), f"{tmp_path}/x/../hfcopy"], "is the source"),
             ([str(hf_copy), str(hf_copy / "sub")], "inside the source"),
             ([str(hf_copy), str(tmp_path), "--overwrite"], "holds the source"),
             ([str(qwen_dropless), str(hf_copy)], "not empty; pass --overwrite")]
    before = snapshot(tmp_path)
    for argv, words in cases:
        assert cli.main(["convert", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("dropless: error: dropless convert") and words in err, err
        assert err.count("\n") == 1
    assert snapshot(tmp_path) == before


def test_exchange_replaces_in_one_step(tmp_path):
    """commit() swaps a complete folder in (renameat2 RENAME_EXCHANGE) and removes the old."""
    old, new = tmp_path / "dst", tmp_path / ".dst.partial-1"
    old.mkdir()
    (old / "a").write_text("old")
    new.mkdir()
    (new / "b").write_text("new")
    destination.commit(new, old)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]
    assert [p.name for p in old.iterdir()] == ["b"]


def test_tokenizer_travels_both_ways(tmp_path):
    from tests._support.tokenizer_folders import FOLDERS, write_folder
    src = tmp_path / "mix"
    shutil.copytree(FIX / "mixtral", src)
    write_folder(src, *FOLDERS["llama"])
    assert cli.main(["convert", str(src), str(tmp_path / "dl")]) == 0
    dl = tmp_path / "dl"
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (dl / name).read_bytes() == (src / name).read_bytes(), name
    from dropless.model_dir import folder_tokenizer
    assert folder_tokenizer(str(dl)) == str(dl / "tokenizer.json")
    assert cli.main(["convert", str(dl), str(tmp_path / "back")]) == 0
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "back" / name).read_bytes() == (src / name).read_bytes(), name
    a, b = hf.load(src)[1], hf.load(tmp_path / "back")[1]
    np.testing.assert_array_equal(np.asarray(a["embed"]["w_VD"]), np.asarray(b["embed"]["w_VD"]))


def test_generation_config_travels_without_a_tokenizer(tmp_path):
    """A folder with generation_config.json (the model's stop ids and sampling defaults) and no
    tokenizer.json: the file went only as a tokenizer's side file, so it was lost both ways."""
    src = tmp_path / "mix"
    shutil.copytree(FIX / "mixtral", src)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (src / name).unlink(missing_ok=True)
    (src / "generation_config.json").write_text('{"eos_token_id": [2, 7], "temperature": 0.6}')
    assert cli.main(["convert", str(src), str(tmp_path / "dl")]) == 0
    assert (tmp_path / "dl" / "generation_config.json").read_bytes() == \
        (src / "generation_config.json").read_bytes()
    assert not (tmp_path / "dl" / "tokenizer.json").exists()
    assert cli.main(["convert", str(tmp_path / "dl"), str(tmp_path / "back")]) == 0
    assert (tmp_path / "back" / "generation_config.json").read_bytes() == \
        (src / "generation_config.json").read_bytes()


def test_hf_save_refuses_a_non_empty_folder_unless_overwrite(tmp_path):
    cfg, params = hf.load(FIX / "qwen3_moe")
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    with pytest.raises(hf.DestinationError, match="not empty"):
        hf.save(cfg, params, dst)
    assert [p.name for p in dst.iterdir()] == ["keep.txt"]
    hf.save(cfg, params, dst, overwrite=True)           # replaced whole: keep.txt is gone
    assert not (dst / "keep.txt").exists() and hf.read_config(dst)[0] == cfg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_dtype_is_honoured_for_a_dropless_directory(qwen_dropless):
    from dropless.model_dir.weights import load_model
    cfg, params = load_model(str(qwen_dropless), dtype="bfloat16")
    assert cfg.dtype == cfg.weight_dtype == cfg.moe.weight_dtype == "bfloat16"
    ref_cfg, ref = hf.load(FIX / "qwen3_moe", dtype="bfloat16")   # what hf.load gives
    assert cfg == ref_cfg
    import jax
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


HOLD = ("import fcntl, os, sys, time\nfd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\nos.write(fd, str(os.getpid()).encode())\n"
        "print('held', flush=True)\ntime.sleep(60)\n")


def test_one_writer_per_destination_and_a_dead_one_never_blocks(tmp_path):
    """`claimed`: a second process is refused at once, naming the holder; once the holder is
    killed (-9) its lock is gone with it and the stale lock file is taken over; the lock file
    is removed by the writer that finishes; re-entrant within a process."""
    dst, lock = tmp_path / "out", tmp_path / ".out.lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(lock)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(destination.DestinationError,
                           match=rf"being written by another dropless process \(pid "
                                 rf"{holder.pid}\)"):
            with destination.claimed(dst):
                pass
    finally:
        holder.kill()
        holder.wait()
    assert lock.read_text() == str(holder.pid)          # left by the killed writer
    with destination.claimed(dst) as held:
        assert held == lock and lock.read_text() == str(os.getpid())
        with destination.claimed(tmp_path / "x" / ".." / "out"):   # the same destination
            pass
        assert lock.exists()
    assert not lock.exists() and sorted(os.listdir(tmp_path)) == []
    with destination.claimed(tmp_path / "new" / "deeper" / "out"):
        assert (tmp_path / "new" / "deeper").is_dir()
    assert not (tmp_path / "new").exists()              # folders made for the lock are gone
