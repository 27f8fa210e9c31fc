"""`readers.text_parts`: a text file read in parts gives exactly `_read_text`'s text (a leading
byte-order mark dropped, CRLF kept, CJK and emoji whole though their bytes straddle a part's
end), and the same one-line error naming the same line for bytes that are not UTF-8 wherever
they fall (inside a part, split across two, at the file's end); `streamed`, `text_size`."""
import pytest

from dropless.data import readers

TEXT = ("line one\r\nzwei \N{GRINNING FACE}\N{PARTY POPPER} 日本語\r\n\r\n"
        "   spaces   \tand tabs\n" + "é" * 7 + "\n") * 5


def _file(path) -> readers.InputFile:
    (f,) = readers.input_files(str(path))
    return f


def _whole_error(f) -> str:
    with pytest.raises(ValueError) as e:
        readers._read_text(f)
    return str(e.value)


@pytest.mark.parametrize("bom", [b"", b"\xef\xbb\xbf"])
@pytest.mark.parametrize("part", [1, 2, 3, 5, 7, 64])
def test_parts_joined_are_the_text(tmp_path, bom, part):
    (tmp_path / "a.txt").write_bytes(bom + TEXT.encode())
    f = _file(tmp_path / "a.txt")
    got = list(readers.text_parts(f, part))
    assert "".join(t for t, _ in got) == readers._read_text(f) == TEXT
    assert all(t for t, _ in got) and got[-1][1] == f.size
    assert [d for _, d in got] == sorted(d for _, d in got)
    assert readers.text_size(f) == len(TEXT.encode())


@pytest.mark.parametrize("bad", [b"\xe9", b"\xff", b"\xe2\x82", b"\xed\xa0\x80", b"\xc3"])
@pytest.mark.parametrize("where", [0, 1, 40, 41, 42, 43, 150, -1])
@pytest.mark.parametrize("part", [1, 3, 7, 1 << 20])
def test_bytes_that_are_not_utf8_give_the_whole_files_error(tmp_path, bad, where, part):
    data = TEXT.encode()
    at = len(data) if where == -1 else where
    (tmp_path / "b.txt").write_bytes(data[:at] + bad + data[at:])
    f = _file(tmp_path / "b.txt")
    want = _whole_error(f)
    with pytest.raises(ValueError) as e:
        list(readers.text_parts(f, part))
    assert str(e.value) == want and "\n" not in want and " line " in want


def test_a_utf16_file_is_named_as_such(tmp_path):
    (tmp_path / "u.txt").write_bytes("héllo\nwörld\n".encode("utf-16"))
    f = _file(tmp_path / "u.txt")
    with pytest.raises(ValueError, match="the file is UTF-16") as e:
        list(readers.text_parts(f, 3))
    assert str(e.value) == _whole_error(f)


def test_only_a_text_file_larger_than_a_chunk_is_streamed(tmp_path, monkeypatch):
    (tmp_path / "c.txt").write_text("x" * 100)
    (tmp_path / "c.jsonl").write_text('{"text": "' + "x" * 100 + '"}\n')
    t, j = _file(tmp_path / "c.txt"), _file(tmp_path / "c.jsonl")
    assert not readers.streamed(t) and readers.max_chunks(t) == 1
    monkeypatch.setattr(readers, "TEXT_WHOLE_BYTES", 99)
    assert readers.streamed(t) and not readers.streamed(j)
    assert readers.max_chunks(t) == 0 and readers.chunk_text_bytes(t, "text") == 0
