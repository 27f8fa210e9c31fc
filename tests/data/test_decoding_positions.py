"""Where an error in a user's file says the mistake is: `line L, column C`, C 1-based in
characters as an editor shows the file on disk (`data.decoding`). A file that starts with a
UTF-8 byte-order mark shows in every editor without it (the mark names the encoding), so on
line 1 of such a file column 1 is the character after the mark, and the mark moves no position:
the same text with and without it gives the same message.

Every expected column is computed here from the raw bytes alone (`editor_column`: the marker's
offset by bytes.find, counting UTF-8 lead bytes, the mark not shown), never by the decoder.
Readers checked: `data prepare`'s chunks (in this process and in a worker process), SFT's
records and training's corpus, for plain, .gz and .zst JSONL; a dataset folder's JSON files
(`decoding.json_object`); text files (named by line). No other text format is read (no CSV /
TSV reader exists)."""
import gzip

import pytest
import zstandard

from dropless.data import decoding, readers
from dropless.data.prepare import PrepareConfig, prepare
from tests._support.reader_errors import reader_errors

BOM = b"\xef\xbb\xbf"
GOOD = '{"text": "ok"}'.encode()
COMPRESS = {".jsonl": lambda b: b, ".jsonl.gz": gzip.compress,
            ".jsonl.zst": zstandard.ZstdCompressor().compress}
# (a bad record, the bytes its error points at); characters of 1, 2 and 4 UTF-8 bytes come
# first, so a column counted in bytes (or a mark counted as a column) cannot pass
BAD = {
    "json": ('{"text": "é😀ü", "n": @}'.encode(), b"@"),
    "utf8": ('{"text": "é😀ü'.encode() + b'\xff"}', b"\xff"),
}


def editor_column(data: bytes, line: int, marker: bytes) -> int:
    """The column an editor shows for the first `marker` on 1-based `line` of the file `data`
    (bytes on disk, decompressed): 1 + the characters before it, a character being a UTF-8
    lead byte (not 10xxxxxx), and a leading byte-order mark of the file not shown."""
    raw = data.split(b"\n")[line - 1]
    before = raw[:raw.find(marker)]
    if line == 1 and before.startswith(BOM):
        before = before[len(BOM):]
    return 1 + sum(1 for b in before if b & 0xC0 != 0x80)


def _messages(path) -> dict[str, str]:
    """The error of each reader of `path` (module doc), training's `data='PATH'` as PATH."""
    return reader_errors(path, records=lambda f: list(readers.records(f)))


@pytest.mark.parametrize("suffix", list(COMPRESS))
@pytest.mark.parametrize("kind", list(BAD))
@pytest.mark.parametrize("line", [1, 2])
@pytest.mark.parametrize("bom", [BOM, b""])
def test_a_jsonl_error_names_the_column_an_editor_shows(tmp_path, suffix, kind, line, bom):
    record, marker = BAD[kind]
    data = bom + b"\n".join([GOOD] * (line - 1) + [record, GOOD]) + b"\n"
    path = tmp_path / f"d{suffix}"
    path.write_bytes(COMPRESS[suffix](data))
    col = editor_column(data, line, marker)
    assert col == (22 if kind == "json" else 14)      # by hand: 21 / 13 characters before it
    for reader, msg in _messages(path).items():
        assert f"d{suffix} line {line}, column {col}: " in msg and "\n" not in msg, (reader, msg)


def test_a_worker_process_reports_the_same_position(tmp_path):
    data = BOM + BAD["json"][0] + b"\n" + GOOD + b"\n"
    (tmp_path / "d.jsonl").write_bytes(data)
    col = editor_column(data, 1, b"@")
    with pytest.raises(ValueError, match=rf"d\.jsonl line 1, column {col}: invalid JSON"):
        prepare(PrepareConfig(sources=(str(tmp_path / "d.jsonl"),), out=str(tmp_path / "o"),
                              workers=1), created_by="t")


@pytest.mark.parametrize("line", [1, 2])
def test_a_duplicate_key_names_its_line_after_a_bom(tmp_path, line):
    record = b'{"text": "a", "text": "b"}'
    (tmp_path / "d.jsonl").write_bytes(BOM + b"\n".join([GOOD] * (line - 1) + [record]))
    for reader, msg in _messages(tmp_path / "d.jsonl").items():
        assert f"d.jsonl line {line}: key 'text' appears twice" in msg, (reader, msg)


@pytest.mark.parametrize("kind", list(BAD))
@pytest.mark.parametrize("line", [1, 2])
@pytest.mark.parametrize("bom", [BOM, b""])
def test_a_json_file_error_names_the_column_an_editor_shows(tmp_path, kind, line, bom):
    record, marker = BAD[kind]
    data = bom + b'{"a": 1,\n "b": ' * (line - 1) + record + b"}" * (line - 1)
    (tmp_path / "state.json").write_bytes(data)
    col = editor_column(data, line, marker)
    with pytest.raises(ValueError, match=rf"state\.json: not valid JSON \(line {line}, "
                                         rf"column {col}: "):
        decoding.json_object(tmp_path / "state.json")


@pytest.mark.parametrize("line", [1, 2, 3])
def test_a_text_file_error_names_its_line_after_a_bom(tmp_path, line):
    lines = [b"ok \xc3\xa9"] * 3
    lines[line - 1] = b"bad \xff here"
    (tmp_path / "t.txt").write_bytes(BOM + b"\r\n".join(lines))
    (f,) = readers.input_files(str(tmp_path / "t.txt"))
    with pytest.raises(ValueError, match=rf"t\.txt line {line} is not valid UTF-8"):
        list(readers.text_chunks(f, "text"))
