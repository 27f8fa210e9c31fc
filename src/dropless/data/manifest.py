"""The on-disk format of a prepared dataset (`dropless data prepare`), and its one reader.

Legend: T tokens of a shard, D documents of a shard.

A prepared dataset is a folder:

    OUT/manifest.json          written last, atomically: what the folder holds (below)
    OUT/train-00000.tokens     raw little-endian token ids of `dtype`, documents concatenated
    OUT/train-00000.docs       little-endian uint64 cumulative END offsets of its documents
    OUT/eval-00000.tokens ...  the held-out split, the same way

`.docs` of a shard with D documents and T tokens holds D offsets, strictly increasing, the last
equal to T: document d is tokens[ends[d - 1]:ends[d]] (ends[-1] read as 0). A document's tokens
include its BOS / EOS as `add_bos` / `add_eos` say.

manifest.json:
    {"format": "dropless-tokens", "version": 1,
     "tokenizer": {"kind": "byte"|"hf", "source": <as given>, "sha256": <of tokenizer.json>|null},
     "vocab_size": int, "dtype": "uint16"|"uint32", "bos_id": int|null, "eos_id": int|null,
     "add_bos": bool, "add_eos": bool, "eval_fraction": float,
     "splits": {"train": [SHARD...], "eval": [SHARD...]},
     "num_tokens": {"train": n, "eval": n}, "num_documents": {"train": n, "eval": n},
     "sources": [{"path", "bytes", "sha256", "weight", "documents", "tokens", "skipped"}],
     "created_by": "dropless <version>"}
    SHARD = {"tokens_file", "docs_file", "tokens", "documents", "sha256", "docs_sha256"}

`read_manifest` decodes the file as every JSON file a user may have edited is decoded
(`data.decoding`: a key named twice is refused, a leading byte-order mark dropped), then checks
every key, type and sum; `open_shard` checks the files' sizes (and, when asked, their hashes)
against the manifest, so a shard that is missing, cut short or changed since `prepare` is refused
naming the file. Every error is a ValueError naming the file and the key.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from pathlib import Path

import numpy as np

from dropless.data.decoding import json_object

FORMAT = "dropless-tokens"
VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "eval")
DTYPES = ("uint16", "uint32")
TOKENIZER_KINDS = ("byte", "hf")
DOCS_DTYPE = np.dtype("<u8")
HASH_BLOCK = 1 << 22
# every count (tokens, documents, bytes, ids) is below this: offsets are uint64 in .docs and file
# sizes int64, and a count past it (an edit, a typo) could only fail later, far from the key
MAX_COUNT = 2 ** 63


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shard:
    """One shard of a split: its two files (names inside the dataset folder), counts and hashes."""
    tokens_file: str
    docs_file: str
    tokens: int
    documents: int
    sha256: str
    docs_sha256: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class Source:
    """One input file: `weight` is how many times each of its training documents was written
    (the whole part once, the fraction by a stable hash of the document; see docs/data.md);
    `documents` / `tokens` count its non-empty documents once (both splits); `skipped`: the
    documents that encoded to no token."""
    path: str
    bytes: int
    sha256: str
    weight: float
    documents: int
    tokens: int
    skipped: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class TokenizerId:
    """Which tokenizer wrote the ids: "byte", or "hf" with the sha256 of its tokenizer.json."""
    kind: str
    source: str
    sha256: str | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Manifest:
    """What a prepared dataset folder holds (module doc)."""
    tokenizer: TokenizerId
    vocab_size: int
    dtype: str
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    add_eos: bool
    eval_fraction: float
    splits: dict[str, tuple[Shard, ...]]
    sources: tuple[Source, ...]
    created_by: str

    @property
    def num_tokens(self) -> dict[str, int]:
        return {s: sum(sh.tokens for sh in self.splits[s]) for s in SPLITS}

    @property
    def num_documents(self) -> dict[str, int]:
        return {s: sum(sh.documents for sh in self.splits[s]) for s in SPLITS}

    def to_dict(self) -> dict:
        """The manifest.json object (module doc)."""
        return {"format": FORMAT, "version": VERSION,
                "tokenizer": dataclasses.asdict(self.tokenizer),
                "vocab_size": self.vocab_size, "dtype": self.dtype, "bos_id": self.bos_id,
                "eos_id": self.eos_id, "add_bos": self.add_bos, "add_eos": self.add_eos,
                "eval_fraction": self.eval_fraction,
                "splits": {s: [dataclasses.asdict(sh) for sh in self.splits[s]] for s in SPLITS},
                "num_tokens": self.num_tokens, "num_documents": self.num_documents,
                "sources": [dataclasses.asdict(s) for s in self.sources],
                "created_by": self.created_by}


def dtype_for_vocab(vocab_size: int) -> str:
    """The narrowest token dtype that holds ids 0..vocab_size-1."""
    if vocab_size <= 1 << 16:
        return "uint16"
    if vocab_size <= 1 << 32:
        return "uint32"
    raise ValueError(f"vocab_size={vocab_size} does not fit uint32 token ids")


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file's bytes, read in blocks (never whole)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(HASH_BLOCK):
            h.update(block)
    return h.hexdigest()


def write_json_atomic(path: Path, obj) -> None:
    """`obj` as JSON at `path`, written beside and renamed over it (never half-written)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_manifest(folder: str | Path, manifest: Manifest) -> Path:
    """Write `folder`/manifest.json atomically; the manifest is validated first (as
    `read_manifest` would read it back). Returns its path."""
    path = Path(folder) / MANIFEST
    data = manifest.to_dict()
    parse_manifest(json.loads(json.dumps(data)), where=str(path))
    write_json_atomic(path, data)
    return path


# --- reading ------------------------------------------------------------------------------------

def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _shown(v) -> str:
    """A manifest value as an error shows it: its JSON, cut to 80 characters; an integer too
    long for `str` (Python refuses past 4,300 digits) by its size."""
    if _is_int(v) and abs(v).bit_length() > 256:
        return f"<an integer of {v.bit_length()} bits>"
    return json.dumps(v)[:80]


class _Checker:
    """Reads keys of one JSON object, raising ValueError naming the file and the dotted key."""

    def __init__(self, where: str, obj, key: str = ""):
        self.where, self.key = where, key
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: {key or 'the manifest'} must be a JSON object, not "
                             f"{type(obj).__name__}")
        self.obj = obj

    def name(self, k: str) -> str:
        return f"{self.key}.{k}" if self.key else k

    def fail(self, k: str, what: str):
        raise ValueError(f"{self.where}: {self.name(k)}={_shown(self.obj.get(k))} {what}")

    def get(self, k: str):
        if k not in self.obj:
            raise ValueError(f"{self.where}: key {self.name(k)!r} is missing (was the folder "
                             f"written by `dropless data prepare`?)")
        return self.obj[k]

    def int(self, k: str, *, lo: int = 0, null: bool = False) -> int | None:
        v = self.get(k)
        if v is None and null:
            return None
        if not _is_int(v) or not lo <= v < MAX_COUNT:
            self.fail(k, f"must be an integer in [{lo}, 2**63)" + (" or null" if null else ""))
        return v

    def str(self, k: str, *, choices=None, null: bool = False) -> str | None:
        v = self.get(k)
        if v is None and null:
            return None
        if not isinstance(v, str) or not v or (choices and v not in choices):
            self.fail(k, "must be " + (f"one of {', '.join(choices)}" if choices
                                       else "a non-empty string") + (" or null" if null else ""))
        return v

    def bool(self, k: str) -> bool:
        v = self.get(k)
        if not isinstance(v, bool):
            self.fail(k, "must be true or false")
        return v

    def float(self, k: str, *, lo: float, hi: float, lo_open: bool = False) -> float:
        v = self.get(k)
        # JSON's NaN and Infinity parse to floats that no comparison below refuses
        if (not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v)
                or v > hi or v < lo or (lo_open and v == lo)):
            self.fail(k, f"must be a number in {'(' if lo_open else '['}{lo}, {hi}]")
        return float(v)

    def sub(self, k: str) -> "_Checker":
        return _Checker(self.where, self.get(k), self.name(k))


def _sha(c: _Checker, k: str) -> str:
    v = c.str(k)
    if len(v) != 64 or any(ch not in "0123456789abcdef" for ch in v):
        c.fail(k, "must be a sha256 hex digest (64 lowercase hex digits)")
    return v


def _file_name(c: _Checker, k: str) -> str:
    v = c.str(k)
    if "/" in v or "\\" in v or v.startswith(".") or not v.isprintable():
        c.fail(k, "must be a plain file name inside the dataset folder (`prepare` writes "
                  "names such as train-00000.tokens)")
    return v


def _shard(where: str, obj, key: str) -> Shard:
    c = _Checker(where, obj, key)
    sh = Shard(tokens_file=_file_name(c, "tokens_file"), docs_file=_file_name(c, "docs_file"),
               tokens=c.int("tokens", lo=1), documents=c.int("documents", lo=1),
               sha256=_sha(c, "sha256"), docs_sha256=_sha(c, "docs_sha256"))
    if sh.documents > sh.tokens:
        c.fail("documents", f"is more than the shard's tokens ({sh.tokens})")
    return sh


def _source(where: str, obj, key: str) -> Source:
    c = _Checker(where, obj, key)
    return Source(path=c.str("path"), bytes=c.int("bytes"), sha256=_sha(c, "sha256"),
                  weight=c.float("weight", lo=0.0, hi=1e6, lo_open=True),
                  documents=c.int("documents"), tokens=c.int("tokens"),
                  skipped=c.int("skipped") if "skipped" in c.obj else 0)


def _list(c: _Checker, k: str) -> list:
    v = c.get(k)
    if not isinstance(v, list):
        c.fail(k, "must be a list")
    return v


def parse_manifest(data, *, where: str) -> Manifest:
    """The Manifest of a parsed manifest.json object; every key and sum checked. Raises
    ValueError naming `where` and the key."""
    c = _Checker(where, data)
    if c.get("format") != FORMAT:
        c.fail("format", f"is not {FORMAT!r}: this is not a prepared dataset's manifest")
    if c.get("version") != VERSION:
        c.fail("version", f"is not {VERSION}, the version this dropless reads (prepare the "
                          "data again with this dropless)")
    t = c.sub("tokenizer")
    kind = t.str("kind", choices=TOKENIZER_KINDS)
    tok = TokenizerId(kind=kind, source=t.str("source"),
                      sha256=_sha(t, "sha256") if kind == "hf" else t.get("sha256"))
    if kind == "byte" and tok.sha256 is not None:
        t.fail("sha256", "must be null for the byte tokenizer")
    vocab = c.int("vocab_size", lo=1)
    dtype = c.str("dtype", choices=DTYPES)
    if np.iinfo(dtype).max < vocab - 1:
        c.fail("dtype", f"cannot hold ids of vocab_size={vocab}")
    ids = {k: c.int(k, null=True) for k in ("bos_id", "eos_id")}
    for k, v in ids.items():
        if v is not None and v >= vocab:
            c.fail(k, f"is outside the vocabulary (vocab_size={vocab})")
    splits_c = c.sub("splits")
    splits = {s: tuple(_shard(where, sh, f"splits.{s}[{i}]")
                       for i, sh in enumerate(_list(splits_c, s))) for s in SPLITS}
    extra = sorted(set(splits_c.obj) - set(SPLITS))
    if extra:
        raise ValueError(f"{where}: splits.{extra[0]} is not a split (train, eval)")
    if not splits["train"]:
        raise ValueError(f"{where}: splits.train holds no shard")
    names = [n for s in SPLITS for sh in splits[s] for n in (sh.tokens_file, sh.docs_file)]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ValueError(f"{where}: file {dup!r} is named by two shards")
    sources = tuple(_source(where, s, f"sources[{i}]") for i, s in enumerate(_list(c, "sources")))
    if not sources:
        raise ValueError(f"{where}: sources is empty")
    m = Manifest(tokenizer=tok, vocab_size=vocab, dtype=dtype, bos_id=ids["bos_id"],
                 eos_id=ids["eos_id"], add_bos=c.bool("add_bos"), add_eos=c.bool("add_eos"),
                 eval_fraction=c.float("eval_fraction", lo=0.0, hi=1.0), splits=splits,
                 sources=sources, created_by=c.str("created_by"))
    if m.eval_fraction == 1.0:
        c.fail("eval_fraction", "must be below 1 (the train split holds the rest)")
    if m.add_bos and m.bos_id is None:
        c.fail("add_bos", "is true but bos_id is null")
    if m.add_eos and m.eos_id is None:
        c.fail("add_eos", "is true but eos_id is null")
    for k, got in (("num_tokens", m.num_tokens), ("num_documents", m.num_documents)):
        sub = c.sub(k)
        for s in SPLITS:
            if sub.int(s) != got[s]:
                sub.fail(s, f"is not the sum over splits.{s}'s shards ({got[s]})")
    return m


def read_manifest(folder: str | Path) -> Manifest:
    """The manifest of a prepared dataset folder (or of its manifest.json path), validated.
    Raises ValueError naming the file (and key) when it is missing, not JSON or malformed."""
    folder = Path(folder)
    path = folder if folder.name == MANIFEST and folder.is_file() else folder / MANIFEST
    if not path.is_file():
        hint = (" (a `prepare` was interrupted there: run the same command again to finish it)"
                if (path.parent / ".prepare").is_dir() else "")
        raise ValueError(f"{path} does not exist: {path.parent} is not a prepared dataset "
                         f"(write one with `dropless data prepare SRC... {path.parent} "
                         f"--tokenizer ...`){hint}")
    try:
        data = json_object(path)
    except RecursionError:
        raise ValueError(f"{path}: nested deeper than a manifest is; it is not a prepared "
                         "dataset's manifest (prepare the data again)") from None
    return parse_manifest(data, where=str(path))


def open_shard(folder: str | Path, manifest: Manifest, shard: Shard, *,
               verify_hash: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(tokens_T memory-mapped, ends_D uint64 in memory) of one shard of the dataset in `folder`.

    The files' sizes are always checked against the manifest, and the document ends (they are
    read anyway); with `verify_hash`, both files' sha256 too (reads the token file once). Raises
    ValueError naming the file when it is missing, of another size, changed, or its ends are not
    increasing up to the shard's token count."""
    folder = Path(folder)
    item = np.dtype(manifest.dtype).itemsize
    tok_path, docs_path = folder / shard.tokens_file, folder / shard.docs_file
    for path, want in ((tok_path, shard.tokens * item), (docs_path, shard.documents * 8)):
        if not path.is_file():
            raise ValueError(f"{path}: shard file is missing (named by {folder / MANIFEST}); "
                             "prepare the data again")
        got = path.stat().st_size
        if got != want:
            raise ValueError(f"{path}: {got} bytes, but {folder / MANIFEST} says {want}: the "
                             "shard changed since `prepare`; prepare the data again")
    if verify_hash:
        for path, want in ((tok_path, shard.sha256), (docs_path, shard.docs_sha256)):
            if file_sha256(path) != want:
                raise ValueError(f"{path}: sha256 differs from {folder / MANIFEST}'s: the shard "
                                 "changed since `prepare`; prepare the data again")
    ends_D = np.fromfile(docs_path, dtype=DOCS_DTYPE)
    if ends_D[-1] != shard.tokens or np.any(ends_D[1:] <= ends_D[:-1]) or ends_D[0] == 0:
        raise ValueError(f"{docs_path}: document ends are not increasing up to the shard's "
                         f"{shard.tokens} tokens; prepare the data again")
    tokens_T = np.memmap(tok_path, dtype=np.dtype(manifest.dtype).newbyteorder("<"), mode="r")
    return tokens_T, ends_D
