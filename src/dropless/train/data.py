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

from dropless.train.tokenizer import (  # noqa: F401 - moved there; re-exported
    BYTE_EOS, BYTE_VOCAB, ByteTokenizer, HFTokenizer, make_tokenizer)

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


def _text_documents(source: str) -> list[tuple[str, str]]:
    """(name, text) documents of a text/JSONL source or directory, in sorted order."""
    path = Path(source)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES + (".jsonl",))
        return [doc for f in files for doc in _text_documents(str(f))]
    if path.suffix == ".jsonl":
        docs = []
        with open(path, encoding="utf-8") as fh:
            for i, line in enumerate(fh):
                if line.strip():
                    rec = json.loads(line)
                    if "text" not in rec:
                        raise ValueError(f"data={source!r}: line {i + 1} has no 'text' field")
                    docs.append((f"{path.name}:{i}", rec["text"]))
        return docs
    return [(path.name, path.read_text(encoding="utf-8", errors="replace"))]


def _split_tokens(tokens: np.ndarray, eval_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    cut = int(tokens.size * (1 - eval_fraction))
    return tokens[:cut], tokens[cut:]


def load_corpus(source: str = "stdlib", *, tokenizer: str = "byte", eval_fraction: float = 0.02,
                bin_dtype: str = "uint16", vocab_size: int | None = None) -> Corpus:
    """Tokenize and pack `source` (see the module docstring) into train and eval streams.

    Documents are held out by name (`is_eval_document`); a single document or a token file is
    split by position (the last `eval_fraction` is held out). Raises ValueError for a missing or
    unsupported source, or an empty split.
    """
    path = Path(source)
    if source != "stdlib" and not path.exists():
        raise ValueError(f"data={source!r} does not exist (use 'stdlib' or a local path)")
    if path.suffix in (".npy", ".bin"):
        toks = (np.load(path, mmap_mode="r") if path.suffix == ".npy"
                else np.memmap(path, dtype=np.dtype(bin_dtype), mode="r"))
        if toks.ndim != 1:
            raise ValueError(f"data={source!r} must hold a 1-D token array; shape {toks.shape}")
        vocab = vocab_size or int(np.max(toks)) + 1
        train, ev = _split_tokens(toks, eval_fraction)
        return _checked(Corpus(train_TOK=train, eval_TOK=ev, vocab_size=vocab, source=source,
                               num_documents=1))
    tok = make_tokenizer(tokenizer)
    if source == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        docs = [(p.relative_to(root).as_posix(), p) for p in stdlib_files()]
        read = lambda p: p.read_text(encoding="utf-8", errors="replace")  # noqa: E731
    else:
        docs = _text_documents(source)
        read = lambda t: t  # noqa: E731
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
                           source=source, num_documents=len(docs)))


def _checked(c: Corpus) -> Corpus:
    if c.train_TOK.size < 2 or c.eval_TOK.size < 2:
        raise ValueError(f"data={c.source!r} is too small to split: {c.train_TOK.size} train and "
                         f"{c.eval_TOK.size} eval tokens")
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
