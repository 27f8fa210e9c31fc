"""Odd inputs through every reader of users' records (`data prepare`'s chunks, `readers.records`
for SFT, training's in-memory corpus): each works exactly as its plain form does, or is refused
in one line naming the file and the line, row or column.

A byte-order mark at the start of a JSONL (plain, .gz, .zst) or text file gives the tokens the
file without it gives, while the manifest still records the SHA-256 of the bytes on disk; a key
named twice is refused by every reader; a Parquet / Arrow column named twice is refused (the
record dict kept one of them; the text column raised a KeyError)."""
import gzip
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from dropless.data import manifest as mf
from dropless.data import readers, sft
from dropless.data.corpus import text_documents
from dropless.data.prepare import PrepareConfig, prepare
from dropless.data.tokenizer import ByteTokenizer
from tests._support.reader_errors import reader_errors

BOM = b"\xef\xbb\xbf"
GOOD = b'{"text": "ok", "prompt": "Q", "completion": "A"}\n'    # a record every reader takes
LINES = b'{"text": "first"}\n\n{"text": "second \\u00e9"}\n{"text": "third"}\n'
COMPRESS = {".jsonl": lambda b: b, ".jsonl.gz": gzip.compress,
            ".jsonl.zst": zstandard.ZstdCompressor().compress}


def _prepared_tokens(tmp_path, src, name) -> list[list[int]]:
    """Every document's tokens of `data prepare` (byte tokens, nothing held out) of `src`, and
    a check that the manifest records the hash of the file's bytes on disk."""
    m = prepare(PrepareConfig(sources=(str(src),), out=str(tmp_path / name), workers=0,
                              eval_fraction=0.0), created_by="t")
    assert m.sources[0].sha256 == mf.file_sha256(src)
    docs = []
    for sh in m.splits["train"]:
        toks, ends = mf.open_shard(tmp_path / name, m, sh)
        docs += [toks[a:b].tolist() for a, b in zip(np.r_[0, ends[:-1]], ends)]
    return docs


@pytest.mark.parametrize("suffix", list(COMPRESS))
def test_a_bom_at_the_start_of_a_jsonl_file_gives_the_same_tokens(tmp_path, suffix):
    plain, marked = tmp_path / f"plain{suffix}", tmp_path / f"marked{suffix}"
    plain.write_bytes(COMPRESS[suffix](LINES))
    marked.write_bytes(COMPRESS[suffix](BOM + LINES))
    want = _prepared_tokens(tmp_path, plain, "a")
    assert len(want) == 3 and bytes(want[0][:-1]) == b"first"
    assert _prepared_tokens(tmp_path, marked, "b") == want
    (f,) = readers.input_files(str(marked))          # SFT's reader: the same records, indices
    (g,) = readers.input_files(str(plain))
    assert list(readers.records(f)) == list(readers.records(g))
    if suffix == ".jsonl":                           # training's in-memory corpus
        assert [t for _, t in text_documents(str(marked))] == ["first", "second é", "third"]


def test_a_bom_at_the_start_of_a_text_file_is_not_content(tmp_path):
    (tmp_path / "plain.txt").write_bytes(b"def f():\r\n    return 1\n")
    (tmp_path / "marked.txt").write_bytes(BOM + b"def f():\r\n    return 1\n")
    want = _prepared_tokens(tmp_path, tmp_path / "plain.txt", "a")
    assert _prepared_tokens(tmp_path, tmp_path / "marked.txt", "b") == want
    assert text_documents(str(tmp_path / "marked.txt")) == [("marked.txt",
                                                             "def f():\r\n    return 1\n")]


def test_a_bom_before_a_blank_first_line_leaves_it_blank(tmp_path):
    (tmp_path / "d.jsonl").write_bytes(BOM + b"\n" + LINES)
    (f,) = readers.input_files(str(tmp_path / "d.jsonl"))
    assert [i for i, _ in readers.records(f)] == [1, 3, 4]


def _every_reader(path, field="text"):
    """Read `path` as `data prepare`, SFT and training do; each must raise ValueError (returned,
    one per reader; training's `data='PATH'` written as PATH, as the others name it)."""
    return reader_errors(path, field, sft=lambda f: sft.read_examples(
        ((readers.where(f, i), r) for i, r in readers.records(f)), tok=ByteTokenizer(),
        template=None, source=str(path)))


@pytest.mark.parametrize("line,key", [
    (b'{"text": "kept", "text": "dropped before"}', "text"),
    (b'{"prompt": "Q", "completion": "A", "completion": "B", "text": "x"}', "completion"),
    (b'{"text": "x", "messages": [{"role": "user", "content": "a", "content": "b"}]}',
     "content"),
])
def test_a_key_named_twice_is_refused_by_every_reader(tmp_path, line, key):
    (tmp_path / "d.jsonl").write_bytes(GOOD + line + b"\n")
    for reader, msg in _every_reader(tmp_path / "d.jsonl").items():
        assert "d.jsonl line 2" in msg and f"key '{key}' appears twice" in msg, (reader, msg)
        assert "\n" not in msg


def test_a_bom_inside_the_file_is_named(tmp_path):
    (tmp_path / "d.jsonl").write_bytes(GOOD + BOM + GOOD)    # two files joined with cat
    for reader, msg in _every_reader(tmp_path / "d.jsonl").items():
        assert "d.jsonl line 2, column 1" in msg and "not at the start of the file" in msg, \
            (reader, msg)


def _arrow_file(path, table) -> None:
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)


@pytest.mark.parametrize("suffix", [".parquet", ".arrow"])
def test_a_column_named_twice_is_refused(tmp_path, suffix):
    table = pa.Table.from_arrays([pa.array(["a"]), pa.array(["b"]), pa.array([1])],
                                 names=["text", "text", "n"])
    path = tmp_path / f"d{suffix}"
    pq.write_table(table, path) if suffix == ".parquet" else _arrow_file(path, table)
    (f,) = readers.input_files(str(path))
    for read in (lambda: list(readers.records(f)), lambda: list(readers.text_chunks(f, "text"))):
        with pytest.raises(ValueError, match=rf"d{suffix}: column 'text' appears 2 times .its "
                                             r"columns: text, text, n.; .*rename"):
            read()
    other = pa.Table.from_arrays([pa.array(["a"]), pa.array([1]), pa.array([2])],
                                 names=["text", "n", "n"])
    pq.write_table(other, path) if suffix == ".parquet" else _arrow_file(path, other)
    (f,) = readers.input_files(str(path))
    assert [t for c in readers.text_chunks(f, "text") for t in readers.chunk_texts(f, c, "text")
            ] == ["a"]                                  # a twice-named column not read: fine
    with pytest.raises(ValueError, match="column 'n' appears 2 times"):
        list(readers.records(f))                        # ... but a record would hold it


# (file bytes, the texts read) for inputs that are odd but valid: each read exactly
EXACT = [
    (b'{"text": "a"}\r\n{"text": "b"}\r\n', ["a", "b"]),               # CRLF line ends
    (b'{"text": "a"}\n{"text": "b"}', ["a", "b"]),                     # no newline at the end
    (b'{"text": "a\\u0000b"}\n', ["a\x00b"]),                           # NUL, escaped as JSON says
    ('{"text": "a\u2028b\u0085c"}\n'.encode(), ["a\u2028b\u0085c"]),   # not line ends in JSONL
    (b'  {"text": "a"}\t\n', ["a"]),                                    # JSON whitespace around
    (b'{"text": "\\ud83d\\ude00"}\n', ["\U0001F600"]),                  # a surrogate pair
]


@pytest.mark.parametrize("data,texts", EXACT)
def test_odd_but_valid_jsonl_reads_exactly(tmp_path, data, texts):
    (tmp_path / "d.jsonl").write_bytes(data)
    (f,) = readers.input_files(str(tmp_path / "d.jsonl"))
    assert [t for c in readers.text_chunks(f, "text")
            for t in readers.chunk_texts(f, c, "text")] == texts
    assert [t for _, t in text_documents(str(tmp_path / "d.jsonl"))] == texts


def test_a_text_file_with_nul_bytes_is_its_bytes(tmp_path):
    (tmp_path / "t.txt").write_bytes(b"a\x00b\r\n")
    assert _prepared_tokens(tmp_path, tmp_path / "t.txt", "o") == [[97, 0, 98, 13, 10, 0]]


@pytest.mark.parametrize("data,words", [
    (GOOD + b'{"text": "a\xffb"}\n', "d.jsonl line 2, column 12: not valid UTF-8"),
    (GOOD + b'{"text": "a\x00b"}\n', "d.jsonl line 2, column 12: invalid JSON (a raw "
                                    r"control character '\x00'"),
    (GOOD + b'\x00\x00\n', "d.jsonl line 2, column 1: invalid JSON"),
    (GOOD + b'"a string"\n', "d.jsonl line 2 is a string, not a JSON object"),
    (GOOD + b'null\n', "d.jsonl line 2 is null, not a JSON object"),
    (GOOD + b'{"text": [1]}\n', "d.jsonl line 2: 'text' must be a string, not a list"),
    (b'{"text": "ok"}\r{"text": "b"}\r', r"d.jsonl line 1, column 16: invalid JSON (Extra data; "
                                         r"the line holds a lone CR (\r)"),
])
def test_bad_lines_are_refused_naming_file_and_line(tmp_path, data, words):
    (tmp_path / "d.jsonl").write_bytes(data)
    for reader, msg in _every_reader(tmp_path / "d.jsonl").items():
        if reader == "sft" and "'text'" in words:
            continue                                   # SFT reads no text field
        assert words in msg and "\n" not in msg, (reader, msg)


@pytest.mark.parametrize("content", [b"\n\n  \n", BOM, BOM + b"\r\n"])
def test_a_jsonl_file_of_no_record_says_so(tmp_path, content):
    (tmp_path / "d.jsonl").write_bytes(content)
    with pytest.raises(ValueError, match=r"source '.*d.jsonl' holds no document with text \(no "
                                         r"record at all: only blank lines"):
        prepare(PrepareConfig(sources=(str(tmp_path / "d.jsonl"),), out=str(tmp_path / "o"),
                              workers=0), created_by="t")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("records_per_chunk", [1, 3, 1024])
@pytest.mark.parametrize("chunk_bytes", [4, 40, 4 << 20])
@pytest.mark.parametrize("lines", [[b"{}"] * 50, [b'{"text": "%d"}' % i for i in range(40)],
                                   [b"{}", b"", b"{}"], [b"x" * 300]])
def test_max_chunks_bounds_the_chunks(tmp_path, monkeypatch, records_per_chunk, chunk_bytes,
                                      lines):
    """The bound `data prepare` caps its worker count by: never below the chunks read, for
    the shortest records ('{}'), blank lines and chunks cut by bytes."""
    monkeypatch.setattr(readers, "CHUNK_BYTES", chunk_bytes)
    for end in (b"\n", b""):
        (tmp_path / "d.jsonl").write_bytes(b"\n".join(lines) + end)
        (f,) = readers.input_files(str(tmp_path / "d.jsonl"))
        n = sum(1 for _ in readers.text_chunks(f, "text", records_per_chunk=records_per_chunk))
        assert n <= readers.max_chunks(f, records_per_chunk)
    (tmp_path / "d.jsonl.gz").write_bytes(gzip.compress(b"{}\n" * 10))
    (g,) = readers.input_files(str(tmp_path / "d.jsonl.gz"))
    assert readers.max_chunks(g, records_per_chunk) is None     # its size bounds nothing


def test_a_record_dict_of_a_jsonl_line_is_json_loads_of_it(tmp_path):
    recs = [{"text": "a", "n": 1, "meta": {"k": [1, {"x": None}]}}, {"text": "\u00e9"}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (f,) = readers.input_files(str(tmp_path / "d.jsonl"))
    assert [r for _, r in readers.records(f)] == recs
