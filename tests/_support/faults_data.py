"""Fault rows: training data files that are wrong, refused in one line naming the file (and the
line or byte offset) before anything is compiled, leaving the data and the run folder as they
were. Every row runs `dropless train` in-process (the refusal comes before any JAX computation).
"""
import json
import os
from pathlib import Path

import numpy as np

from tests._support.fault import Fault, Result
from tests._support.prepared_data import write_prepared

# one step, no kernel timing: were a row's data accepted, the run stays short
TRAIN = ["train", "steps=1", "time_kernels=false", "eval_every=1", "run_dir=runs",
         "run_name=r"]
ENOUGH = "def f(x):\n    return x + 1\n" * 200   # ~5,800 bytes: every split is long enough


def _write(name: str, content):
    def setup(case: Path, _artifacts) -> None:
        path = case / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        elif isinstance(content, str):
            path.write_text(content)
        else:
            np.save(path, content)
    return setup


def _files(files: dict):
    def setup(case: Path, artifacts) -> None:
        for name, content in files.items():
            _write(name, content)(case, artifacts)
    return setup


def _no_run_left(case: Path, res: Result) -> None:
    runs = case / "runs"
    left = sorted(p.name for p in runs.iterdir()) if runs.is_dir() else []
    assert not left, f"a refused run left {left} under runs/"
    assert not runs.exists(), "a refused run left the run_dir it created (runs/)"
    assert "compil" not in (res.out + res.err).lower(), "refused only after compiling"


def _not_line_1(case: Path, res: Result) -> None:
    _no_run_left(case, res)
    assert "line 1" not in res.err, f"blames line 1: {res.err}"


def _jsonl(*lines: str) -> str:
    return "".join(line + "\n" for line in lines)


OK_LINE = json.dumps({"text": ENOUGH})


def row(id_, files, words, data, *extra, check=_no_run_left):
    return Fault(id_, TRAIN + [f"data={data}", *extra], rc=2, words=words,
                 setup=_files(files), unchanged=tuple(files), check=check, in_process=True,
                 timeout=300)


ROWS = [
    row("data-jsonl-text-number", {"d.jsonl": _jsonl(OK_LINE, '{"text": 5}')},
        ("d.jsonl", "line 2", "'text'", "string", "int"), "d.jsonl"),
    row("data-jsonl-text-null", {"d.jsonl": _jsonl(OK_LINE, '{"text": null}')},
        ("d.jsonl", "line 2", "'text'", "string", "null"), "d.jsonl"),
    row("data-jsonl-key-twice", {"d.jsonl": _jsonl(OK_LINE, '{"text": "a", "text": "b"}')},
        ("d.jsonl", "line 2", "key 'text' appears twice"), "d.jsonl"),
    row("data-jsonl-line-is-string", {"d.jsonl": _jsonl('"just a string"', OK_LINE)},
        ("d.jsonl", "line 1", "object", "'text'"), "d.jsonl"),
    row("data-jsonl-bad-json-line-2", {"d.jsonl": _jsonl(OK_LINE, '{"text": ', OK_LINE)},
        ("d.jsonl", "line 2", "json"), "d.jsonl", check=_not_line_1),
    # '{"text": "' is 10 bytes: the bad byte is at offset 10 of line 2
    row("data-jsonl-invalid-utf8",
        {"d.jsonl": b'{"text": "ok"}\n{"text": "\xff"}\n' + OK_LINE.encode() + b"\n"},
        ("d.jsonl", "utf-8", "column 11", "line 2"), "d.jsonl"),
    # text files are read as strictly as `data prepare` reads them: the file and the line
    row("data-text-invalid-utf8", {"a.txt": ENOUGH.encode() + b"bad \xff here\n"},
        ("a.txt", "line 401", "not valid utf-8", "invalid start byte"), "a.txt"),
    # an encoded surrogate (CESU-8 / WTF-8) is not UTF-8 either; in a folder, the file is named
    row("data-dir-text-encoded-surrogate",
        {"d/a.md": ENOUGH, "d/b.txt": b"ok\n\xed\xa0\x80 here\n" + ENOUGH.encode()},
        ("d/b.txt", "line 2", "not valid utf-8"), "d"),
    row("data-jsonl-lone-surrogate", {"d.jsonl": _jsonl(OK_LINE, '{"text": "bad \\ud800 here"}')},
        ("d.jsonl", "line 2", "lone surrogate"), "d.jsonl"),
    # named by the argument that gave it; data='s own held-out split (too short for seq_len at
    # the default eval_fraction) is not read when eval_data= is given, so it is not checked
    row("eval-data-text-invalid-utf8", {"one.txt": ENOUGH, "ev.txt": b"ok\n\xff\n" * 20},
        ("eval_data='ev.txt'", "line 2", "not valid utf-8"), "one.txt", "eval_data=ev.txt"),
    # eval_data= is held out whole: a 100-byte file is 101 tokens (with its end token), not
    # eval_fraction of them, and too short for seq_len=128 by that count
    row("eval-data-short-counted-whole", {"one.txt": ENOUGH, "ev.txt": "x" * 100},
        ("eval_data='ev.txt'", "holds 101 tokens", "seq_len=128", "more held-out data"),
        "one.txt", "eval_data=ev.txt", "seq_len=128"),
    row("eval-data-missing", {"one.txt": ENOUGH},
        ("eval_data='nope.txt'", "does not exist"), "one.txt", "eval_data=nope.txt"),
    row("data-bin-odd-size", {"t.bin": bytes(range(7))},
        ("t.bin", "7 bytes", "uint16", "multiple of 2"), "t.bin"),
    row("data-bin-empty", {"t.bin": b""}, ("t.bin", "empty"), "t.bin"),
    row("data-npy-negative-ids", {"t.npy": np.array([5, 3, -1] + [7] * 5000, np.int32)},
        ("t.npy", "-1", "negative", "position 2"), "t.npy"),
    row("data-npy-float-ids", {"t.npy": np.arange(5000, dtype=np.float32)},
        ("t.npy", "float32", "integer"), "t.npy"),
    row("data-npy-id-beyond-vocab", {"t.npy": np.array([1] * 3000 + [300] + [2] * 2000,
                                                       np.int32)},
        ("t.npy", "300", "position 3000", "model.vocab_size=256"), "t.npy"),
    row("data-bin-id-beyond-vocab",
        {"t.bin": np.array([1] * 3000 + [999] + [2] * 2000, np.uint16).tobytes()},
        ("t.bin", "999", "model.vocab_size=256"), "t.bin"),
    row("data-json-file", {"d.json": json.dumps([{"text": ENOUGH}])},
        ("d.json", "jsonl", "one json object per line"), "d.json"),
    row("data-dir-without-text-files", {"d/a.csv": "a,b\n1,2\n" * 500,
                                        "d/b.json": json.dumps({"text": ENOUGH})},
        ("'d'", "no file", ".csv", ".json", ".jsonl"), "d"),
    row("data-dir-empty-jsonl-only", {"d/a.jsonl": "\n\n"}, ("'d'", "no text"), "d"),
    row("data-eval-split-shorter-than-seq-len", {"one.txt": ENOUGH},
        ("one.txt", "eval split", "seq_len=128", "eval_fraction"), "one.txt",
        "eval_fraction=0.01"),
    row("data-train-split-shorter-than-seq-len", {"one.txt": "x = 1\n" * 30},
        ("one.txt", "train split", "seq_len=128"), "one.txt", "eval_fraction=0.5"),
]


# --- files that are not regular files, and prepared datasets (data/shards.py) ----------------

def _fifo(name: str):
    def setup(case: Path, _artifacts) -> None:
        os.mkfifo(case / name)
    return setup


def _prepared(change=None, vocab_size: int = 256, ids=None):
    """A prepared dataset `ds` (byte tokens, two train shards), then `change(ds)`."""
    def setup(case: Path, _artifacts) -> None:
        docs = [np.append(np.frombuffer(p.encode(), np.uint8), 0).astype(np.int64)
                for p in (ENOUGH * 2).split("\n") if p]
        if ids is not None:
            docs[0] = np.asarray(ids)
        write_prepared(case / "ds", {"train": [docs[:300], docs[300:700]],
                                     "eval": [docs[700:]]}, vocab_size=vocab_size)
        if change is not None:
            change(case / "ds")
    return setup


def _flip(name: str, at: int = 3):
    def change(ds: Path) -> None:
        b = bytearray((ds / name).read_bytes())
        b[at] ^= 1
        (ds / name).write_bytes(bytes(b))
    return change


def _both(*setups):
    def setup(case: Path, artifacts) -> None:
        for s in setups:
            s(case, artifacts)
    return setup


def _moved(setup, name: str):
    """`setup`'s prepared dataset `ds`, renamed `name` (so another `ds` can stand beside it)."""
    def moved(case: Path, artifacts) -> None:
        setup(case, artifacts)
        (case / "ds").rename(case / name)
    return moved


def prepared_row(id_, setup, words, *extra):
    return Fault(id_, TRAIN + ["data=ds", *extra], rc=2, words=words, setup=setup,
                 unchanged=("ds",), check=_no_run_left, in_process=True, timeout=300)


ROWS += [
    Fault("data-fifo", TRAIN + ["data=pipe.jsonl"], rc=2, words=("pipe.jsonl", "fifo"),
          setup=_fifo("pipe.jsonl"), check=_no_run_left, in_process=True, timeout=60),
    Fault("data-fifo-bin", TRAIN + ["data=pipe.bin"], rc=2, words=("pipe.bin", "fifo"),
          setup=_fifo("pipe.bin"), check=_no_run_left, in_process=True, timeout=60),
    Fault("data-char-device", TRAIN + ["data=/dev/zero"], rc=2,
          words=("/dev/zero", "character device", "regular files"), check=_no_run_left,
          in_process=True, timeout=60),
    prepared_row("prepared-shard-missing",
                 _prepared(lambda ds: (ds / "train-00001.tokens").unlink()),
                 ("train-00001.tokens", "missing", "prepare")),
    prepared_row("prepared-shard-cut-short",
                 _prepared(lambda ds: os.truncate(ds / "train-00000.tokens", 10)),
                 ("train-00000.tokens", "10 bytes", "manifest says", "prepare")),
    prepared_row("prepared-shard-changed", _prepared(_flip("train-00001.tokens")),
                 ("train-00001.tokens", "sha256", "changed since", "prepare")),
    prepared_row("prepared-docs-changed", _prepared(_flip("train-00000.docs", 0)),
                 ("train-00000.docs", "sha256", "changed since")),
    prepared_row("prepared-id-beyond-vocab", _prepared(ids=[5, 300, 0]),
                 ("train-00000.tokens", "300", "position 1", "model.vocab_size=256")),
    prepared_row("prepared-vocab-above-model", _prepared(vocab_size=1000),
                 ("manifest.json", "vocab_size=1000", "model.vocab_size=256"),
                 "model.vocab_size=256"),   # given: one not given is the manifest's
    # eval_data's vocabulary counts too: a given vocab_size below its manifest's, one line
    prepared_row("eval-data-prepared-vocab-above-model",
                 _both(_moved(_prepared(vocab_size=1000), "ev"), _prepared()),
                 ("model.vocab_size=256", "eval_data='ev'", "vocab_size=1000",
                  "ev/manifest.json"), "model.vocab_size=256", "eval_data=ev"),
    prepared_row("prepared-other-tokenizer", _both(_prepared(), _files({"tok/tokenizer.json": "{}"})),
                 ("manifest.json", "byte tokenizer", "tokenizer=byte"),
                 "tokenizer=tok/tokenizer.json"),
]
