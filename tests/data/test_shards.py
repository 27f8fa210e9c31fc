"""data/shards.py: token files read by pread, a prepared split as one stream, and every change
underneath (truncation, rewrite, replacement) refused with DataChanged, never SIGBUS."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest

from dropless.data import corpus, shards
from tests._support.prepared_data import random_docs, write_prepared


def test_token_file_reads_what_numpy_reads(tmp_path):
    a = np.random.default_rng(0).integers(0, 60000, 5000).astype(np.uint16)
    p = tmp_path / "t.bin"
    a.tofile(p)
    f = shards.TokenFile(p, np.uint16)
    assert f.size == len(f) == 5000
    np.testing.assert_array_equal(f[10:4000], a[10:4000])
    np.testing.assert_array_equal(f[4990:9999], a[4990:])
    assert f[-1] == a[-1] and f[7] == a[7]
    v = f.view(100, 300)
    np.testing.assert_array_equal(v[5:10], a[105:110])
    np.testing.assert_array_equal(np.asarray(v), a[100:300])


@pytest.mark.parametrize("change", ["truncate", "rewrite", "replace", "remove"])
def test_a_file_changed_after_open_is_refused_not_sigbus(tmp_path, change):
    p = tmp_path / "t.bin"
    np.arange(4096, dtype=np.uint16).tofile(p)
    f = shards.TokenFile(p, np.uint16, what="data='t.bin'")
    f.read(0, 10)
    if change == "truncate":
        os.truncate(p, 100)
    elif change == "rewrite":
        time.sleep(0.01)
        np.arange(4096, dtype=np.uint16)[::-1].copy().tofile(p)
        os.utime(p, ns=(time.time_ns(), time.time_ns() + 10**9))
    elif change == "replace":
        q = tmp_path / "new.bin"
        np.arange(4096, dtype=np.uint16).tofile(q)
        os.replace(q, p)
    else:
        p.unlink()
    with pytest.raises(shards.DataChanged, match="t.bin.*changed since training started"):
        f.read(4000, 4096)


def test_fifos_and_devices_are_refused_at_once(tmp_path):
    fifo = tmp_path / "pipe.bin"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="FIFO"):
        shards.TokenFile(fifo, np.uint16)
    with pytest.raises(ValueError, match="pipe.bin is a FIFO"):
        corpus.load_corpus(str(fifo))
    with pytest.raises(ValueError, match="character device"):
        shards.check_regular(__import__("pathlib").Path("/dev/null"), "data")


def _prepared(tmp_path, rng, *, shards_train=3):
    docs = {"train": [random_docs(rng, 50) for _ in range(shards_train)],
            "eval": [random_docs(rng, 20)]}
    write_prepared(tmp_path / "ds", docs)
    return tmp_path / "ds", docs


def test_a_split_is_its_shards_concatenated_with_their_document_starts(tmp_path):
    rng = np.random.default_rng(1)
    folder, docs = _prepared(tmp_path, rng)
    c = corpus.load_corpus(str(folder), vocab_size=256)
    flat = np.concatenate([d for sh in docs["train"] for d in sh])
    ends = np.cumsum([d.size for sh in docs["train"] for d in sh])
    ss = c.train_TOK
    assert ss.size == flat.size and c.num_documents == 170
    for lo, hi in ((0, 7), (3, flat.size), (ss.base_K[1] - 5, ss.base_K[1] + 5), (0, 0)):
        np.testing.assert_array_equal(ss.read(int(lo), int(hi)), flat[lo:hi])
        want = ends[(ends > lo) & (ends <= hi) & (ends < flat.size)]
        np.testing.assert_array_equal(ss.starts_in(int(lo), int(hi)), want)
    assert list(np.concatenate(list(ss.document_lengths()))) == [d.size for sh in docs["train"]
                                                                 for d in sh]
    assert "prepared" in c.fingerprint()


def test_document_ends_search_past_the_index_block(tmp_path, monkeypatch):
    monkeypatch.setattr(shards, "INDEX_EVERY", 4)
    rng = np.random.default_rng(2)
    folder, docs = _prepared(tmp_path, rng, shards_train=1)
    ss = corpus.load_corpus(str(folder), vocab_size=256).train_TOK
    ends = np.cumsum([d.size for d in docs["train"][0]])
    for a in range(0, int(ends[-1]), 13):
        want = ends[(ends > a) & (ends <= a + 60) & (ends < ends[-1])]
        np.testing.assert_array_equal(ss.starts_in(a, a + 60), want)


def _break(folder, how):
    t = folder / "train-00001.tokens"
    if how == "missing":
        t.unlink()
    elif how == "short":
        os.truncate(t, t.stat().st_size - 2)
    elif how == "flipped":
        b = bytearray(t.read_bytes())
        b[3] ^= 1
        t.write_bytes(bytes(b))
    elif how == "docs":
        d = folder / "train-00000.docs"
        b = bytearray(d.read_bytes())
        b[0] ^= 1
        d.write_bytes(bytes(b))


@pytest.mark.parametrize("how,words", [("missing", "train-00001.tokens is missing"),
                                       ("short", "train-00001.tokens holds"),
                                       ("flipped", "train-00001.tokens's sha256 differs"),
                                       ("docs", "train-00000.docs's sha256 differs")])
def test_a_shard_changed_since_prepare_is_refused_naming_it(tmp_path, how, words):
    folder, _ = _prepared(tmp_path, np.random.default_rng(3))
    _break(folder, how)
    with pytest.raises(ValueError, match=words.replace(".", r"\.")):
        corpus.load_corpus(str(folder), vocab_size=256)


def test_ids_beyond_the_vocab_and_another_tokenizer_are_refused(tmp_path):
    folder, _ = _prepared(tmp_path, np.random.default_rng(4))
    with pytest.raises(ValueError, match="vocab_size=256 is larger than the model's"):
        corpus.load_corpus(str(folder), vocab_size=200)
    write_prepared(tmp_path / "big", {"train": [[np.array([5, 300, 0])]],
                                      "eval": [[np.array([1, 0])]]}, vocab_size=256)
    with pytest.raises(ValueError, match="token id 300 at position 1, beyond"):
        corpus.load_corpus(str(tmp_path / "big"), vocab_size=256)
    tj = tmp_path / "tokenizer.json"
    tj.write_text("{}")
    with pytest.raises(ValueError, match="prepared with the byte tokenizer.*tokenizer=byte"):
        corpus.load_corpus(str(folder), tokenizer=str(tj), vocab_size=256)


def test_a_large_text_source_gets_the_prepare_command(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "LARGE_TEXT_BYTES", 1000)
    p = tmp_path / "big.jsonl"
    p.write_text("".join(f'{{"text": "document {i} " }}\n' for i in range(200)))
    c = corpus.load_corpus(str(p))
    assert c.notes and f"dropless data prepare {p} " in c.notes[0]



def test_eval_data_replaces_the_held_out_split(tmp_path):
    folder, docs = _prepared(tmp_path, np.random.default_rng(5))
    other = tmp_path / "other.txt"
    other.write_text("x = 1\n" * 500)
    c = corpus.with_eval_split(corpus.load_corpus(str(other)),
                               corpus.load_corpus(str(folder), vocab_size=256, held_out=True))
    # a prepared eval_data is held out whole: its train shards, then its eval shards
    np.testing.assert_array_equal(c.eval_TOK[0:c.eval_TOK.size],
                                  np.concatenate([d for sh in docs["train"] + docs["eval"] for d in sh]))
    assert c.train_TOK.size == corpus.load_corpus(str(other)).train_TOK.size
