"""`data.decoding`, the one decoder of users' records: a key named twice is refused (Python's json
keeps the last value silently), a byte-order mark starts a file without being content, and the
errors for common mistakes say what to do. Every case is checked against Python's own reading
(json.loads / utf-8-sig) where that reading is right."""
import codecs
import json

import pytest

from dropless.data import decoding


@pytest.mark.parametrize("text,key", [
    ('{"text": "a", "text": "b"}', "text"),
    ('{"text": "a", "meta": {"x": 1, "x": 2}}', "x"),
    ('{"text": "a", "t\\u0065xt": "b"}', "text"),   # the same key, escaped
    ('{"messages": [{"role": "user", "content": "a", "content": "b"}]}', "content"),
    ('[{"k": 1}, {"k": 1, "k": 1}]', "k"),        # the same value twice is still two keys
])
def test_a_key_named_twice_in_one_object_is_refused(text, key):
    with pytest.raises(decoding.DuplicateKey) as e:
        decoding.loads(text)
    assert e.value.key == key
    with pytest.raises(ValueError, match=rf"d.jsonl line 4: key '{key}' appears twice in one "
                                         r"object .*remove or rename one"):
        decoding.parse_jsonl_line(text.encode(), "d.jsonl line 4")


@pytest.mark.parametrize("text", [
    '{"a": {"x": 1}, "b": {"x": 2}, "c": [{"x": 3}, {"x": 4}]}',   # the same key, other objects
    '{"text": "a", "TEXT": "b", "t\\u0065xt2": 1}', '{}', '[]', '"s"', 'null', ' {"a": 1.5} ',
])
def test_what_json_loads_reads_is_read_the_same(text):
    assert decoding.loads(text) == json.loads(text)


def test_integers_of_any_length_keep_the_duplicate_check():
    assert decoding.loads('{"n": ' + "9" * 5000 + '}') == {"n": 10 ** 5000 - 1}
    with pytest.raises(decoding.DuplicateKey):
        decoding.loads('{"n": ' + "1" * 5000 + ', "n": 2}')


@pytest.mark.parametrize("data", [b"\xef\xbb\xbfab\r\nc", b"ab\r\nc", b"\xef\xbb\xbf",
                                  b"a\xef\xbb\xbfb", b"\xef\xbb\xbf\xef\xbb\xbfx"])
def test_a_text_file_reads_as_utf_8_sig_reads_it(data):
    """Only a leading mark is dropped (a second one, or one inside, is content), as Python's
    utf-8-sig codec does; nothing else changes (CRLF stays)."""
    assert decoding.decode_utf8(data, "t.txt") == codecs.decode(data, "utf-8-sig")


def test_a_bad_byte_after_a_bom_is_named_on_its_own_line():
    with pytest.raises(ValueError, match=r"t.txt line 2 is not valid UTF-8"):
        decoding.decode_utf8(b"\xef\xbb\xbfok\n\xff\n", "t.txt")


def test_utf_16_is_named_as_such():
    data = "hello\n".encode("utf-16")
    with pytest.raises(ValueError, match="the file is UTF-16.*save it as UTF-8"):
        decoding.decode_utf8(data, "t.txt")
    with pytest.raises(ValueError, match="d.jsonl line 1, column 1: not valid UTF-8.*UTF-16"):
        decoding.parse_jsonl_line('{"text": "a"}'.encode("utf-16"), "d.jsonl line 1")


@pytest.mark.parametrize("raw,words", [
    # a mark that is not at the start of the file (two files joined with cat)
    (b'\xef\xbb\xbf{"text": "a"}', "byte-order mark (U+FEFF) that is not at the start"),
    (b'{"text": "a\x00b"}', r"raw control character '\x00' inside a string; JSON writes it "
                            r"escaped (\u0000)"),
    (b'{"text": "a\tb"}', r"raw control character '\t'"),
    (b'{"text": "a"}\r{"text": "b"}', r"lone CR (\r)"),
    (b'{"text": "a"} x', "Extra data"),
])
def test_common_json_mistakes_say_what_to_do(raw, words):
    with pytest.raises(ValueError) as e:
        decoding.parse_jsonl_line(raw, "d.jsonl line 2")
    msg = str(e.value)
    assert msg.startswith("d.jsonl line 2, column ") and words in msg and "\n" not in msg, msg


def test_a_mark_inside_a_string_is_content():
    assert decoding.parse_jsonl_line('{"text": "\ufeffa"}'.encode(), "x")["text"] == "\ufeffa"


def test_json_object_files(tmp_path):
    p = tmp_path / "state.json"
    p.write_bytes(b'\xef\xbb\xbf{"_data_files": []}')
    assert decoding.json_object(p) == {"_data_files": []}
    p.write_text('{"_data_files": [1], "_data_files": []}')
    with pytest.raises(ValueError, match="state.json: key '_data_files' appears twice"):
        decoding.json_object(p)
    p.write_text("[]")
    with pytest.raises(ValueError, match="state.json: expected a JSON object"):
        decoding.json_object(p)
