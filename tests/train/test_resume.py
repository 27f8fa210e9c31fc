"""Resume is transactional, run directories are unique, and the CLI turns errors into one line.

Each refused resume is checked to leave the run directory byte-identical;
the fault matrix with real signals and full disks is in test_train_faults.py.
"""
import json
import shutil

import pytest

from dropless import cli
from dropless import checkpoint as ckpt
from dropless.train import preflight, resume, rundir
from dropless.train.loop import train
from dropless.train.progress import Progress, Timed

from tests._support import ckpt_damage
from tests._support.train_mini import mini, shared_compilation_cache, snapshot

QUIET = dict(echo=lambda s: None)


@pytest.fixture(scope="module", autouse=True)
def compilation_cache(tmp_path_factory):
    yield from shared_compilation_cache(tmp_path_factory)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A finished 4-step run (checkpoints at 2 and 4)."""
    tmp = tmp_path_factory.mktemp("base")
    cfg = mini(tmp, steps=4, run_name="base", time_kernels=False)
    return cfg, train(cfg, **QUIET)


def copy_run(base, tmp_path, name):
    run = tmp_path / "runs" / name
    shutil.copytree(base[1].run_dir, run)
    return run


def test_resume_on_other_data_is_refused_and_changes_nothing(tmp_path, base):
    run = copy_run(base, tmp_path, "other")
    before = snapshot(run)
    (tmp_path / "other.txt").write_text("something else entirely\n" * 300)
    cfg = mini(tmp_path, steps=8, run_name="other", data=str(tmp_path / "other.txt"))
    with pytest.raises(ValueError, match=r"data=.*made on different data.*drop the data="):
        train(cfg, **QUIET)
    assert snapshot(run) == before
    # ... so the plain resume still works (it used to fail: config.json had the override)
    res = train(mini(tmp_path, steps=5, run_name="other", time_kernels=False), **QUIET)
    assert res.start_step == 4 and sorted(res.losses) == [5]


def test_data_edited_past_its_first_tokens_is_other_data(tmp_path, base):
    """The same length, the same first 4,096 tokens, one byte changed near the end: other
    data, refused, the run unchanged (the fingerprint digests every token of both splits)."""
    from tests._support.train_mini import TEXT
    run = copy_run(base, tmp_path, "edited")
    before = snapshot(run)
    edited = TEXT[:-100] + ("#" if TEXT[-100] != "#" else "%") + TEXT[-99:]
    assert len(edited) == len(TEXT)
    (tmp_path / "corpus.txt").write_text(edited)
    with pytest.raises(ValueError, match=r"made on different data .*sha256 .*restore the files"):
        train(mini(tmp_path, steps=8, run_name="edited"), **QUIET)
    assert snapshot(run) == before


def test_a_checkpoint_without_the_whole_data_digest_is_judged_by_the_rest():
    """Checkpoints written before the `sha256` digest name the data by counts and the head's
    CRC alone: those decide, so such a run still resumes on its own data."""
    now = {"train_tokens": 10, "eval_tokens": 2, "vocab_size": 256, "crc32": 7, "sha256": "ab"}
    old = {k: v for k, v in now.items() if k != "sha256"}
    assert resume.same_data(old, now) and resume.same_data(now, now)
    assert not resume.same_data({**old, "crc32": 8}, now)
    assert not resume.same_data({**now, "sha256": "cd"}, now)


def test_shape_mismatch_names_parameter_and_key_and_changes_nothing(tmp_path, base):
    run = copy_run(base, tmp_path, "shape")
    before = snapshot(run)
    cfg = mini(tmp_path, steps=8, run_name="shape", **{"model.moe.d_ff": 32})
    with pytest.raises(ValueError) as e:
        train(cfg, **QUIET)
    msg = str(e.value)
    assert "params/" in msg and "float32 with this config" in msg, msg
    assert "params/layers/1/moe/" in msg, msg
    assert "model.moe.d_ff (16 in the run's config.json, 32 now)" in msg, msg
    assert "\n" not in msg and len(msg) < 1000
    assert snapshot(run) == before


@pytest.mark.parametrize("steps", [4, 3])
def test_finished_run_says_nothing_to_do(tmp_path, base, steps):
    run = copy_run(base, tmp_path, f"done{steps}")
    before = snapshot(run)
    lines = []
    res = train(mini(tmp_path, steps=steps, run_name=f"done{steps}", learning_rate=0.5),
                echo=lines.append)
    assert res.nothing_to_do and res.losses == {} and res.start_step == 4
    assert len(lines) == 1 and lines[0].startswith("nothing to do:") and "steps=N" in lines[0]
    assert snapshot(run) == before


def test_more_steps_keep_the_learning_rate_schedule(tmp_path, base):
    run = copy_run(base, tmp_path, "longer")
    lines = []
    res = train(mini(tmp_path, steps=6, run_name="longer", time_kernels=False),
                echo=lines.append)
    assert sorted(res.losses) == [5, 6]
    assert any("keeps its horizon, lr_decay_steps=4" in s for s in lines), lines
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    lr = {r["step"]: r["lr"] for r in recs if r["event"] == "step"}
    # warmup 2, cosine to 1e-2 * 0.1 at step 4, constant after: no jump back up at step 5
    assert lr[5] == pytest.approx(1e-3) and lr[6] == pytest.approx(1e-3)
    assert lr[4] > lr[5] * 0.999
    saved = json.loads((run / "config.json").read_text())
    assert (saved["steps"], saved["lr_decay_steps"]) == (6, 4)


def test_explicit_lr_decay_steps_says_the_schedule_changes(tmp_path, base):
    run = copy_run(base, tmp_path, "stretch")
    cfg = mini(tmp_path, steps=8, run_name="stretch", lr_decay_steps=8)
    lines = []
    fp = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["corpus"]
    plan = resume.plan_resume(cfg, run, fp, stop_at=None, echo=lines.append)
    assert plan.cfg.lr_decay_steps == 8 and plan.start == 4
    assert lines == [] and len(plan.notes) == 1       # printed once every check has passed
    assert "changes the learning-rate schedule" in plan.notes[0]
    assert "goes from 0.001 to" in plan.notes[0]


def test_model_keys_changed_on_resume_are_stated(tmp_path, base):
    # parameters of the same shapes fit another top_k, scoring or scaling: the checkpoint
    # restores, and the run says which model keys it trains them under now
    run = copy_run(base, tmp_path, "topk")
    fp = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["corpus"]
    changed = mini(tmp_path, steps=8, run_name="topk", **{"model.moe.top_k": 1,
                                                           "model.moe.routed_scaling_factor": 2.5})
    plan = resume.plan_resume(changed, run, fp, stop_at=None, echo=print)
    said = [n for n in plan.notes if "model keys" in n]
    assert len(said) == 1 and "\n" not in said[0], plan.notes
    assert "model.moe.top_k (2 in the run's config.json, 1 now)" in said[0], said
    assert "model.moe.routed_scaling_factor (1.0 in the run's config.json, 2.5 now)" in said[0]
    same = resume.plan_resume(mini(tmp_path, steps=8, run_name="topk"), run, fp, stop_at=None,
                              echo=print)
    assert not [n for n in same.notes if "model keys" in n], same.notes


def test_run_dirs_are_unique_and_locked(tmp_path):
    cfg = mini(tmp_path)                      # no run_name: a timestamped directory
    a, b = rundir.open_run_dir(cfg), rundir.open_run_dir(cfg)
    assert a.path != b.path and a.path.is_dir() and b.path.is_dir()
    named = mini(tmp_path, run_name="x")
    c = rundir.open_run_dir(named)
    with pytest.raises(rundir.RunDirInUse, match="in use by another dropless process"):
        rundir.open_run_dir(named)
    c.release()
    rundir.open_run_dir(named).release()      # free again once released
    for r in (a, b):
        r.discard()
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["x"]


def test_run_failing_before_its_first_step_leaves_nothing(tmp_path):
    cfg = mini(tmp_path, data=str(tmp_path / "missing.txt"), run_name="")
    with pytest.raises(ValueError):
        train(cfg, **QUIET)
    assert not (tmp_path / "runs").exists()          # run_dir too: this run created it
    (tmp_path / "runs" / "other").mkdir(parents=True)    # one that was there stays
    with pytest.raises(ValueError):
        train(cfg, **QUIET)
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["other"]


def test_preflight_refuses_what_cannot_fit(tmp_path):
    cfg = mini(tmp_path, seq_len=100_000)
    est = preflight.estimate(cfg)
    big = max(preflight.PARTS, key=est.get)
    assert big in ("activations", "layer_workspace")  # the S x S attention scores
    assert est["total"] > 1000 * 2 ** 30
    with pytest.raises(preflight.DoesNotFit, match=rf"biggest term is {big} .*Lower "
                       r"seq_len or per_device_batch_size"):
        preflight.check(cfg, limit=24 * 2 ** 30, source="test")
    assert preflight.check(mini(tmp_path), limit=24 * 2 ** 30)["total"] < 2 ** 30


def run_cli(capsys, *argv):
    status = cli.main(list(argv))
    captured = capsys.readouterr()
    return status, captured.err.strip().splitlines()


def test_cli_errors_are_one_line(tmp_path, capsys):
    runs = f"run_dir={tmp_path / 'runs'}"
    status, err = run_cli(capsys, "train", "--resume", str(tmp_path / "nope"))
    assert status == 2 and len(err) == 1
    assert err[0].startswith("dropless: error: --resume ") and "does not exist" in err[0]
    status, err = run_cli(capsys, "train", "seq_len=100000", runs)
    assert status == 2 and len(err) == 1 and "biggest term is activations" in err[0]
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").iterdir())
    status, err = run_cli(capsys, "train", "steps=0", runs)
    assert status == 2 and err == ["dropless: error: TrainConfig.steps=0 must be a positive int"]
    with pytest.raises(ValueError, match="steps=0"):
        cli.main(["train", "steps=0", "--traceback"])


def test_cli_traceback_env(monkeypatch):
    monkeypatch.setenv("DROPLESS_TRACEBACK", "1")
    with pytest.raises(ValueError, match="steps=0"):
        cli.main(["train", "steps=0"])


def test_cli_runtime_errors_say_what_to_do(tmp_path):
    err = ckpt.explain(OSError(28, "No space left on device"), step=7,
                       directory=tmp_path / "r" / "checkpoints")
    status, msg = cli.describe(err)
    assert status == 1 and "no space left" in msg and f"--resume {tmp_path / 'r'}" in msg
    status, msg = cli.describe(OSError(28, "No space left on device"))
    assert status == 1 and msg.startswith("No space left on device (check the path")
    status, msg = cli.describe(RuntimeError("boom\nmore"))
    assert status == 1 and msg.splitlines()[0] == "RuntimeError: boom ..."
    assert "--traceback" in msg.splitlines()[1]


def test_progress_lines_without_a_terminal():
    lines = []
    p = Progress(lines.append)
    assert not p.bar                           # echo is not print: never a bar
    p.start(first=0, total=3)
    with Timed(p, "compiling (first step)", "compiled"):
        pass
    p.step(1, loss=1.0, tokens_per_s=10.0, text="step 1")
    p.step(2, loss=1.0, tokens_per_s=10.0, text=None)
    p.close()
    assert lines[0] == "compiling (first step)..." and lines[1].startswith("  compiled in ")
    assert lines[2:] == ["step 1"]


def test_progress_bar_keeps_step_lines_off_the_terminal(capsys):
    lines = []
    p = Progress(lines.append, bar=True)
    p.start(first=1, total=3)
    p.step(2, loss=1.5, tokens_per_s=10.0, text="STEP LINE")
    p.line("  eval loss 1.0 at step 2")
    p.close()
    out = capsys.readouterr().out
    assert lines == [] and "eval loss 1.0" in out and "STEP LINE" not in out
    assert "step 2/3" in out and "ETA" in out and "loss 1.5000" in out


def _flip_bits(step_dir):
    """One byte of the largest array chunk changed where the zstd frame still decodes, to
    other values (the chunks carry no checksum of their own; see tests/_support/ckpt_damage)."""
    ckpt_damage.flip_values(step_dir)


def test_flipped_bits_load_silently_without_the_hash_and_are_caught_with_it(tmp_path, base):
    from dropless.checkpoint import integrity
    from dropless.train import step as step_lib
    run = copy_run(base, tmp_path, "flip")
    _flip_bits(run / "checkpoints" / "4")
    like, _ = step_lib.init_state(base[0])
    mngr = ckpt.manager(run / "checkpoints", keep=5)
    try:
        state, meta = ckpt.restore(mngr, 4, like, verify=False)     # what orbax alone gives
        got = integrity.tree_hashes(state)
        changed = [k for k, h in meta["hashes"].items() if got[k] != h]
        assert len(changed) >= 1, "the flipped bits did not change any array"
        with pytest.raises(integrity.CheckpointDamaged, match=r"checkpoint 4 is damaged: "
                           r"the bytes of .* differ from the xxh3_64 hash") as e:
            ckpt.restore(mngr, 4, like)
        assert e.value.damage.reason == "hash-mismatch"
        # the intact step 2 verifies (the recorded hash is of the bytes that were saved)
        ckpt.restore(mngr, 2, like)
    finally:
        mngr.close()
    # xxh3-64 as the xxhash reference defines it, not only as this project computes it
    import numpy as np
    import xxhash
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert integrity.array_hash(a) == xxhash.xxh3_64(a.tobytes()).hexdigest()


def test_resume_over_a_damaged_step_continues_bitwise_from_the_intact_one(tmp_path, base):
    # the reference: an uninterrupted resume from step 2 (step 4 never existed)
    ref = copy_run(base, tmp_path, "ref")
    shutil.rmtree(ref / "checkpoints" / "4")
    expect = train(mini(tmp_path, steps=5, run_name="ref", time_kernels=False), **QUIET)
    bad = copy_run(base, tmp_path, "bad")
    _flip_bits(bad / "checkpoints" / "4")
    lines = []
    got = train(mini(tmp_path, steps=5, run_name="bad", time_kernels=False),
                echo=lines.append)
    assert got.start_step == expect.start_step == 2
    assert got.losses == expect.losses and got.eval_losses == expect.eval_losses   # bitwise
    said = [x for x in lines if "checkpoint 4 is damaged" in x]
    assert len(said) == 1 and "resuming from step 2" in said[0], lines
    moved = bad / "checkpoints" / "damaged" / "4-hash-mismatch"
    assert moved.is_dir() and (moved / "state").is_dir()          # set aside, not deleted
    # every array of the final state is bitwise the reference's (hashes of the saved arrays)
    hashes = [ckpt.read_meta(r / "checkpoints", 5)["hashes"] for r in (ref, bad)]
    assert hashes[0] == hashes[1] and len(hashes[0]) > 20
    recs = [json.loads(x) for x in (bad / "metrics.jsonl").read_text().splitlines()]
    fb = [r for r in recs if r["event"] == "fallback"]
    assert fb == [{"event": "fallback", "resumed_from": 2, "damaged": [
        {"step": 4, "reason": "hash-mismatch", "detail": fb[0]["damaged"][0]["detail"],
         "moved_to": "checkpoints/damaged/4-hash-mismatch"}]}]


@pytest.mark.parametrize("text, healed, said", [
    (b'{"a": 1}\n{"b": 2}\n', b'{"a": 1}\n{"b": 2}\n', None),
    (b'{"a": 1}\n{"b": 2', b'{"a": 1}\n', "7 bytes from line 2"),
    (b'{"a": 1}\n{"b": 2}', b'{"a": 1}\n{"b": 2}\n', "lacked the final newline"),
    (b'{"a": 1}\n\n{"b"', b'{"a": 1}\n', "from line 2"),
    (b'{"a', b'', "(line 0)"),
    (b'', b'', None),
])
def test_heal_metrics_cuts_a_torn_last_line(tmp_path, text, healed, said):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(text)
    msg = rundir.heal_metrics(path)
    assert path.read_bytes() == healed
    assert (msg is None) if said is None else (said in msg), msg
