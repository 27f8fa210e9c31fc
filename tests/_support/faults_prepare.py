"""Fault rows: `dropless data prepare` on inputs that are wrong, refused in one line naming the
file and the line, row or column (exit 2), the input left as it was and nothing written (an
output folder the command created is removed again).
Every row runs in-process with --workers 0 (nothing is compiled; no worker start-up)."""
import json
from pathlib import Path

from tests._support.fault import Fault, Result

PREPARE = ["data", "prepare"]
OK = json.dumps({"text": "def f(x):\n    return x + 1\n"})


def _parquet(path: Path, columns: dict) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table(columns), path)


def _files(files: dict):
    def setup(case: Path, _artifacts) -> None:
        for name, content in files.items():
            path = case / name
            path.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, dict):
                _parquet(path, content)
            elif isinstance(content, bytes):
                path.write_bytes(content)
            else:
                path.write_text(content)
    return setup


def _no_dataset(case: Path, res: Result) -> None:
    out = case / "out"
    left = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    assert left in ([], ["notes.txt"]), f"a refused prepare left {left} in out/"
    if not left:
        assert not out.exists(), "a refused prepare left the folder it created"


def row(id_, files, words, *sources, extra=()):
    return Fault(f"prepare-{id_}", PREPARE + [*sources, "out", "--tokenizer", "byte",
                                              "--workers", "0", *extra],
                 rc=2, words=words, setup=_files(files), unchanged=tuple(files),
                 check=_no_dataset, in_process=True, timeout=120)


ROWS = [
    row("no-text-field", {"d.jsonl": OK + '\n{"body": "x"}\n'},
        ("d.jsonl line 2", "no 'text' field", "body", "--text-field"), "d.jsonl"),
    row("text-not-string", {"d.jsonl": OK + '\n{"text": [1]}\n'},
        ("d.jsonl line 2", "'text'", "string", "list"), "d.jsonl"),
    row("non-utf8-line", {"d.jsonl": (OK + '\n{"text": "\xff"}\n').encode("latin-1")},
        ("d.jsonl line 2", "utf-8"), "d.jsonl"),
    row("bad-json-line", {"d.jsonl.zst": __import__("zstandard").ZstdCompressor().compress(
        (OK + "\n" + OK + "\n{oops\n").encode())}, ("d.jsonl.zst line 3", "invalid json"),
        "d.jsonl.zst"),
    row("empty-source", {"ok.jsonl": OK + "\n", "e.jsonl": ""},
        ("e.jsonl", "empty", "0 bytes"), "ok.jsonl", "e.jsonl"),
    row("source-without-text", {"ok.jsonl": OK + "\n", "blank.jsonl": '{"text": ""}\n'},
        ("blank.jsonl", "holds no document"), "ok.jsonl", "blank.jsonl"),
    row("parquet-column-type", {"p.parquet": {"text": [1, 2, 3]}},
        ("p.parquet", "column 'text'", "int64", "not a string column"), "p.parquet"),
    row("parquet-no-column", {"p.parquet": {"body": ["a"]}},
        ("p.parquet", "no column 'text'", "body", "--text-field"), "p.parquet"),
    row("parquet-null", {"p.parquet": {"text": ["a", None]}},
        ("p.parquet row 1", "'text' is null"), "p.parquet"),
    row("glob-matches-nothing", {"ok.jsonl": OK + "\n"}, ("'data/*.parquet'", "matches no file"),
        "ok.jsonl", "data/*.parquet"),
    row("source-missing", {}, ("none.jsonl", "does not exist"), "none.jsonl"),
    row("bad-weight", {"ok.jsonl": OK + "\n"}, ("ok.jsonl@-1", "weight", "> 0"), "ok.jsonl@-1"),
    row("json-not-jsonl", {"d.json": "[]"}, ("d.json", "not jsonl"), "d.json"),
    row("tokenizer-missing", {"ok.jsonl": OK + "\n"}, ("--tokenizer", "hf:nowhere"),
        "ok.jsonl", extra=("--tokenizer", "hf:nowhere")),
    row("out-not-empty", {"ok.jsonl": OK + "\n", "out/notes.txt": "mine"},
        ("out", "not empty"), "ok.jsonl"),
    row("eval-fraction", {"ok.jsonl": OK + "\n"}, ("--eval-fraction", "[0, 1)"), "ok.jsonl",
        extra=("--eval-fraction", "1.5")),
    # Python's json keeps the last of two values silently: half the record's text was lost
    row("key-twice", {"d.jsonl": OK + '\n{"text": "a", "text": "b"}\n'},
        ("d.jsonl line 2", "key 'text' appears twice", "remove or rename"), "d.jsonl"),
    # a byte-order mark starts a file without a word; one inside (files joined) is named
    row("bom-inside", {"d.jsonl": (OK + "\n\ufeff" + OK + "\n").encode()},
        ("d.jsonl line 2", "byte-order mark", "not at the start of the file"), "d.jsonl"),
    row("workers-past-the-cap", {"ok.jsonl": OK + "\n"}, ("--workers=1000000", "1024"),
        "ok.jsonl", extra=("--workers", "1000000")),
]
