"""The eval batches: a held-out split shorter than one batch counts each of its sequences once
(the rows that fill the batch by repeating it count no target), so the eval loss is the
split's mean, whatever the packing."""
from __future__ import annotations

import numpy as np
import pytest

from dropless.data import corpus as data_lib
from dropless.train import outputs
from tests._support.train_mini import mini


def _corpus(eval_tokens: int) -> data_lib.Corpus:
    rng = np.random.default_rng(0)
    train, ev = (rng.integers(1, 256, n).astype(np.int64) for n in (4096, eval_tokens))
    return data_lib.Corpus(train_TOK=train, eval_TOK=ev, vocab_size=256, source="t",
                           num_documents=2, train_ends_D=np.array([train.size]),
                           eval_ends_D=np.array([ev.size]))


@pytest.mark.parametrize("packing", ["stream", "documents", "pad"])
def test_a_split_shorter_than_a_batch_counts_each_sequence_once(tmp_path, packing):
    cfg = mini(tmp_path, packing=packing)
    b, s = cfg.global_batch_size, cfg.seq_len
    assert b == 4
    # 3 sequences of S + 1 tokens (stream / documents windows, pad pieces) for a batch of 4:
    # row 3 repeats sequence 0 and must count nothing, or sequence 0 weighs twice
    (batch,) = outputs.eval_batches(cfg, _corpus(3 * s + 1))
    assert batch.tokens_BS.shape == (b, s)
    np.testing.assert_array_equal(batch.loss_mask_BS.sum(axis=1), [s, s, s, 0])
    # (step.eval_loss divides the masked sum by the counted targets: the split's mean)
    distinct = {batch.tokens_BS[r].tobytes() for r in range(3)}
    assert len(distinct) == 3 and batch.tokens_BS[3].tobytes() in distinct


def test_a_split_of_whole_batches_is_read_as_before(tmp_path):
    cfg = mini(tmp_path, packing="stream", eval_batches=2)
    corpus = _corpus(9 * cfg.seq_len + 1)          # 9 windows: two whole batches of 4
    got = outputs.eval_batches(cfg, corpus)
    want = data_lib.eval_batches(corpus, num_batches=2, batch_size=4, seq_len=cfg.seq_len)
    assert len(got) == 2
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
