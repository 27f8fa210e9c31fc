"""Users' bytes as text and JSON values: the one decoder of every record dropless reads (JSONL
lines for `data prepare`, training's corpus and SFT; text files; a dataset folder's JSON).

What is stricter than Python's own `json` / `bytes.decode`, and why:
* a JSON object that names a key twice (`{"text": "a", "text": "b"}`) is refused: `json` keeps
  the last value, which would drop part of a record without a word;
* a JSON number of any length is read (`int()` refuses past `sys.get_int_max_str_digits()`
  digits; JSON sets no limit);
* a UTF-8 byte-order mark (EF BB BF, as Windows tools and Excel write) at the start of a file is
  not content and is dropped (`strip_bom`; the readers call it for a file's first bytes only, as
  Python's `utf-8-sig` does); anywhere else it is content, and in JSON outside a string a mistake
  that the error names;
* text a tokenizer is given must be Unicode: a lone surrogate (JSON "\\ud800") is refused.

Every error is a ValueError starting with where the value came from (`at`: 'd.jsonl line 3').
A position inside a line is a column: 1-based, in characters, as an editor shows it (`column`).
On a file's first line a leading byte-order mark is not counted: editors take it for the file's
encoding and do not show it (VS Code, vim, Emacs, Notepad++), so column 1 is the character after
it, as on every other line column 1 is the line's first character.
"""
from __future__ import annotations

import decimal
import json
import sys
from pathlib import Path

UTF8_BOM = b"\xef\xbb\xbf"
UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")


class DuplicateKey(ValueError):
    """A JSON object names `key` twice."""

    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """The object of `pairs` (json's object_pairs_hook); DuplicateKey for a key named twice.
    The dict is built either way; only a dict shorter than its pairs looks for the key."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKey(key)
            seen.add(key)
    return obj


_DECODER = json.JSONDecoder(object_pairs_hook=_unique_keys)
_BIG_INT_DECODER = json.JSONDecoder(object_pairs_hook=_unique_keys,
                                    parse_int=lambda s: int(decimal.Decimal(s)))


def loads(text: str):
    """The JSON value of `text` (module doc: keys unique, integers of any length). Raises
    json.JSONDecodeError for text that is not JSON, DuplicateKey for a key named twice in one
    object, RecursionError for nesting deeper than the parser recurses."""
    try:
        return _DECODER.decode(text)
    except (json.JSONDecodeError, DuplicateKey):
        raise
    except ValueError:    # an integer too long for int(str); Decimal -> int has no such limit
        return _BIG_INT_DECODER.decode(text)


def column(line: bytes, at: int) -> int:
    """The column (module doc: 1-based, in characters) of byte `at` of `line`, a line's UTF-8
    bytes from its first character on (a file's leading byte-order mark already dropped). The
    bytes before `at` must be UTF-8: where `at` is the first byte that is not, each character
    before it counts once, as an editor shows them."""
    return len(line[:at].decode("utf-8")) + 1


def strip_bom(data: bytes) -> bytes:
    """`data` (the first bytes of a file) without a leading UTF-8 byte-order mark."""
    return data[len(UTF8_BOM):] if data.startswith(UTF8_BOM) else data


def _utf16_hint(data: bytes) -> str:
    return ("; the file is UTF-16 (it starts with a UTF-16 byte-order mark): save it as UTF-8"
            if data.startswith(UTF16_BOMS) else "")


def decode_utf8(data: bytes, at: str) -> str:
    """`data` (a text file's bytes) decoded as UTF-8, a leading byte-order mark dropped (module
    doc), byte-exact otherwise (no newline translation: CRLF stays CRLF, as in JSONL);
    ValueError naming `at` (the file) and the line of the first bytes that are not UTF-8 (an
    encoded surrogate included)."""
    data = strip_bom(data)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise utf8_error(data, e, at) from None


def utf8_error(data: bytes, e: UnicodeDecodeError, at: str, *, lines_before: int = 0,
               head: bytes | None = None) -> ValueError:
    """The error `decode_utf8` raises for `e`, raised decoding `data`: part of a text file after
    `lines_before` newlines, whose first bytes (a byte-order mark dropped) are `head` (None:
    `data` is the start)."""
    line = lines_before + data.count(b"\n", 0, e.start) + 1
    hint = _utf16_hint(data if head is None else head)
    return ValueError(f"{at} line {line} is not valid UTF-8 ({e.reason}); fix or remove that "
                      f"text{hint}")


def json_kind(value) -> str:
    """How an error names a JSON value's type: 'null', 'an int', 'a list', ..."""
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an int", float: "a float", str: "a string", list: "a list",
            dict: "an object"}.get(type(value), type(value).__name__)


def _invalid_json(e: json.JSONDecodeError, line: str, at: str) -> ValueError:
    """The one line for JSON that does not parse, with what a user can act on when the cause is
    a common one (a byte-order mark inside the file, a raw control character in a string, lines
    that end in a lone CR)."""
    pos = min(e.pos, len(line) - 1)
    if line[pos:pos + 1] == "\ufeff":
        why = ("a UTF-8 byte-order mark (U+FEFF) that is not at the start of the file (files "
               "joined together?); remove it")
    elif e.msg.startswith("Invalid control character"):
        why = (f"a raw control character {line[pos]!r} inside a string; JSON writes it escaped "
               f"(\\u{ord(line[pos]):04x})")
    elif "\r" in line.rstrip("\r"):
        why = (f"{e.msg}; the line holds a lone CR (\\r): JSONL lines end in \\n (or \\r\\n), "
               "so convert the file's line ends")
    else:
        why = e.msg
    return ValueError(f"{at}, column {e.colno}: invalid JSON ({why})")


def parse_jsonl_line(raw: bytes, at: str, text_field: str | None = None) -> dict:
    """The JSON object of one raw JSONL line (`loads`); ValueError naming `at` (file and line)
    for bytes that are not UTF-8, invalid JSON, a key named twice in one object, or a value
    that is not an object (with `text_field`, the message names the field it should hold)."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{at}, column {column(raw, e.start)}: not valid UTF-8 ({e.reason}); "
                         f"fix or remove that text{_utf16_hint(raw)}") from None
    try:
        rec = loads(line)
    except json.JSONDecodeError as e:
        raise _invalid_json(e, line, at) from None
    except DuplicateKey as e:
        raise ValueError(f"{at}: key {e.key!r} appears twice in one object (a JSON reader "
                         "keeps one value and drops the other); remove or rename one") from None
    except RecursionError:
        raise ValueError(f"{at} is nested deeper than Python's JSON parser reads (about "
                         f"{sys.getrecursionlimit()} levels of lists / objects); flatten or "
                         "remove that record") from None
    if not isinstance(rec, dict):
        holding = f" with a {text_field!r} field" if text_field else ""
        raise ValueError(f"{at} is {json_kind(rec)}, not a JSON object{holding} (JSONL: one "
                         "object per line)")
    return rec


def json_object(path: Path) -> dict:
    """The JSON object in the file `path` (read as `parse_jsonl_line` reads a line: a leading
    byte-order mark dropped, keys unique). Raises ValueError naming the file when it is not
    UTF-8, not valid JSON, names a key twice or is not an object."""
    raw = strip_bom(path.read_bytes())
    try:
        data = loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        line, start = raw.count(b"\n", 0, e.start) + 1, raw.rfind(b"\n", 0, e.start) + 1
        raise ValueError(f"{path}: not valid JSON (line {line}, column "
                         f"{column(raw[start:e.start], e.start - start)}: not UTF-8, {e.reason})"
                         ) from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: "
                         f"{e.msg})") from None
    except DuplicateKey as e:
        raise ValueError(f"{path}: key {e.key!r} appears twice in one object; remove or rename "
                         "one") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def record_text(rec: dict, text_field: str, at: str,
                hint: str = "choose the text field with --text-field") -> str:
    """rec[text_field], which must be a string; ValueError naming `at` and the fields there,
    ending with `hint` (what the user can do)."""
    if text_field not in rec:
        fields = ", ".join(sorted(map(str, rec))[:8]) or "none"
        raise ValueError(f"{at} has no {text_field!r} field (its fields: {fields}); {hint}")
    text = rec[text_field]
    if not isinstance(text, str):
        raise ValueError(f"{at}: {text_field!r} must be a string, not {json_kind(text)}")
    return text


def check_encodable(text: str, at: str) -> None:
    """Every text a tokenizer is given is valid Unicode: a lone surrogate (JSON "\\ud800")
    is refused naming `at`."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{at}: the text holds a lone surrogate {text[e.start]!r} at "
                         f"character {e.start} (not Unicode text); fix or remove that record"
                         ) from None
