"""`data.prepare`: the shards equal a plain one-document-at-a-time reference (split, weights,
BOS / EOS, skipped documents), any worker count writes the same bytes, a killed run resumes to
the same dataset, and what must be refused is."""
import dataclasses
import json
import zlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from dropless.data import manifest as mf
from dropless.data import readers
from dropless.data.corpus import is_eval_document
from dropless.data.prepare import PrepareConfig, copies_of, prepare
from dropless.data.prepare_workers import raw_tokenizer
from tests._support.tokenizer_folders import FOLDERS, write_folder

WORDS = "the quick brown fox jumps over lazy dog stitch in time saves nine".split()


def _text(i: int) -> str:
    return " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(i % 23))   # i % 23 == 0: ""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    lines = [json.dumps({"text": _text(i), "n": i}) for i in range(300)]
    (d / "a.jsonl").write_text("\n".join(lines[:100]) + "\n\n")
    (d / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
        ("\n".join(lines[100:200]) + "\n").encode()))
    pq.write_table(pa.table({"text": [_text(i) for i in range(200, 300)]}), d / "c.parquet",
                   row_group_size=30)
    return d


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return write_folder(tmp_path_factory.mktemp("tok") / "llama", *FOLDERS["llama"])


def _cfg(corpus, out, **kw):
    srcs = (str(corpus / "a.jsonl"), str(corpus / "b.jsonl.zst") + "@1.5",
            str(corpus / "c.parquet") + "@0.5")
    return PrepareConfig(**{**dict(sources=srcs, out=str(out), eval_fraction=0.2,
                                   shard_tokens=300, workers=0, records_per_chunk=16), **kw})


def _reference(cfg):
    """Each record read one at a time and tokenized alone, as the module doc describes."""
    tok = raw_tokenizer(cfg.tokenizer)
    out = {"train": [], "eval": []}
    skipped = 0
    for spec in cfg.sources:
        for f in readers.input_files(spec):
            for idx, rec in readers.records(f):
                ids = (list(rec["text"].encode()) if tok is None
                       else tok.encode(rec["text"], add_special_tokens=False).ids)
                if not ids:
                    skipped += 1
                    continue
                doc = ([1] if cfg.add_bos else []) + ids + ([0 if tok is None else 2]
                                                            if cfg.add_eos else [])
                name = readers.identity(f, idx)
                if is_eval_document(name, cfg.eval_fraction):
                    out["eval"].append(doc)
                else:
                    out["train"] += [doc] * copies_of(name, f.weight)
    return out, skipped


def _documents(folder, m, split):
    docs = []
    for sh in m.splits[split]:
        toks, ends = mf.open_shard(folder, m, sh, verify_hash=True)
        assert toks.dtype == np.dtype(m.dtype)
        docs += [list(map(int, toks[a:b])) for a, b in zip(np.r_[0, ends[:-1]], ends)]
    return docs


@pytest.mark.parametrize("tokenizer", ["byte", "llama"])
def test_shards_equal_the_reference(corpus, llama, tmp_path, tokenizer):
    tok = "byte" if tokenizer == "byte" else str(llama / "tokenizer.json")
    cfg = _cfg(corpus, tmp_path / "out", tokenizer=tok,
               add_bos=None if tokenizer == "llama" else False)
    m = prepare(cfg, created_by="test")
    # the llama folder's post-processor puts <s> (id 1) first: BOS by default
    assert m.add_bos == (tokenizer == "llama") and m.add_eos
    want, skipped = _reference(dataclasses.replace(cfg, add_bos=m.add_bos))
    for split in ("train", "eval"):
        assert _documents(tmp_path / "out", m, split) == want[split], split
        assert m.num_documents[split] == len(want[split])
    assert sum(s.skipped for s in m.sources) == skipped == 14
    assert len(m.splits["train"]) > 3, "shard_tokens=300 cuts several shards"
    # a shard ends after the document (and its weighted copies) that brings it to 300
    assert all(sh.tokens < 300 + 2 * 140 for sh in m.splits["train"])
    assert m.dtype == "uint16" and m.vocab_size == (256 if tokenizer == "byte" else 120)
    assert [s.weight for s in m.sources] == [1.0, 1.5, 0.5]
    assert m.tokenizer.kind == ("byte" if tokenizer == "byte" else "hf")
    assert m.sources[2].sha256 == mf.file_sha256(corpus / "c.parquet")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        ["manifest.json"] + [n for s in m.splits.values() for sh in s
                             for n in (sh.tokens_file, sh.docs_file)])


def test_weights_are_stable_fractions():
    names = [f"f.jsonl:{i}" for i in range(4000)]
    half = sum(copies_of(n, 0.5) for n in names)
    assert 1800 < half < 2200
    assert [copies_of(n, 2.5) for n in names] == [2 + copies_of(n, 0.5) for n in names]
    assert {copies_of(n, 3.0) for n in names} == {3}
    assert copies_of("x", 0.5) == int(zlib.crc32(b"weight:x") < 2 ** 31)


def test_workers_write_the_same_bytes(corpus, tmp_path):
    a = prepare(_cfg(corpus, tmp_path / "w0"), created_by="t")
    b = prepare(_cfg(corpus, tmp_path / "w2", workers=2), created_by="t")
    assert a == b
    for p in (tmp_path / "w0").iterdir():
        assert (tmp_path / "w2" / p.name).read_bytes() == p.read_bytes(), p.name


class Killed(Exception):
    pass


def test_a_killed_run_resumes_to_the_same_dataset(corpus, tmp_path):
    whole = prepare(_cfg(corpus, tmp_path / "whole"), created_by="t")
    out = tmp_path / "out"
    calls = []

    def kill(p):
        calls.append(p)
        if p.shards >= 3:
            raise Killed

    import dropless.data.prepare as prep
    saved = prep.time.monotonic
    prep.time.monotonic = iter(range(0, 10 ** 6, 1)).__next__   # report every chunk
    try:
        with pytest.raises(Killed):
            prepare(_cfg(corpus, out), created_by="t", on_progress=kill)
    finally:
        prep.time.monotonic = saved
    assert not (out / "manifest.json").exists()
    state = json.loads((out / ".prepare" / "state.json").read_text())
    assert len(state["shards"]["train"]) >= 2
    # what a kill during a shard write leaves: a temporary file and an unrecorded shard
    (out / ".train-00009.tokens.tmp").write_bytes(b"half")
    (out / "train-00042.tokens").write_bytes(b"\x01\x00")
    with pytest.raises(ValueError, match="read_manifest|interrupted"):
        mf.read_manifest(out)
    seen = []
    m = prepare(_cfg(corpus, out), created_by="t", on_progress=seen.append)
    assert m == whole
    done = sum(sh["tokens"] for s in ("train", "eval") for sh in state["shards"][s])
    assert seen[-1].resumed_tokens == done > 0
    for p in (tmp_path / "whole").iterdir():
        assert (out / p.name).read_bytes() == p.read_bytes(), p.name
    assert not (out / ".prepare").exists() and not (out / "train-00042.tokens").exists()


def test_resume_refuses_changed_inputs_or_settings(corpus, tmp_path):
    src = tmp_path / "a.jsonl"
    src.write_text((corpus / "a.jsonl").read_text())
    cfg = PrepareConfig(sources=(str(src),), out=str(tmp_path / "out"), shard_tokens=200,
                        workers=0, records_per_chunk=8)

    def stop(p):
        if p.shards:
            raise Killed
    import dropless.data.prepare as prep
    saved = prep.time.monotonic
    prep.time.monotonic = iter(range(0, 10 ** 6, 1)).__next__
    try:
        with pytest.raises(Killed):
            prepare(cfg, created_by="t", on_progress=stop)
    finally:
        prep.time.monotonic = saved
    with pytest.raises(ValueError, match="unfinished prepare.*shard_tokens differs"):
        prepare(dataclasses.replace(cfg, shard_tokens=100), created_by="t")
    src.write_text(src.read_text() + '{"text": "more"}\n')
    with pytest.raises(ValueError, match="unfinished prepare.*input file changed"):
        prepare(cfg, created_by="t")


def test_refusals(corpus, tmp_path):
    out = tmp_path / "out"
    prepare(PrepareConfig(sources=(str(corpus / "a.jsonl"),), out=str(out), workers=0),
            created_by="t")
    with pytest.raises(ValueError, match="already holds a prepared dataset"):
        prepare(PrepareConfig(sources=(str(corpus / "a.jsonl"),), out=str(out), workers=0),
                created_by="t")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty"):
        prepare(PrepareConfig(sources=(str(corpus / "a.jsonl"),), out=str(tmp_path / "busy"),
                              workers=0), created_by="t")
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"
    blank = tmp_path / "blank.jsonl"
    blank.write_text('{"text": ""}\n')
    (tmp_path / "o2").mkdir()
    with pytest.raises(ValueError, match="blank.jsonl.*holds no document"):
        prepare(PrepareConfig(sources=(str(corpus / "a.jsonl"), str(blank)),
                              out=str(tmp_path / "o2"), workers=0), created_by="t")
    assert list((tmp_path / "o2").iterdir()) == [], "the refused run removed its shards"
    with pytest.raises(ValueError, match="--eval-fraction"):
        PrepareConfig(sources=("x",), out="o", eval_fraction=1.0)


def test_a_bad_record_is_named(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"txt": "no"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl line 2 has no 'text' field \(its fields: "
                                         r"txt\)"):
        prepare(PrepareConfig(sources=(str(bad),), out=str(tmp_path / "o"), workers=0),
                created_by="t")
    assert not (tmp_path / "o").exists(), "a refused run leaves the folder it created"
