"""data/loader.py: every packing's rows against a slow reference written per token, the same
rows from prepared shards as from memory, the prefetch thread, and process-local rows."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from dropless.data import corpus, loader, shards
from dropless.data.batch import Batch
from tests._support.prepared_data import random_docs, write_prepared

S, B = 16, 4


@pytest.fixture(scope="module")
def docs():
    return random_docs(np.random.default_rng(0), 120, hi=50)


def _stream(docs):
    toks = np.concatenate(docs)
    return toks, np.cumsum([d.size for d in docs])


def _documents_reference(toks, ends, lo):
    """Row of the window at `lo`, token by token: the document of each global position, the
    position inside it counted from the window's start or the document's, whichever is later."""
    doc = np.searchsorted(ends, np.arange(toks.size), side="right")   # document of each token
    seg, pos, mask = [], [], []
    for t in range(S):
        g = lo + t
        seg.append(int(doc[g] - doc[lo]) + 1)
        first = g
        while first > lo and doc[first - 1] == doc[g]:
            first -= 1
        pos.append(g - first)
        mask.append(1.0 if doc[g + 1] == doc[g] else 0.0)
    return toks[lo:lo + S], toks[lo + 1:lo + S + 1], seg, pos, mask


def test_stream_rows_are_bitwise_the_windows_runs_had(docs):
    toks, ends = _stream(docs)
    a = loader.Addressing(loader.as_stream(toks, ends), seq_len=S, packing="stream", seed=5)
    for i in (0, 3, 200):   # 200: past the first epoch
        got = a.rows(range(i * B, (i + 1) * B))
        ref = corpus.batch_at(toks, i, batch_size=B, seq_len=S, seed=5)
        np.testing.assert_array_equal(np.concatenate([got.tokens_BS, got.targets_BS[:, -1:]], 1),
                                      ref)
        assert got.segment_ids_BS.min() == 1 and got.loss_mask_BS.min() == 1


def test_documents_rows_reset_at_each_document_and_mask_the_crossing_target(docs):
    toks, ends = _stream(docs)
    a = loader.Addressing(loader.as_stream(toks, ends), seq_len=S, packing="documents", seed=5)
    stream = loader.Addressing(loader.as_stream(toks, ends), seq_len=S, packing="stream", seed=5)
    samples = range(0, 40)
    got, same = a.rows(samples), stream.rows(samples)
    np.testing.assert_array_equal(got.tokens_BS, same.tokens_BS)   # the same windows
    np.testing.assert_array_equal(got.targets_BS, same.targets_BS)
    crossed = 0
    for r, g in enumerate(samples):
        want = _documents_reference(toks, ends, a.item(g) * S)
        for field, w in zip(Batch._fields, want):
            np.testing.assert_array_equal(getattr(got, field)[r], np.asarray(w), err_msg=field)
        crossed += int(got.segment_ids_BS[r].max() > 1)
    assert crossed > 10            # the cases of interest occur


def test_pad_rows_hold_each_document_piece_once_then_padding(docs):
    toks, ends = _stream(docs)
    a = loader.Addressing(loader.as_stream(toks, ends), seq_len=S, packing="pad", seed=5,
                          shuffle=False)
    pieces = []    # reference: every document, cut into pieces of S + 1 overlapping by one
    for d in docs:
        for c in range(0, max(d.size - 1, 0), S):
            pieces.append(d[c:c + S + 1])
    assert a.n == len(pieces)
    got = a.rows(range(a.n))
    for r, w in enumerate(pieces):
        k = w.size - 1
        np.testing.assert_array_equal(got.tokens_BS[r, :k], w[:-1])
        np.testing.assert_array_equal(got.targets_BS[r, :k], w[1:])
        assert (got.tokens_BS[r, k:] == loader.PAD_ID).all()
        np.testing.assert_array_equal(got.segment_ids_BS[r], (np.arange(S) < k).astype(int))
        np.testing.assert_array_equal(got.loss_mask_BS[r], (np.arange(S) < k).astype(float))
        np.testing.assert_array_equal(got.positions_BS[r, :k], np.arange(k))


@pytest.mark.parametrize("packing", ["stream", "documents", "pad"])
def test_prepared_shards_give_the_rows_memory_gives(tmp_path, docs, packing):
    write_prepared(tmp_path / "ds", {"train": [docs[:50], docs[50:51], docs[51:]],
                                     "eval": [docs[:3]]})
    c = corpus.load_corpus(str(tmp_path / "ds"), vocab_size=256)
    toks, ends = _stream(docs)
    mem = loader.Addressing(loader.as_stream(toks, ends), seq_len=S, packing=packing, seed=9)
    disk = loader.Addressing(loader.as_stream(c.train_TOK), seq_len=S, packing=packing, seed=9)
    assert mem.n == disk.n
    for x, y in zip(mem.rows(range(64)), disk.rows(range(64))):
        np.testing.assert_array_equal(x, y)


def test_prefetch_gives_the_batches_of_building_them_in_turn(docs):
    toks, ends = _stream(docs)
    a = loader.Addressing(loader.as_stream(toks, ends), seq_len=S, packing="documents", seed=1)
    ahead = loader.Loader(a, batch_size=B, prefetch=3, start=7)
    try:
        for i in range(7, 20):
            for x, y in zip(ahead.next(), loader.Loader(a, batch_size=B).build(i)):
                np.testing.assert_array_equal(x, y)
        assert set(ahead.wait_s) == set(range(7, 20))
    finally:
        ahead.close()


@pytest.mark.parametrize("prefetch", [-1, -100, True, 2.0])
def test_a_prefetch_that_is_not_a_count_is_refused(docs, prefetch):
    """A negative prefetch ran as 0 (no thread) without a word; `True` as 1."""
    toks, ends = _stream(docs)
    a = loader.Addressing(loader.as_stream(toks, ends), seq_len=S, packing="documents", seed=1)
    with pytest.raises(ValueError, match=rf"Loader prefetch={prefetch!r} must be an int >= 0"):
        loader.Loader(a, batch_size=B, prefetch=prefetch)


def test_prefetch_holds_at_most_one_batch_more_than_it_queues(docs):
    """The memory the config's bound (config.names.MAX_PREFETCH) stands for: a loader that is
    never read builds `prefetch` batches for the queue and one more, then waits."""
    import time
    toks, ends = _stream(docs)
    a = loader.Addressing(loader.as_stream(toks, ends), seq_len=S, packing="documents", seed=1)
    built = []
    ld = loader.Loader(a, batch_size=B, prefetch=3, to_step=lambda b: built.append(1) or b)
    try:
        deadline = time.monotonic() + 10
        while len(built) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)
        assert len(built) == 4
    finally:
        ld.close()


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_loader_started_on_a_sample_builds_the_rows_from_there(docs, prefetch):
    # a resume with another global batch: batch 5 of 3 rows begins at sample 22
    toks, ends = _stream(docs)
    a = loader.Addressing(loader.as_stream(toks, ends), seq_len=S, packing="documents", seed=1)
    ld = loader.Loader(a, batch_size=3, prefetch=prefetch, start=5, first_sample=22)
    try:
        for i in range(5, 9):
            assert ld.sample_of(i) == 22 + 3 * (i - 5)
            for x, y in zip(ld.next(), a.rows(range(ld.sample_of(i), ld.sample_of(i) + 3))):
                np.testing.assert_array_equal(x, y)
    finally:
        ld.close()
    assert loader.Loader(a, batch_size=3, start=5).sample_of(6) == 18   # the run's own numbering


def test_an_error_while_prefetching_is_raised_by_the_batch_that_hit_it(tmp_path, docs):
    p = tmp_path / "t.bin"
    np.concatenate(docs).astype(np.uint16).tofile(p)
    f = shards.TokenFile(p, np.uint16, what="data='t.bin'")
    a = loader.Addressing(loader.as_stream(f), seq_len=S, packing="stream", seed=1)
    ld = loader.Loader(a, batch_size=B, prefetch=2)
    try:
        ld.next()
        p.unlink()
        with pytest.raises(shards.DataChanged, match="t.bin"):
            for _ in range(5):
                ld.next()
    finally:
        ld.close()


def test_each_process_builds_only_its_rows_of_the_global_batch(docs):
    """The rows a process builds are those its devices hold: here 4 devices of one process and a
    sharding over them, so all rows, in 4 blocks; the placed batch equals the one built whole."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    sh = NamedSharding(mesh, PartitionSpec("data"))
    assert loader.process_rows(sh, 8) == ((0, 2), (2, 4), (4, 6), (6, 8))
    assert loader.process_rows(None, 8) == ((0, 8),)
    toks, ends = _stream(docs)
    a = loader.Addressing(loader.as_stream(toks, ends), seq_len=S, packing="documents", seed=1)
    placed = loader.Loader(a, batch_size=8, sharding=sh).build(2)
    whole = a.rows(range(16, 24))
    for x, y in zip(placed, whole):
        assert x.sharding == sh
        np.testing.assert_array_equal(np.asarray(x), y)


def test_rows_held_by_devices_in_any_order_are_placed_where_they_belong(docs):
    """A 2-D mesh whose batch dim is split over (data, fsdp) with the devices listed out of
    order: every device's shard is cut from the process's blocks at its own rows; a
    device pair holding the same rows (a replicated axis) shares one block."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    devs = np.array(jax.devices()[:8])[[5, 2, 7, 0, 1, 6, 3, 4]].reshape(2, 2, 2)
    sh = NamedSharding(Mesh(devs, ("data", "fsdp", "rep")), PartitionSpec(("data", "fsdp")))
    assert loader.process_rows(sh, 8) == ((0, 2), (2, 4), (4, 6), (6, 8))
    toks, ends = _stream(docs)
    a = loader.Addressing(loader.as_stream(toks, ends), seq_len=S, packing="pad", seed=1)
    placed = loader.Loader(a, batch_size=8, sharding=sh).build(3)
    for x, y in zip(placed, a.rows(range(24, 32))):
        np.testing.assert_array_equal(np.asarray(x), y)
        for s_ in x.addressable_shards:
            np.testing.assert_array_equal(np.asarray(s_.data), y[s_.index])
