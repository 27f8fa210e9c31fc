"""Data: hand-worked packing and batch addressing, determinism, held-out split, sources."""
import json

import numpy as np
import pytest

from dropless.data import corpus as data


def test_pack_and_batch_hand_worked(tmp_path):
    # two documents "ab", "cd" -> stream a b 0 c d 0 (6 tokens); seq_len 2 -> windows of 3
    # starting at 0 and 2: [a b 0], [0 c d]; (6 - 1) // 2 = 2 sequences.
    toks = data._pack([np.frombuffer(b"ab", np.uint8), np.frombuffer(b"cd", np.uint8)], 0,
                      np.uint8)
    assert toks.tolist() == [97, 98, 0, 99, 100, 0]
    assert data.num_sequences(toks, 2) == 2
    b = data.batch_at(toks, 0, batch_size=3, seq_len=2, seed=0, shuffle=False)
    # samples 0, 1, 2 -> sequences 0, 1, then 0 again (epoch 1)
    assert b.tolist() == [[97, 98, 0], [0, 99, 100], [97, 98, 0]]
    assert b.dtype == np.int32


def test_batches_are_a_function_of_the_index():
    toks = np.arange(1000, dtype=np.uint16)
    a = [data.batch_at(toks, i, batch_size=4, seq_len=16, seed=3) for i in range(20)]
    b = [data.batch_at(toks, i, batch_size=4, seq_len=16, seed=3) for i in reversed(range(20))]
    for x, y in zip(a, reversed(b)):
        np.testing.assert_array_equal(x, y)
    # each epoch visits every sequence exactly once (62 sequences; 62*4/4 = 62 samples)
    n = data.num_sequences(toks, 16)
    starts = np.concatenate([data.batch_at(toks, i, batch_size=2, seq_len=16, seed=3)[:, 0]
                             for i in range(n // 2)])
    assert sorted(starts.tolist()) == [16 * k for k in range(n)]
    other = data.batch_at(toks, 0, batch_size=4, seq_len=16, seed=4)
    assert not np.array_equal(other, a[0])


def test_batch_errors():
    with pytest.raises(ValueError, match="seq_len=10"):
        data.batch_at(np.zeros(5, np.uint8), 0, batch_size=1, seq_len=10, seed=0)
    with pytest.raises(ValueError, match="index=-1"):
        data.batch_at(np.zeros(50, np.uint8), -1, batch_size=1, seq_len=10, seed=0)


def test_eval_split_is_by_name_and_stable():
    names = [f"pkg/mod{i}.py" for i in range(2000)]
    held = [n for n in names if data.is_eval_document(n, 0.05)]
    assert 50 < len(held) < 150
    assert held == [n for n in reversed(names) if data.is_eval_document(n, 0.05)][::-1]


def test_stdlib_corpus_is_real_python():
    files = data.stdlib_files()
    assert len(files) > 100 and all(f.suffix == ".py" for f in files)
    assert any(f.name == "os.py" for f in files)


def test_text_jsonl_and_token_sources(tmp_path):
    (tmp_path / "a.txt").write_text("hello world " * 50)
    c = data.load_corpus(str(tmp_path / "a.txt"), eval_fraction=0.1)
    assert c.vocab_size == 256 and c.train_TOK.size + c.eval_TOK.size == 601
    assert bytes(c.train_TOK[:5]) == b"hello"

    lines = [json.dumps({"text": f"doc {i} " * 20}) for i in range(50)]
    (tmp_path / "d.jsonl").write_text("\n".join(lines))
    j = data.load_corpus(str(tmp_path / "d.jsonl"), eval_fraction=0.2)
    assert j.num_documents == 50 and j.eval_TOK.size > 0
    assert j.fingerprint() == data.load_corpus(str(tmp_path / "d.jsonl"),
                                               eval_fraction=0.2).fingerprint()

    arr = np.arange(3000, dtype=np.uint16) % 500
    np.save(tmp_path / "t.npy", arr)
    arr.tofile(tmp_path / "t.bin")
    n = data.load_corpus(str(tmp_path / "t.npy"), eval_fraction=0.1)
    bn = data.load_corpus(str(tmp_path / "t.bin"), eval_fraction=0.1, bin_dtype="uint16")
    assert n.vocab_size == 500
    np.testing.assert_array_equal(n.train_TOK, arr[:2700])
    np.testing.assert_array_equal(bn.eval_TOK, arr[2700:])


def test_source_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        data.load_corpus(str(tmp_path / "missing.txt"))
    (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(ValueError, match="line 1 has no 'text'"):
        data.load_corpus(str(tmp_path / "bad.jsonl"))
    (tmp_path / "tiny.txt").write_text("ab")
    with pytest.raises(ValueError, match="too small"):
        data.load_corpus(str(tmp_path / "tiny.txt"))
    with pytest.raises(ValueError, match="tokenizer='gpt2'"):
        data.make_tokenizer("gpt2")


def test_jsonl_lines_are_split_at_newlines_only(tmp_path):
    # U+2028 / U+0085 inside a text are legal in JSON written with ensure_ascii=False; Python's
    # str.splitlines would cut the line there. The reference: json.loads of each "\n" line.
    texts = ["a\u2028b " * 30, "c\x85d " * 30, "plain " * 30]
    (tmp_path / "u.jsonl").write_text(
        "".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts),
        encoding="utf-8")
    got = [t for _, t in data.text_documents(str(tmp_path / "u.jsonl"))]
    assert got == texts


def test_token_scan_in_chunks_finds_the_first_bad_id(tmp_path, monkeypatch):
    # positions 5 and 9 are bad; with 4-token chunks the first lies in the second chunk
    monkeypatch.setattr(data, "CHUNK", 4)
    toks = np.array([1, 2, 3, 4, 5, -7, 6, 7, 8, -1, 9], np.int32)
    assert data._first_position(toks, lambda c: c < 0) == int(np.flatnonzero(toks < 0)[0])
    assert data._first_position(toks, lambda c: c > 100) is None
    np.save(tmp_path / "t.npy", np.r_[np.zeros(10, np.int64), [256], np.ones(50, np.int64)])
    with pytest.raises(ValueError, match="token id 256 at position 10.*vocab_size=256"):
        data.load_corpus(str(tmp_path / "t.npy"), vocab_size=256)
    # without the model's vocabulary the largest id + 1 is the corpus's (as before)
    assert data.load_corpus(str(tmp_path / "t.npy")).vocab_size == 257


def test_other_suffixes_must_be_utf8_text(tmp_path):
    (tmp_path / "notes").write_text("some text " * 100)
    assert data.load_corpus(str(tmp_path / "notes")).num_documents == 1
    (tmp_path / "x.gz").write_bytes(b"\x1f\x8b\x08\x00" + bytes(range(256)) * 4)
    with pytest.raises(ValueError, match=r"^data='.*x.gz' line 1 is not valid UTF-8 "
                                         r"\(invalid start byte\); fix or remove that text$"):
        data.load_corpus(str(tmp_path / "x.gz"))


@pytest.mark.parametrize("bad, line, reason", [
    (b"caf\xe9 au lait\n", 3, "invalid continuation byte"),     # Latin-1, not UTF-8
    (b"bad \xff here\n", 3, "invalid start byte"),
    (b"\xed\xa0\x80 an encoded surrogate\n", 3, "invalid continuation byte"),
    (b"cut short \xe2\x82", 3, "unexpected end of data"),
])
def test_text_files_are_read_as_strictly_as_prepare_reads_them(tmp_path, bad, line, reason):
    """Text training reads (training's in-memory corpus, eval_data, a folder's files) refuse
    what `data prepare` refuses, in its words: the file, the line and Python's reason."""
    from dropless.data import readers
    good = b"one\r\ntwo\n" + "caf\u00e9 \u2028 ok\n".encode() * 50
    (tmp_path / "good.txt").write_bytes(good)
    # byte-exact, as prepare reads it: CRLF kept, U+2028 kept (the reference: bytes.decode)
    (name, text), = data.text_documents(str(tmp_path / "good.txt"))
    assert text == good.decode("utf-8")
    f = readers.InputFile(path=tmp_path / "good.txt", name="good.txt", kind="text", weight=1.0,
                          size=len(good))
    assert [t for c in readers.text_chunks(f, "text") for t in readers.chunk_texts(f, c, "text")
            ] == [text]
    t = tmp_path / "a.txt"
    t.write_bytes(b"fine\nfine\n" + bad)
    want = rf"a\.txt' line {line} is not valid UTF-8 \({reason}\); fix or remove that text$"
    with pytest.raises(ValueError, match=r"^data='[^']*" + want):
        data.load_corpus(str(t))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "b.md").write_bytes(good)
    t.rename(tmp_path / "d" / "a.txt")
    with pytest.raises(ValueError, match=r"^data='[^']*d': [^ ]*d/a\.txt line 3 is not valid"):
        data.load_corpus(str(tmp_path / "d"))
    tok = data.make_tokenizer("byte")
    with pytest.raises(ValueError, match="d/a.txt line 3 is not valid UTF-8"):
        data.document_tokens(str(tmp_path / "d"), tok)
    # the same words as `data prepare`'s reader (which names the path alone)
    f = readers.InputFile(path=tmp_path / "d" / "a.txt", name="a.txt", kind="text", weight=1.0,
                          size=0)
    with pytest.raises(ValueError, match=rf"d/a\.txt line {line} is not valid UTF-8 \({reason}"):
        list(readers.text_chunks(f, "text"))


def test_a_lone_surrogate_in_jsonl_is_named_by_line(tmp_path):
    """JSON can escape a lone surrogate ("\\ud800"), which is no Unicode text: refused naming the
    line, as `data prepare` refuses it, rather than failing inside the tokenizer."""
    ok = json.dumps({"text": "fine " * 20})
    (tmp_path / "d.jsonl").write_text(f'{ok}\n{ok}\n{{"text": "bad \\udc80 here"}}\n{ok}\n')
    with pytest.raises(ValueError, match=r"^data='[^']*d\.jsonl' line 3: the text holds a lone "
                                         r"surrogate '\\udc80' at character 4"):
        data.load_corpus(str(tmp_path / "d.jsonl"))
    with pytest.raises(ValueError, match=r"d\.jsonl' line 3: .*lone surrogate"):
        data.document_tokens(str(tmp_path / "d.jsonl"), data.make_tokenizer("byte"))
    # a surrogate pair escaped in JSON is one character, and fine
    (tmp_path / "p.jsonl").write_text('{"text": "pair \\ud83d\\ude00 ' + "ok " * 40 + '"}\n')
    (_, text), = data.text_documents(str(tmp_path / "p.jsonl"))
    assert text.startswith("pair \U0001f600 ")


def test_splits_are_checked_against_seq_len(tmp_path):
    (tmp_path / "a.txt").write_text("x" * 999)      # 999 bytes + EOS = 1000 tokens
    # eval_fraction 0.1: the cut is int(1000 * 0.9) = 900, so 100 eval tokens: one window of
    # 99 + 1 fits, none of 100 + 1; eval_fraction 0.9: int(1000 * (1 - 0.9)) = 99 train tokens
    assert data.load_corpus(str(tmp_path / "a.txt"), eval_fraction=0.1, seq_len=99)
    with pytest.raises(ValueError, match="the eval split holds 100 tokens.*seq_len=100"):
        data.load_corpus(str(tmp_path / "a.txt"), eval_fraction=0.1, seq_len=100)
    with pytest.raises(ValueError, match="the train split holds 99 tokens"):
        data.load_corpus(str(tmp_path / "a.txt"), eval_fraction=0.9, seq_len=100)


def test_only_the_splits_a_run_reads_are_checked_and_errors_name_the_argument(tmp_path):
    a = tmp_path / "a.txt"
    a.write_text("x" * 999)                          # 1000 tokens, cut at 900 (eval_fraction 0.1)
    # data= with eval_data=: only its train split is read, so a short eval split is no error
    c = data.load_corpus(str(a), eval_fraction=0.1, seq_len=100, splits=("train",))
    assert c.train_TOK.size == 900
    # eval_data=: all of it is held out, whatever eval_fraction says
    split = data.load_corpus(str(a), eval_fraction=0.1)
    whole = np.concatenate([split.train_TOK, split.eval_TOK])   # the file, cut by position
    for frac in (0.1, 0.9):
        ev = data.load_corpus(str(a), eval_fraction=frac, seq_len=100, key="eval_data",
                              splits=("eval",), held_out=True)
        np.testing.assert_array_equal(ev.eval_TOK, whole)
    with pytest.raises(ValueError, match=r"^eval_data='.*a\.txt' holds 1000 tokens, fewer than "
                                         r"one sequence of seq_len=1000 .*use more held-out"):
        data.load_corpus(str(a), seq_len=1000, key="eval_data", splits=("eval",), held_out=True)
    with pytest.raises(ValueError, match=r"^eval_data='.*nope\.txt' does not exist"):
        data.load_corpus(str(tmp_path / "nope.txt"), key="eval_data")
    (tmp_path / "t.bin").write_bytes(bytes(range(7)))
    with pytest.raises(ValueError, match=r"^eval_data='.*t\.bin' holds 7 bytes"):
        data.load_corpus(str(tmp_path / "t.bin"), key="eval_data")


def test_held_out_data_is_all_of_it_in_every_form(tmp_path):
    """eval_data= (held_out): a folder's documents, a token file and JSONL documents are the
    eval split whole, compared with the same data split by eval_fraction (train + eval)."""
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(40):
        (folder / f"d{i}.txt").write_text(f"document {i} " * (i + 1))
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("".join(json.dumps({"text": f"line {i} " * 5}) + "\n" for i in range(50)))
    tokens = tmp_path / "t.bin"
    np.arange(3000, dtype=np.uint16).tofile(tokens)
    for src in (folder, jsonl, tokens):
        split = data.load_corpus(str(src), eval_fraction=0.3, vocab_size=4096)
        assert split.train_TOK.size and split.eval_TOK.size
        ev = data.load_corpus(str(src), eval_fraction=0.3, vocab_size=4096, key="eval_data",
                              splits=("eval",), held_out=True)
        assert ev.eval_TOK.size == split.train_TOK.size + split.eval_TOK.size, src
        assert ev.train_TOK.size == 0
        if src == tokens:
            np.testing.assert_array_equal(ev.eval_TOK[0:ev.eval_TOK.size], np.arange(3000))
        else:   # the same documents: the same multiset of tokens
            np.testing.assert_array_equal(
                np.sort(np.asarray(ev.eval_TOK)),
                np.sort(np.concatenate([split.train_TOK, split.eval_TOK])))


def test_document_tokens_join_the_documents_with_eos(tmp_path):
    """Hand-worked with bytes (EOS 0): 'ab' and 'c', the empty document left out."""
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "ab"}\n{"text": ""}\n{"text": "c"}\n')
    tok = data.make_tokenizer("byte")
    got = data.document_tokens(str(path), tok)
    assert got.dtype == np.int32
    assert got.tolist() == [*tok.encode("ab").tolist(), tok.eos_id, *tok.encode("c").tolist(),
                            tok.eos_id]
    (tmp_path / "e.jsonl").write_text('{"text": ""}\n')
    with pytest.raises(ValueError, match=r"^data='.*e.jsonl' holds no text$"):
        data.document_tokens(str(tmp_path / "e.jsonl"), tok)
    with pytest.raises(ValueError, match=r"^dropless eval: --data=x holds no text$"):
        data.document_tokens(str(tmp_path / "e.jsonl"), tok, what="dropless eval: --data=x")


def test_jsonl_is_read_by_the_one_reader_compressed_too(tmp_path):
    """`text_documents` and `data prepare`'s reader give the same texts of the same JSONL lines,
    plain, gzip- and zstd-compressed; a line `prepare` refuses, training refuses the same way."""
    import gzip

    import zstandard

    from dropless.data import readers
    lines = [json.dumps({"text": t}) for t in ("a\r\nb", "c\u2028d", "é")]
    raw = ("\n".join(lines[:2]) + "\n\n" + lines[2] + "\r\n").encode()
    (tmp_path / "x.jsonl").write_bytes(raw)
    (tmp_path / "y.jsonl.gz").write_bytes(gzip.compress(raw))
    (tmp_path / "z.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    for name in ("x.jsonl", "y.jsonl.gz", "z.jsonl.zst"):
        docs = data.text_documents(str(tmp_path / name))
        assert [t for _, t in docs] == ["a\r\nb", "c\u2028d", "é"], name
        assert [n for n, _ in docs] == [f"{name}:0", f"{name}:1", f"{name}:3"]
        (f,) = readers.input_files(str(tmp_path / name))
        assert [t for c in readers.text_chunks(f, "text") for t in readers.chunk_texts(f, c, "text")
                ] == [t for _, t in docs]
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "a"}\n{"body": "b"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl' line 2 has no 'text' field \(its fields: "
                                         r"body\); training reads the 'text' field"):
        data.text_documents(str(tmp_path / "bad.jsonl"))


def test_a_text_folder_is_walked_as_prepare_walks_it(tmp_path):
    """Training's folder reader follows links to folders and refuses a link to nothing, as
    `data prepare` does (`readers.walk`); rglob skipped both without a word."""
    from dropless.data.corpus import text_documents
    (tmp_path / "d").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "d" / "a.txt").write_text("alpha")
    (tmp_path / "other" / "b.txt").write_text("beta")
    (tmp_path / "d" / "linked").symlink_to(tmp_path / "other")
    assert [t for _, t in text_documents(str(tmp_path / "d"))] == ["alpha", "beta"]
    (tmp_path / "d" / "gone.txt").symlink_to(tmp_path / "nowhere.txt")
    with pytest.raises(ValueError, match=r"data='.*d': .*gone\.txt is a link to nothing"):
        text_documents(str(tmp_path / "d"))
