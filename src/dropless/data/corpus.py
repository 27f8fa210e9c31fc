"""Training data: a corpus tokenized into one stream per split, packed into fixed-length
sequences, served as deterministic batches addressed by step number.

Legend: B batch, S sequence length (inputs; each row holds S + 1 tokens for the shifted targets).

Determinism: batch `i` is a pure function of (corpus, seed, i): sample g = i * B + j of the run
is sequence perm_e[g mod n] where n is the number of packed sequences, e = g // n the epoch and
perm_e a permutation seeded by (seed, e). The data position in a checkpoint is therefore just the
next batch index, and a resumed run sees exactly the batches it would have seen.

Sources: "stdlib" (the Python standard library's own .py files: real text on every machine, no
download), a text file, a directory of text files, a JSONL file (a "text" field per line),
pre-tokenized tokens (.npy, or raw .bin of `bin_dtype`: one document), or a prepared dataset
folder (`dropless data prepare`; its manifest.json names the shards). Token files and prepared
shards are read a window at a time (data.shards: memory bounded at any size, a file changed
underneath refused); text is tokenized in memory at start-up, so text above `LARGE_TEXT_BYTES`
gets a note with the `prepare` command that does it once.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import sysconfig
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from dropless.data import decoding, readers, shards
from dropless.data.readers import TEXT_SUFFIXES
from dropless.data.tokenizer import make_tokenizer

TEXT_HINT = ("training reads the 'text' field; `dropless data prepare --text-field NAME` "
             "prepares another")
LARGE_TEXT_BYTES = 64 << 20   # text above this is tokenized at every start: suggest `prepare`


@dataclasses.dataclass(frozen=True, kw_only=True)
class Corpus:
    """Token streams for training and held-out evaluation: arrays in memory, or
    data.shards.TokenFile / ShardSet read a window at a time (both slice like 1-D arrays)."""
    train_TOK: Any
    eval_TOK: Any
    vocab_size: int
    source: str
    num_documents: int
    train_ends_D: np.ndarray | None = None   # cumulative document ends (None: one document,
    eval_ends_D: np.ndarray | None = None    # or the split is a ShardSet that knows its own)
    prepared: str = ""                        # a prepared dataset's identity (shards' sha256)
    notes: tuple[str, ...] = ()               # lines for the terminal (e.g. "prepare this")

    def fingerprint(self) -> dict:
        """Identifies the corpus in a checkpoint, so a resume on different data is refused.
        The path is left out: moving the same data elsewhere does not change the batches.
        Every token counts: `sha256` digests both splits (an edit past the first tokens that
        keeps the length is other data), except for a prepared dataset, whose `prepared`
        identity is its shards' sha256 already (hashing them again would read it whole at
        every start). Computed once (a checkpoint saved after the data changed still names the
        data read)."""
        if "_fingerprint" not in self.__dict__:
            head = np.asarray(self.train_TOK[:4096]).astype(np.int64)
            fp = {"train_tokens": int(self.train_TOK.size),
                  "eval_tokens": int(self.eval_TOK.size), "vocab_size": self.vocab_size,
                  "crc32": int(zlib.crc32(head.tobytes()))}
            if self.prepared:
                fp["prepared"] = self.prepared
            else:
                fp["sha256"] = _tokens_sha256(self.train_TOK, self.eval_TOK)
            self.__dict__["_fingerprint"] = fp
        return dict(self.__dict__["_fingerprint"])


def _tokens_sha256(*arrays_TOK) -> str:
    """SHA-256 of the arrays' token values (as int64, so a dtype change alone is no other data),
    read in 16M-token pieces."""
    h = hashlib.sha256()
    for a in arrays_TOK:
        h.update(b"%d:" % a.size)
        for i in range(0, a.size, 1 << 24):
            h.update(np.asarray(a[i:i + (1 << 24)], np.int64).tobytes())
    return h.hexdigest()


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


def _ends(docs: list[np.ndarray]) -> np.ndarray:
    """The cumulative document ends of `_pack(docs)` (each document + its EOS)."""
    return np.cumsum([d.size + 1 for d in docs], dtype=np.int64)


def _where(source: str, path: Path, key: str = "data") -> str:
    """How an error names a file: `data='d.jsonl'`, or `data='corpus/': corpus/a.jsonl` (`key`:
    the argument that named the source, data or eval_data)."""
    return f"{key}={source!r}" if Path(source) == path else f"{key}={source!r}: {path}"


def _jsonl_documents(path: Path, source: str, key: str = "data") -> list[tuple[str, str]]:
    """(name, text) per non-blank line of a JSONL file (compressed too, see `readers`): each
    line one JSON object whose "text" is a string of Unicode text (a lone surrogate escaped in
    the JSON is refused), read by `readers` and checked by `decoding`, as `data prepare` reads
    JSONL. Raises ValueError naming the file and the line that is wrong."""
    file = readers.InputFile(path=path, name=path.name, kind="jsonl", weight=1.0, size=0)
    where, docs = _where(source, path, key), []
    for i, raw, _ in readers.jsonl_lines(file):
        at = f"{where} line {i + 1}"
        rec = decoding.parse_jsonl_line(raw, at, "text")
        text = decoding.record_text(rec, "text", at, TEXT_HINT)
        decoding.check_encodable(text, at)
        docs.append((f"{path.name}:{i}", text))
    return docs


def _not_jsonl(source: str, path: Path, key: str = "data") -> ValueError:
    return ValueError(
        f"{_where(source, path, key)} is a .json file, which dropless does not read: training text "
        "is JSONL (.jsonl, one JSON object per line with a \"text\" field), plain text "
        f"({', '.join(TEXT_SUFFIXES)}) or token ids (.npy, .bin); e.g. "
        f"`jq -c '.[]' {path.name} > {path.stem}.jsonl` for a list of records")


def _directory_files(path: Path, source: str, key: str = "data") -> list[Path]:
    """The files of a directory source that are read (text and JSONL, sorted); ValueError when
    there are none, saying what the directory holds instead."""
    files = sorted(p for p in readers.walk(path, f"{key}={source!r}")
                   if readers.kind_of(p) in ("text", "jsonl") and p.is_file())
    if files:
        return files
    found: dict[str, int] = {}
    for p in path.rglob("*"):
        if p.is_file():
            found[p.suffix or "(no suffix)"] = found.get(p.suffix or "(no suffix)", 0) + 1
    holds = ", ".join(f"{n} {suffix}" for suffix, n in sorted(found.items())) or "nothing"
    raise ValueError(f"{key}={source!r} holds no file dropless reads ({', '.join(TEXT_SUFFIXES)}"
                     f", .jsonl); it holds {holds}" + ("; a .json file is not JSONL (one JSON "
                     "object per line, suffix .jsonl)" if ".json" in found else "")
                     + f"; token files (.npy, .bin) are given one at a time: {key}=FILE")


def prepare_command(source: str, tokenizer: str) -> tuple[str, str]:
    """(the `dropless data prepare` command that prepares `source` for `tokenizer` ("byte" or
    a tokenizer.json path), the prepared folder it writes)."""
    path = Path(source)
    out = f"{path.with_suffix('') if path.is_file() else path}-prepared"
    tok = "byte" if tokenizer == "byte" else f"hf:{Path(tokenizer).parent}"
    return f"dropless data prepare {source} {out} --tokenizer {tok}", out


def check_readable_here(source: str, tokenizer: str, *, what: str = "",
                        use: str = "data=") -> None:
    """Refuse a source that training and eval read only once prepared: a Parquet or Arrow file,
    a `datasets.save_to_disk` folder, a folder holding Parquet / Arrow files (beside text too:
    they would be left out). The one line names the
    `data prepare` command that prepares it (`what` starts it, default `data=SOURCE`; `use`
    is how the command names the prepared folder)."""
    path = Path(source)
    if path.is_dir():
        saved = any((path / n).is_file() for n in ("state.json", "dataset_dict.json"))
        kinds = {readers.kind_of(p) for p in path.rglob("*") if p.is_file()}
        if not saved and not kinds & {"parquet", "arrow"}:
            return                     # (text beside them would train without them)
        form = ("a datasets.save_to_disk folder" if saved
                else "a folder holding Parquet / Arrow files")
    elif readers.kind_of(path) in ("parquet", "arrow"):
        form = f"{'Parquet' if readers.kind_of(path) == 'parquet' else 'Arrow'}"
    else:
        return
    cmd, out = prepare_command(source, tokenizer)
    raise ValueError(f"{what or f'data={source!r}'} is {form}, which is read once prepared: "
                     f"{cmd}, then {use}{out}")


def text_documents(source: str, key: str = "data") -> list[tuple[str, str]]:
    """(name, text) documents of a text/JSONL source or directory, in sorted order. A text file
    (of any suffix but .json and the token files') is read byte-exact but for a leading
    byte-order mark and must be UTF-8, as `data prepare` reads it (`decoding.decode_utf8`).
    Raises ValueError for a .json file, a directory with nothing to read, a file this process
    may not read, bytes that are not UTF-8 (naming the file and line) and a bad JSONL line."""
    path = Path(source)
    files = _directory_files(path, source, key) if path.is_dir() else [path]
    for f in files:   # every file before any is read
        readers.check_readable(f, f"{key}={source!r}")
    return [doc for f in files for doc in _file_documents(f, source, key)]


def _file_documents(path: Path, source: str, key: str = "data") -> list[tuple[str, str]]:
    """(name, text) documents of one file of `source` (see `text_documents`)."""
    if readers.kind_of(path) == "jsonl":
        return _jsonl_documents(path, source, key)
    if path.suffix == ".json":
        raise _not_jsonl(source, path, key)
    return [(path.name, decoding.decode_utf8(path.read_bytes(), _where(source, path, key)))]


def document_tokens(source: str, tok, *, what: str = "", use: str = "data=") -> np.ndarray:
    """One int32 token stream of the documents of `source` (a text/JSONL file or directory, see
    `text_documents`), each encoded by `tok` (BOS as the tokenizer says) and followed by its
    EOS id; documents that encode to nothing are left out. A prepared dataset's stream is its
    eval split (its manifest must name `tok`, see `load_prepared`). Raises ValueError, starting
    with `what` (default `data=SOURCE`), when no document holds a token, and for a source read
    only once prepared (`check_readable_here`; `use` names the prepared folder's argument)."""
    path = Path(source)
    if path.is_dir() and (path / "manifest.json").exists():
        held = load_prepared(path, source, tokenizer=tok.name, vocab_size=None).eval_TOK
        return np.asarray(held[:held.size]).astype(np.int32)
    check_readable_here(source, tok.name, what=what, use=use)
    docs = [tok.encode(text) for _, text in text_documents(source)]
    docs = [d for d in docs if d.size]
    if not docs:
        raise ValueError(f"{what or f'data={source!r}'} holds no text")
    return _pack(docs, tok.eos_id, np.int32)


def _split_tokens(tokens, eval_fraction: float) -> tuple:
    cut = int(tokens.size * (1 - eval_fraction))
    if isinstance(tokens, shards.TokenFile):
        return tokens.view(0, cut), tokens.view(cut, tokens.size)
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


def _open_tokens(path: Path, source: str, bin_dtype: str, key: str = "data") -> shards.TokenFile:
    """The 1-D integer token array of a .npy or .bin file, read a window at a time
    (data.shards.TokenFile). Raises ValueError for an empty file, a .bin size that is not a whole
    number of `bin_dtype` tokens, an unreadable .npy, a non-integer dtype or more than one
    dimension."""
    what = f"{key}={source!r}"
    size = path.stat().st_size
    if size == 0:
        raise ValueError(f"{key}={source!r} is empty (0 bytes)")
    if path.suffix == ".bin":
        item = np.dtype(bin_dtype).itemsize
        if size % item:
            raise ValueError(f"{key}={source!r} holds {size} bytes, not a multiple of {item} "
                             f"(bin_dtype={bin_dtype}: {item} bytes per token); set bin_dtype "
                             "to the type the file was written with")
        return shards.TokenFile(path, bin_dtype, what=what)
    try:
        with open(path, "rb") as f:
            major, _ = np.lib.format.read_magic(f)
            read = {1: np.lib.format.read_array_header_1_0,
                    2: np.lib.format.read_array_header_2_0}.get(major)
            if read is None:
                raise ValueError(f"unsupported .npy version {major}")
            shape, fortran, dtype = read(f)
            offset = f.tell()
    except (ValueError, OSError, EOFError) as e:
        raise ValueError(f"{key}={source!r} is not a readable .npy file ({e})") from None
    if not np.issubdtype(dtype, np.integer):
        raise ValueError(f"{key}={source!r} holds {dtype} values; token ids must be "
                         "integers (save them as uint16, int32 or int64)")
    if len(shape) != 1:
        raise ValueError(f"{key}={source!r} must hold a 1-D token array; shape {shape}")
    if shape[0] == 0:
        raise ValueError(f"{key}={source!r} holds no tokens")
    if dtype.byteorder == ">":
        raise ValueError(f"{key}={source!r} holds big-endian {dtype}; save it little-endian")
    try:
        return shards.TokenFile(path, dtype, offset=offset, count=shape[0], what=what)
    except ValueError as e:
        raise ValueError(f"{key}={source!r} is not a readable .npy file ({e})") from None


def _max_id(toks) -> int:
    return max(int(np.max(np.asarray(toks[lo: lo + CHUNK]))) for lo in range(0, toks.size, CHUNK))


def _check_ids(toks: np.ndarray, source: str, vocab_size: int | None,
               key: str = "data") -> None:
    """Token ids are >= 0 and, when `vocab_size` is given, < vocab_size; ValueError naming the
    first id that is not and its position."""
    if np.issubdtype(toks.dtype, np.signedinteger):
        at = _first_position(toks, lambda c: c < 0)
        if at is not None:
            raise ValueError(f"{key}={source!r} holds a negative token id, {int(toks[at])} at "
                             f"position {at}")
    if vocab_size is not None:
        at = _first_position(toks, lambda c: c >= vocab_size)
        if at is not None:
            raise ValueError(f"{key}={source!r} holds token id {int(toks[at])} at position {at}, "
                             f"beyond the model's vocabulary (model.vocab_size={vocab_size})")


def load_corpus(source: str = "stdlib", *, tokenizer: str = "byte", eval_fraction: float = 0.02,
                bin_dtype: str = "uint16", vocab_size: int | None = None,
                seq_len: int | None = None, key: str = "data",
                splits: tuple[str, ...] = ("train", "eval"), held_out: bool = False) -> Corpus:
    """Tokenize and pack `source` (see the module docstring) into train and eval streams.

    Documents are held out by name (`is_eval_document`); a single document or a token file is
    split by position (the last `eval_fraction` is held out). With `held_out` (eval_data=), all
    of `source` is the eval split, whatever its form: a file, a folder's documents, a token
    file, a prepared dataset's train and eval shards. A token file's ids must lie in
    [0, vocab_size) (`vocab_size`: the model's; when None, the largest id + 1 is the corpus's
    vocabulary and only negative ids are refused). With `seq_len`, each split must hold at least
    one sequence of seq_len + 1 tokens (checked here, before anything is compiled); `splits`:
    the splits the run reads (with eval_data=, data='s train split and eval_data='s eval split),
    the only ones checked. Raises ValueError naming the argument (`key`: data or eval_data), the
    file (and line, byte offset or token position) for a missing, unsupported or malformed
    source, and the split for one too short.
    """
    path = Path(source)
    if source != "stdlib" and not path.exists():
        raise ValueError(f"{key}={source!r} does not exist (use 'stdlib' or a local path)")
    check = functools.partial(_checked, seq_len=seq_len, eval_fraction=eval_fraction, key=key,
                              splits=splits, held_out=held_out)
    if path.is_dir() and (path / "manifest.json").exists():
        return check(load_prepared(path, source, tokenizer=tokenizer, vocab_size=vocab_size,
                                   key=key, held_out=held_out))
    if held_out:
        eval_fraction = 1.0   # every document held out, a single one or a token file whole
    if source != "stdlib" and not path.is_dir():
        shards.check_regular(path, f"{key}={source!r}")
    if source != "stdlib":
        check_readable_here(source, tokenizer, what=f"{key}={source!r}", use=f"{key}=")
    if path.suffix in (".npy", ".bin") and not path.is_dir():
        readers.check_readable(path, f"{key}={source!r}")
        toks = _open_tokens(path, source, bin_dtype, key)
        _check_ids(toks, source, vocab_size, key)
        train, ev = _split_tokens(toks, eval_fraction)
        return check(Corpus(train_TOK=train, eval_TOK=ev, vocab_size=_max_id(toks) + 1,
                            source=source, num_documents=1))
    tok = make_tokenizer(tokenizer)
    if source == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        docs = [(p.relative_to(root).as_posix(), p) for p in stdlib_files()]
        # (replaced, not refused: CPython's own tests hold deliberately mis-encoded sources)
        read = lambda p: p.read_text(encoding="utf-8", errors="replace")  # noqa: E731
    else:
        docs = text_documents(source, key)
        read = lambda t: t  # noqa: E731
    if not any(d.strip() if isinstance(d, str) else True for _, d in docs):
        raise ValueError(f"{key}={source!r} holds no text (every document in it is empty)")
    dtype = np.uint8 if tok.vocab_size <= 256 else np.int32
    if len(docs) == 1:
        train, ev = _split_tokens(_pack([tok.encode(read(docs[0][1]))], tok.eos_id, dtype),
                                  eval_fraction)
        ends = (np.array([train.size], np.int64), np.array([ev.size], np.int64))
    else:
        tr, evd = [], []
        for name, d in docs:
            (evd if is_eval_document(name, eval_fraction) else tr).append(tok.encode(read(d)))
        train, ev = _pack(tr, tok.eos_id, dtype), _pack(evd, tok.eos_id, dtype)
        ends = (_ends(tr), _ends(evd))
    return check(Corpus(train_TOK=train, eval_TOK=ev, vocab_size=tok.vocab_size,
                        source=source, num_documents=len(docs), train_ends_D=ends[0],
                        eval_ends_D=ends[1], notes=_large_text_note(source, tokenizer, key)))


def _checked_held_out(c: Corpus, seq_len: int | None, key: str) -> Corpus:
    """`c` (all of it the eval split), after checking it holds tokens (with seq_len, one
    sequence)."""
    size = c.eval_TOK.size
    if seq_len is None and size < 2:
        raise ValueError(f"{key}={c.source!r} holds {size} tokens: too few to evaluate on")
    if seq_len is not None and num_sequences(c.eval_TOK, seq_len) == 0:
        raise ValueError(f"{key}={c.source!r} holds {size} tokens, fewer than one sequence of "
                         f"seq_len={seq_len} (+1 target); use more held-out data or a smaller "
                         "seq_len")
    return c


def _large_text_note(source: str, tokenizer: str, key: str = "data") -> tuple[str, ...]:
    """A note when `source` is text large enough that tokenizing it at every start is slow."""
    path = Path(source)
    if source == "stdlib":
        return ()
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    size = sum(p.stat().st_size for p in files)
    if size <= LARGE_TEXT_BYTES:
        return ()
    cmd, out = prepare_command(source, tokenizer)
    return (f"note: {key}={source!r} is {size / 2**20:.0f} MiB of text, tokenized in memory at "
            "every start (several times its size in RAM); prepare it once and train on the "
            f"shards: {cmd}, then {key}={out}",)


def load_prepared(folder: Path, source: str, *, tokenizer: str,
                  vocab_size: int | None, key: str = "data", held_out: bool = False) -> Corpus:
    """A prepared dataset (`dropless data prepare`) as a Corpus of two data.shards.ShardSets
    (`held_out`: one, its train and eval shards as the eval split; the train split empty).

    Its manifest must name the run's tokenizer ("byte", or a tokenizer.json of the same sha256)
    and a vocabulary no larger than `vocab_size`. Raises ValueError naming the manifest or the
    shard file otherwise (and for a missing, changed or malformed shard)."""
    from dropless.data import manifest as manifest_lib
    m = manifest_lib.read_manifest(folder)
    where = f"{key}={source!r} ({folder / manifest_lib.MANIFEST})"
    if m.tokenizer.kind == "byte":
        if tokenizer != "byte":
            raise ValueError(f"{where} was prepared with the byte tokenizer, but this run's "
                             f"tokenizer is {tokenizer!r}; set tokenizer=byte or prepare the "
                             "data with this tokenizer")
    elif tokenizer == "byte" or manifest_lib.file_sha256(tokenizer) != m.tokenizer.sha256:
        raise ValueError(f"{where} was prepared with tokenizer {m.tokenizer.source} (tokenizer."
                         f"json sha256 {m.tokenizer.sha256[:12]}...), but this run's tokenizer "
                         f"is {tokenizer!r}" + ("" if tokenizer == "byte" else
                         f" (sha256 {manifest_lib.file_sha256(tokenizer)[:12]}...)")
                         + "; train with the tokenizer the data was prepared with, or prepare "
                         "it again with this one")
    if vocab_size is not None and m.vocab_size > vocab_size:
        raise ValueError(f"{where}: vocab_size={m.vocab_size} is larger than the model's "
                         f"(model.vocab_size={vocab_size}); use a model with at least "
                         f"{m.vocab_size} or prepare with its tokenizer")
    if held_out:
        ev = shards.open_prepared(folder, m, ("train", "eval"), vocab_size=vocab_size)
        train = np.zeros((0,), np.dtype(m.dtype))
    elif not m.splits["eval"]:
        raise ValueError(f"{where}: splits.eval holds no shard; prepare with eval_fraction > 0")
    else:
        train, ev = (shards.open_prepared(folder, m, s, vocab_size=vocab_size) for s in
                     ("train", "eval"))
    ident = hashlib.sha256("".join(sh.sha256 for s in ("train", "eval")
                                   for sh in m.splits[s]).encode()).hexdigest()
    return Corpus(train_TOK=train, eval_TOK=ev, vocab_size=m.vocab_size, source=source,
                  num_documents=m.num_documents["train"] + m.num_documents["eval"],
                  prepared=ident)


def with_eval_split(c: Corpus, held: Corpus) -> Corpus:
    """`c` evaluated on `held`'s eval split (TrainConfig.eval_data: `load_corpus(...,
    held_out=True)`, all of that data)."""
    return dataclasses.replace(c, eval_TOK=held.eval_TOK, eval_ends_D=held.eval_ends_D,
                               notes=c.notes + held.notes)


def _checked(c: Corpus, seq_len: int | None, eval_fraction: float, key: str = "data",
             splits: tuple[str, ...] = ("train", "eval"), held_out: bool = False) -> Corpus:
    """`c`, after checking the `splits` the run reads hold tokens (and, with seq_len, one
    sequence each)."""
    parts = {"train": (c.train_TOK, "lower eval_fraction"),
             "eval": (c.eval_TOK, "raise eval_fraction")}
    if held_out:
        return _checked_held_out(c, seq_len, key)
    if any(parts[s][0].size < 2 for s in splits):
        raise ValueError(f"{key}={c.source!r} is too small to split: {c.train_TOK.size} train and "
                         f"{c.eval_TOK.size} eval tokens")
    if seq_len is None:
        return c
    for split in splits:
        toks, fix = parts[split]
        if num_sequences(toks, seq_len) == 0:
            raise ValueError(
                f"{key}={c.source!r}: the {split} split holds {toks.size} tokens (eval_fraction="
                f"{eval_fraction}), fewer than one sequence of seq_len={seq_len} (+1 target); "
                f"use more data, a smaller seq_len, or {fix}")
    return c


def num_sequences(tokens: np.ndarray, seq_len: int) -> int:
    """Packed sequences of seq_len + 1 tokens (adjacent windows overlap by one token)."""
    return max(0, (tokens.size - 1) // seq_len)


@functools.lru_cache(maxsize=4)
def permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """The order of the n items of epoch `epoch` (a permutation seeded by (seed, epoch))."""
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
        seq = int(permutation(n, seed, epoch)[pos]) if shuffle else pos
        rows.append(np.asarray(tokens[seq * seq_len: seq * seq_len + seq_len + 1]))
    return np.stack(rows).astype(np.int32)


def eval_batches(corpus: Corpus, *, num_batches: int, batch_size: int, seq_len: int
                 ) -> list[np.ndarray]:
    """A fixed list of held-out batches (the first ones, unshuffled), the same at every eval."""
    n = num_sequences(corpus.eval_TOK, seq_len)
    count = min(num_batches, max(1, n // batch_size))
    return [batch_at(corpus.eval_TOK, i, batch_size=batch_size, seq_len=seq_len, seed=0,
                     shuffle=False) for i in range(count)]
