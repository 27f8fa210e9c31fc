"""Training data: a corpus tokenized into one stream per split, packed into fixed-length
sequences, served as deterministic batches addressed by step number.

Legend: B batch, S sequence length (inputs; each row holds S + 1 tokens for the shifted targets).

Determinism: batch `i` is a pure function of (corpus, seed, i): sample g = i * B + j of the run
is sequence perm_e[g mod n] where n is the number of packed sequences, e = g // n the epoch and
perm_e a permutation seeded by (seed, e). The data position in a checkpoint is therefore just the
next batch index, and a resumed run sees exactly the batches it would have seen.

Sources: "stdlib" (the Python standard library's own .py files: real text on every machine, no
download), a text file, a directory of text files, a JSONL file (a "text" field per line), or
pre-tokenized tokens (.npy, or raw .bin of `bin_dtype`), memory-mapped.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import sysconfig
import zlib
from pathlib import Path

import numpy as np

from dropless.data.tokenizer import make_tokenizer

TEXT_SUFFIXES = (".txt", ".py", ".md", ".rst", ".text")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Corpus:
    """Token streams for training and held-out evaluation."""
    train_TOK: np.ndarray
    eval_TOK: np.ndarray
    vocab_size: int
    source: str
    num_documents: int

    def fingerprint(self) -> dict:
        """Identifies the corpus in a checkpoint, so a resume on different data is refused.
        The path is left out: moving the same data elsewhere does not change the batches."""
        head = np.asarray(self.train_TOK[:4096]).astype(np.int64)
        return {"train_tokens": int(self.train_TOK.size),
                "eval_tokens": int(self.eval_TOK.size), "vocab_size": self.vocab_size,
                "crc32": int(zlib.crc32(head.tobytes()))}


def stdlib_files() -> list[Path]:
    """The standard library's .py files (site-packages excluded), sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if "site-packages" not in p.parts]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def is_eval_document(name: str, eval_fraction: float) -> bool:
    """A stable, order-independent split: a document is held out by the CRC32 of its name."""
    return zlib.crc32(name.encode("utf-8")) % 10_000 < eval_fraction * 10_000


def _pack(docs: list[np.ndarray], eos: int, dtype) -> np.ndarray:
    parts = []
    for d in docs:
        parts += [d.astype(dtype, copy=False), np.array([eos], dtype)]
    return np.concatenate(parts) if parts else np.zeros((0,), dtype)


def _where(source: str, path: Path) -> str:
    """How an error names a file: `data='d.jsonl'`, or `data='corpus/': corpus/a.jsonl`."""
    return f"data={source!r}" if Path(source) == path else f"data={source!r}: {path}"


def _json_kind(value) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an int", float: "a float", str: "a string", list: "a list",
            dict: "an object"}.get(type(value), type(value).__name__)


def _utf8(raw: bytes, where: str) -> str:
    """`raw` decoded as UTF-8; ValueError naming the byte offset and line of the first bad byte."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ValueError(f"{where} is not valid UTF-8 at byte {e.start} (line {line}): "
                         f"{e.reason}") from None


def _jsonl_documents(path: Path, source: str) -> list[tuple[str, str]]:
    """(name, text) per non-blank line of a JSONL file: each line one JSON object whose "text"
    is a string. Raises ValueError naming the file and the line (or byte) that is wrong."""
    where = _where(source, path)
    docs = []
    # split at "\n" only: str.splitlines would also split inside a line at U+2028 and friends
    for i, line in enumerate(_utf8(path.read_bytes(), where).split("\n")):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where} line {i + 1}, column {e.colno}: invalid JSON ({e.msg})"
                             ) from None
        if not isinstance(rec, dict):
            raise ValueError(f"{where} line {i + 1} is {_json_kind(rec)}, not an object with a "
                             "'text' field (JSONL: one JSON object per line)")
        if "text" not in rec:
            raise ValueError(f"{where}: line {i + 1} has no 'text' field")
        if not isinstance(rec["text"], str):
            raise ValueError(f"{where} line {i + 1}: 'text' must be a string, not "
                             f"{_json_kind(rec['text'])} ({json.dumps(rec['text'])[:40]})")
        docs.append((f"{path.name}:{i}", rec["text"]))
    return docs


def _not_jsonl(source: str, path: Path) -> ValueError:
    return ValueError(
        f"{_where(source, path)} is a .json file, which dropless does not read: training text "
        "is JSONL (.jsonl, one JSON object per line with a \"text\" field), plain text "
        f"({', '.join(TEXT_SUFFIXES)}) or token ids (.npy, .bin); e.g. "
        f"`jq -c '.[]' {path.name} > {path.stem}.jsonl` for a list of records")


def _directory_files(path: Path, source: str) -> list[Path]:
    """The files of a directory source that are read (text and JSONL, sorted); ValueError when
    there are none, saying what the directory holds instead."""
    files = sorted(p for p in path.rglob("*")
                   if p.suffix in TEXT_SUFFIXES + (".jsonl",) and p.is_file())
    if files:
        return files
    found: dict[str, int] = {}
    for p in path.rglob("*"):
        if p.is_file():
            found[p.suffix or "(no suffix)"] = found.get(p.suffix or "(no suffix)", 0) + 1
    holds = ", ".join(f"{n} {suffix}" for suffix, n in sorted(found.items())) or "nothing"
    raise ValueError(f"data={source!r} holds no file dropless reads ({', '.join(TEXT_SUFFIXES)}"
                     f", .jsonl); it holds {holds}" + ("; a .json file is not JSONL (one JSON "
                     "object per line, suffix .jsonl)" if ".json" in found else "")
                     + "; token files (.npy, .bin) are given one at a time: data=FILE")


def text_documents(source: str) -> list[tuple[str, str]]:
    """(name, text) documents of a text/JSONL source or directory, in sorted order. Text files
    of a known suffix are read with undecodable bytes replaced (as the stdlib corpus is); a file
    of another suffix must be UTF-8 text. Raises ValueError for a .json file, a directory with
    nothing to read, and a bad JSONL line."""
    path = Path(source)
    if path.is_dir():
        return [doc for f in _directory_files(path, source) for doc in text_documents(str(f))]
    if path.suffix == ".jsonl":
        return _jsonl_documents(path, source)
    if path.suffix == ".json":
        raise _not_jsonl(source, path)
    if path.suffix in TEXT_SUFFIXES:
        return [(path.name, path.read_text(encoding="utf-8", errors="replace"))]
    return [(path.name, _utf8(path.read_bytes(), _where(source, path)))]


def document_tokens(source: str, tok, *, what: str = "") -> np.ndarray:
    """One int32 token stream of the documents of `source` (a text/JSONL file or directory, see
    `text_documents`), each encoded by `tok` (BOS as the tokenizer says) and followed by its
    EOS id; documents that encode to nothing are left out. Raises ValueError, starting with
    `what` (default `data=SOURCE`), when no document holds a token."""
    docs = [tok.encode(text) for _, text in text_documents(source)]
    docs = [d for d in docs if d.size]
    if not docs:
        raise ValueError(f"{what or f'data={source!r}'} holds no text")
    return _pack(docs, tok.eos_id, np.int32)


def _split_tokens(tokens: np.ndarray, eval_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    cut = int(tokens.size * (1 - eval_fraction))
    return tokens[:cut], tokens[cut:]


CHUNK = 1 << 24   # tokens scanned at a time when checking a token file's ids


def _first_position(toks: np.ndarray, bad) -> int | None:
    """Index of the first token where `bad(chunk)` holds, scanning in chunks (a memory-mapped
    file is never loaded whole), or None."""
    for lo in range(0, toks.size, CHUNK):
        hit = np.flatnonzero(bad(np.asarray(toks[lo: lo + CHUNK])))
        if hit.size:
            return lo + int(hit[0])
    return None


def _open_tokens(path: Path, source: str, bin_dtype: str) -> np.ndarray:
    """The 1-D integer token array of a .npy or .bin file, memory-mapped. Raises ValueError for
    an empty file, a .bin size that is not a whole number of `bin_dtype` tokens, an unreadable
    .npy, a non-integer dtype or more than one dimension."""
    size = path.stat().st_size
    if size == 0:
        raise ValueError(f"data={source!r} is empty (0 bytes)")
    if path.suffix == ".bin":
        item = np.dtype(bin_dtype).itemsize
        if size % item:
            raise ValueError(f"data={source!r} holds {size} bytes, not a multiple of {item} "
                             f"(bin_dtype={bin_dtype}: {item} bytes per token); set bin_dtype "
                             "to the type the file was written with")
        return np.memmap(path, dtype=np.dtype(bin_dtype), mode="r")
    try:
        toks = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise ValueError(f"data={source!r} is not a readable .npy file ({e})") from None
    if not isinstance(toks, np.ndarray):
        raise ValueError(f"data={source!r} must hold one array, not an archive of several")
    if not np.issubdtype(toks.dtype, np.integer):
        raise ValueError(f"data={source!r} holds {toks.dtype} values; token ids must be "
                         "integers (save them as uint16, int32 or int64)")
    if toks.ndim != 1:
        raise ValueError(f"data={source!r} must hold a 1-D token array; shape {toks.shape}")
    if toks.size == 0:
        raise ValueError(f"data={source!r} holds no tokens")
    return toks


def _check_ids(toks: np.ndarray, source: str, vocab_size: int | None) -> None:
    """Token ids are >= 0 and, when `vocab_size` is given, < vocab_size; ValueError naming the
    first id that is not and its position."""
    if np.issubdtype(toks.dtype, np.signedinteger):
        at = _first_position(toks, lambda c: c < 0)
        if at is not None:
            raise ValueError(f"data={source!r} holds a negative token id, {int(toks[at])} at "
                             f"position {at}")
    if vocab_size is not None:
        at = _first_position(toks, lambda c: c >= vocab_size)
        if at is not None:
            raise ValueError(f"data={source!r} holds token id {int(toks[at])} at position {at}, "
                             f"beyond the model's vocabulary (model.vocab_size={vocab_size})")


def load_corpus(source: str = "stdlib", *, tokenizer: str = "byte", eval_fraction: float = 0.02,
                bin_dtype: str = "uint16", vocab_size: int | None = None,
                seq_len: int | None = None) -> Corpus:
    """Tokenize and pack `source` (see the module docstring) into train and eval streams.

    Documents are held out by name (`is_eval_document`); a single document or a token file is
    split by position (the last `eval_fraction` is held out). A token file's ids must lie in
    [0, vocab_size) (`vocab_size`: the model's; when None, the largest id + 1 is the corpus's
    vocabulary and only negative ids are refused). With `seq_len`, each split must hold at least
    one sequence of seq_len + 1 tokens (checked here, before anything is compiled). Raises
    ValueError naming the file (and line, byte offset or token position) for a missing,
    unsupported or malformed source, and the split for one too short.
    """
    path = Path(source)
    if source != "stdlib" and not path.exists():
        raise ValueError(f"data={source!r} does not exist (use 'stdlib' or a local path)")
    if path.suffix in (".npy", ".bin") and not path.is_dir():
        toks = _open_tokens(path, source, bin_dtype)
        _check_ids(toks, source, vocab_size)
        train, ev = _split_tokens(toks, eval_fraction)
        return _checked(Corpus(train_TOK=train, eval_TOK=ev, vocab_size=int(np.max(toks)) + 1,
                               source=source, num_documents=1), seq_len, eval_fraction)
    tok = make_tokenizer(tokenizer)
    if source == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        docs = [(p.relative_to(root).as_posix(), p) for p in stdlib_files()]
        read = lambda p: p.read_text(encoding="utf-8", errors="replace")  # noqa: E731
    else:
        docs = text_documents(source)
        read = lambda t: t  # noqa: E731
    if not any(d.strip() if isinstance(d, str) else True for _, d in docs):
        raise ValueError(f"data={source!r} holds no text (every document in it is empty)")
    dtype = np.uint8 if tok.vocab_size <= 256 else np.int32
    if len(docs) == 1:
        train, ev = _split_tokens(_pack([tok.encode(read(docs[0][1]))], tok.eos_id, dtype),
                                  eval_fraction)
    else:
        tr, evd = [], []
        for name, d in docs:
            (evd if is_eval_document(name, eval_fraction) else tr).append(tok.encode(read(d)))
        train, ev = _pack(tr, tok.eos_id, dtype), _pack(evd, tok.eos_id, dtype)
    return _checked(Corpus(train_TOK=train, eval_TOK=ev, vocab_size=tok.vocab_size,
                           source=source, num_documents=len(docs)), seq_len, eval_fraction)


def _checked(c: Corpus, seq_len: int | None, eval_fraction: float) -> Corpus:
    if c.train_TOK.size < 2 or c.eval_TOK.size < 2:
        raise ValueError(f"data={c.source!r} is too small to split: {c.train_TOK.size} train and "
                         f"{c.eval_TOK.size} eval tokens")
    if seq_len is None:
        return c
    for split, toks, fix in (("train", c.train_TOK, "lower eval_fraction"),
                             ("eval", c.eval_TOK, "raise eval_fraction")):
        if num_sequences(toks, seq_len) == 0:
            raise ValueError(
                f"data={c.source!r}: the {split} split holds {toks.size} tokens (eval_fraction="
                f"{eval_fraction}), fewer than one sequence of seq_len={seq_len} (+1 target); "
                f"use more data, a smaller seq_len, or {fix}")
    return c


def num_sequences(tokens: np.ndarray, seq_len: int) -> int:
    """Packed sequences of seq_len + 1 tokens (adjacent windows overlap by one token)."""
    return max(0, (tokens.size - 1) // seq_len)


@functools.lru_cache(maxsize=4)
def _permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


def batch_at(tokens: np.ndarray, index: int, *, batch_size: int, seq_len: int, seed: int,
             shuffle: bool = True) -> np.ndarray:
    """Batch `index` as int32 [B, S + 1] (inputs = [:, :-1], targets = [:, 1:]).

    Raises ValueError when the stream holds no full sequence or index < 0.
    """
    n = num_sequences(tokens, seq_len)
    if n == 0:
        raise ValueError(f"seq_len={seq_len} is longer than the token stream ({tokens.size})")
    if index < 0:
        raise ValueError(f"batch index={index} must be >= 0")
    rows = []
    for g in range(index * batch_size, (index + 1) * batch_size):
        epoch, pos = divmod(g, n)
        seq = int(_permutation(n, seed, epoch)[pos]) if shuffle else pos
        rows.append(np.asarray(tokens[seq * seq_len: seq * seq_len + seq_len + 1]))
    return np.stack(rows).astype(np.int32)


def eval_batches(corpus: Corpus, *, num_batches: int, batch_size: int, seq_len: int
                 ) -> list[np.ndarray]:
    """A fixed list of held-out batches (the first ones, unshuffled), the same at every eval."""
    n = num_sequences(corpus.eval_TOK, seq_len)
    count = min(num_batches, max(1, n // batch_size))
    return [batch_at(corpus.eval_TOK, i, batch_size=batch_size, seq_len=seq_len, seed=0,
                     shuffle=False) for i in range(count)]
