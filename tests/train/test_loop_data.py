"""Training on prepared datasets and token files: a resume is bitwise, every step records how
long it waited for its batch, and a data file changed under the run stops it in one error with a
checkpoint of the last step (never SIGBUS)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from dropless import report
from dropless.data.shards import DataChanged
from dropless.train import loop
from tests._support.prepared_data import write_prepared
from tests._support.train_mini import TEXT, mini, shared_compilation_cache


@pytest.fixture(scope="module", autouse=True)
def compilation_cache(tmp_path_factory):
    yield from shared_compilation_cache(tmp_path_factory)


def _docs(text: str) -> list[np.ndarray]:
    """One document per function of TEXT, as bytes followed by EOS 0."""
    return [np.append(np.frombuffer(p.encode(), np.uint8), 0).astype(np.int64)
            for p in text.split("\n\n") if p]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    d = _docs(TEXT)
    out = tmp_path_factory.mktemp("prep") / "ds"
    write_prepared(out, {"train": [d[:250], d[250:380]], "eval": [d[380:]]})
    return out


def _records(run_dir, event):
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if r["event"] == event]


def test_a_resume_on_a_prepared_dataset_is_bitwise(tmp_path, prepared):
    cfg = mini(tmp_path, data=str(prepared), steps=4, run_name="full")
    full = loop.train(cfg, echo=lambda s: None)
    steps = _records(full.run_dir, "step")
    assert all(r["input_wait_s"] >= 0 for r in steps) and len(steps) == 4
    part = mini(tmp_path, data=str(prepared), steps=4, run_name="part")
    loop.train(part, echo=lambda s: None, stop_at=2)
    resumed = loop.train(part, echo=lambda s: None)
    assert resumed.start_step == 2
    assert {n: resumed.losses[n] for n in (3, 4)} == {n: full.losses[n] for n in (3, 4)}
    start = _records(full.run_dir, "start")[0]
    assert "prepared" in start["corpus"]
    shown = report.summary(report.read_metrics(full.run_dir), skip=0)["median_input_wait_s"]
    assert shown == float(np.median([r["input_wait_s"] for r in steps]))


def test_a_token_file_truncated_under_the_run_stops_it_with_a_checkpoint(tmp_path, monkeypatch):
    """(A replaced or rewritten file is refused the same way: data/test_shards.py.)"""
    path = tmp_path / "tokens.bin"
    np.frombuffer(TEXT.encode(), np.uint8).astype(np.uint16).tofile(path)
    cfg = mini(tmp_path, data=str(path), steps=8, checkpoint_every=0, prefetch=0,
               run_name="cut")
    read = loop._read_metrics
    seen = []

    def read_then_change(m):
        seen.append(1)
        if len(seen) == 2:          # step 2 is read: the file is cut before batch 4 is built
            os.truncate(path, 64)
        return read(m)

    monkeypatch.setattr(loop, "_read_metrics", read_then_change)
    with pytest.raises(DataChanged, match=r"tokens\.bin changed since training started.*"
                                          r"stopped after step \d with a checkpoint"):
        loop.train(cfg, echo=lambda s: None)
    run = tmp_path / "runs" / "cut"
    stopped = _records(run, "stopped")
    assert stopped and stopped[0]["reason"] == "data changed"
    saved = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    assert saved == [stopped[0]["step"]]
