"""The eval batches and the eval loss: a held-out split shorter than one batch counts each of its
sequences once (the rows that fill the batch by repeating it count no target), and the eval
loss is the mean over every target the batches count (batches that count different numbers
weigh by them), checked against a plain loop over the targets."""
from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from dropless.data import corpus as data_lib
from dropless.models import decoder
from dropless.parallel.mesh import train_mesh
from dropless.train import outputs, step
from dropless.train.progress import Progress
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


def _per_token_reference(params, cfg, batches) -> tuple[float, list[float], list[int]]:
    """The slow reference: (the mean over every counted target of every batch, each batch's
    own mean, each batch's count), each target's cross-entropy taken one at a time in float64
    from the model's logits."""
    forward = jax.jit(functools.partial(decoder.forward, cfg=cfg.model))
    total, count, means, counts = 0.0, 0, [], []
    for b in batches:
        logits = np.asarray(forward(params, b.tokens_BS, segment_ids_BS=b.segment_ids_BS,
                                    positions_BS=b.positions_BS)[0], np.float64)
        here, n = 0.0, 0
        for r in range(logits.shape[0]):
            for i in range(logits.shape[1]):
                if b.loss_mask_BS[r, i]:
                    row = logits[r, i]
                    lse = row.max() + np.log(np.sum(np.exp(row - row.max())))
                    here, n = here + lse - row[b.targets_BS[r, i]], n + 1
        total, count = total + here, count + n
        means.append(here / n)
        counts.append(n)
    return total / count, means, counts


def test_the_eval_loss_is_the_mean_over_every_counted_target(tmp_path):
    """packing="pad", two eval batches: the first of four whole documents (32 targets a row),
    the second of four short ones (4 targets a row, the rest padding). The eval loss is the
    split's per-token mean, not the mean of the two batches' means. (One dense layer: the
    weighting is what is checked, and it compiles fast.)"""
    cfg = mini(tmp_path, packing="pad", eval_batches=2, **{"model.num_layers": 1})
    s = cfg.seq_len
    lengths = [s + 1] * 4 + [5] * 4
    rng = np.random.default_rng(1)
    train, ev = (rng.integers(1, 256, n).astype(np.int64) for n in (4096, sum(lengths)))
    corpus = data_lib.Corpus(train_TOK=train, eval_TOK=ev, vocab_size=256, source="t",
                             num_documents=9, train_ends_D=np.array([train.size]),
                             eval_ends_D=np.cumsum(lengths))
    params = step.init_state(cfg)[0]["params"]
    evaluator = outputs.Evaluator(cfg, corpus, train_mesh(cfg.mesh), Progress(lambda _: None))
    got = evaluator(params)
    want, means, counts = _per_token_reference(params, cfg, evaluator.batches)
    assert counts == [4 * s, 4 * 4]
    assert got == pytest.approx(want, rel=2e-6, abs=0)
    assert abs(np.mean(means) - want) > 100 * 2e-6 * want   # what equal weights would give
