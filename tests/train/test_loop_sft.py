"""Training with sft=true: the trainer's batches are data.sft's rows (the loader's contract met
by data.sft.Addressing, checked against sft_batch_at, the reference), a resume is bitwise, and a
resume on other SFT records is refused."""
from __future__ import annotations

import json

import numpy as np
import pytest

from dropless.data import sft
from dropless.data.tokenizer import make_tokenizer
from dropless.train import loop
from tests._support.train_mini import mini, shared_compilation_cache


@pytest.fixture(scope="module", autouse=True)
def compilation_cache(tmp_path_factory):
    yield from shared_compilation_cache(tmp_path_factory)


def _write(path, n: int, salt: str = "") -> str:
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"Q{salt}{i}: {i} + {i} = ", "completion": f"{2 * i}."})
                    + "\n")
    return str(path)


def _cfg(tmp_path, data: str, **kw):
    return mini(tmp_path, data=data, sft=True, eval_fraction=0.1, **kw)


def test_the_loaders_rows_are_sft_batch_at_rows(tmp_path):
    data = _write(tmp_path / "d.jsonl", 80)
    corpus = sft.load_sft(data, tokenizer="byte", eval_fraction=0.1, seq_len=32, seed=3,
                          packing="documents")
    addr = sft.Addressing(corpus.train, seq_len=32, seed=3, completion_only=True)
    for index in (0, 1, addr.n):          # the last: the second epoch's first batch
        want = sft.sft_batch_at(corpus.train, index, batch_size=4, seq_len=32, seed=3)
        got = addr.rows(range(index * 4, index * 4 + 4))
        for w, g in zip(want, got):
            np.testing.assert_array_equal(w, g)
    # only completion targets count: the prompt's characters are never a counted target
    tok = make_tokenizer("byte")
    b = addr.rows(range(4))
    counted = b.targets_BS[b.loss_mask_BS > 0]
    assert counted.size and set(tok.decode(counted.tolist())) <= set("0123456789.") | {"\x00"}


def test_sft_training_resumes_bitwise_and_refuses_other_records(tmp_path):
    data = _write(tmp_path / "d.jsonl", 80)
    full = loop.train(_cfg(tmp_path, data, steps=4, run_name="full"), echo=lambda s: None)
    assert all(np.isfinite(v) for v in full.losses.values()) and len(full.losses) == 4
    part = _cfg(tmp_path, data, steps=4, run_name="part")
    loop.train(part, echo=lambda s: None, stop_at=2)
    resumed = loop.train(part, echo=lambda s: None)
    assert {n: resumed.losses[n] for n in (3, 4)} == {n: full.losses[n] for n in (3, 4)}
    other = _write(tmp_path / "e.jsonl", 80, salt="x")
    with pytest.raises(ValueError, match="data"):
        loop.train(_cfg(tmp_path, other, steps=6, run_name="part"), echo=lambda s: None)
