"""Token files read a window at a time, and the change under a running trainer caught.

Legend: N tokens, D documents.

Every read is an `os.pread` of the bytes it needs from a descriptor opened once, never a memory
map: a file truncated under a memory map raises SIGBUS at the first touched page past the new end
(the process dies, with no message and no emergency checkpoint), while a short `pread` is an
ordinary return value. Memory stays bounded whatever the file's size (the page cache holds what
was read; a prepared split keeps 1/`INDEX_EVERY` of its document ends in memory). Before each
read the file's `stat` (size, inode, device, mtime) is compared with the one taken at open, so a
file rewritten, replaced or truncated since is refused with `DataChanged` before its bytes are
used; a change inside the window between that check and the read shows as a short read, also
`DataChanged`.

Only regular files are opened (`open_regular`): a FIFO would block the trainer forever and a
device has no size to check.

A prepared split (`ShardSet`) is the concatenation of its shards: the `.tokens` of shard k are
global tokens [base_k, base_k + n_k), its `.docs` the cumulative END offset of each document in
the shard (little-endian uint64, the last one = n_k), as `dropless data prepare` writes them.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import stat
from pathlib import Path

import numpy as np

INDEX_EVERY = 1024           # document ends per entry of a split's in-memory index
CHUNK = 1 << 22              # tokens read at a time by a scan


class DataChanged(ValueError):
    """A data file changed (size, identity or contents' mtime) since the trainer opened it."""


class _Descriptor:
    """An open file descriptor, closed when the last TokenFile (view) holding it is gone."""

    def __init__(self, fd: int):
        self.fd = fd

    def __del__(self, _close=os.close):   # os may be gone at interpreter exit
        try:
            _close(self.fd)
        except OSError:
            pass


@dataclasses.dataclass(frozen=True)
class _Identity:
    size: int
    ino: int
    dev: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> "_Identity":
        return cls(st.st_size, st.st_ino, st.st_dev, st.st_mtime_ns)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: Path, what: str) -> tuple[int, os.stat_result]:
    """(read-only descriptor, its stat) of the regular file `path`. Opened non-blocking so a FIFO
    is refused at once instead of waiting for a writer. Raises ValueError, starting with `what`,
    for anything else (FIFO, device, socket, directory) and for a file that cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise ValueError(f"{what}: cannot open {path} ({e.strerror})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ValueError(f"{what}: {path} is {_kind(st.st_mode)}; data is read from regular "
                         "files only")
    os.set_blocking(fd, True)
    return fd, st


def check_regular(path: Path, what: str) -> None:
    """ValueError, starting with `what`, unless `path` is a regular file (see `open_regular`)."""
    fd, _ = open_regular(path, what)
    os.close(fd)


class TokenFile:
    """`count` integers of `dtype` from byte `offset` of a regular file, read with pread.

    `len()`, `.size`, `.dtype` and slicing (`f[lo:hi]` -> np.ndarray) behave as for a 1-D array
    (steps other than 1 are refused). Raises DataChanged from a read after the file changed.
    """

    def __init__(self, path: Path, dtype, *, offset: int = 0, count: int | None = None,
                 what: str = ""):
        self.path, self.what = Path(path), what or f"data file {path}"
        dt = np.dtype(dtype)
        self.dtype = dt.newbyteorder("<") if dt.itemsize > 1 else dt
        fd, st = open_regular(self.path, self.what)
        self._fd, self.opened = _Descriptor(fd), _Identity.of(st)
        self.offset = int(offset)
        avail = max(0, (st.st_size - self.offset) // self.dtype.itemsize)
        self.size = int(avail if count is None else count)
        if self.size > avail:
            raise ValueError(f"{self.what}: {self.path} holds {avail} tokens of "
                             f"{self.dtype.name}, fewer than the {self.size} expected")
        self.shape, self.ndim = (self.size,), 1

    def view(self, lo: int, hi: int) -> "TokenFile":
        """Tokens [lo, hi) of this file as a TokenFile (the same descriptor; nothing read)."""
        lo, hi = max(0, lo), min(self.size, hi)
        v = object.__new__(TokenFile)
        v.__dict__.update(self.__dict__)
        v.offset = self.offset + lo * self.dtype.itemsize
        v.size = max(0, hi - lo)
        v.shape = (v.size,)
        return v

    def __len__(self) -> int:
        return self.size

    def check(self) -> None:
        """DataChanged when the file (by its path or its descriptor) is no longer the one
        opened: another size, inode, device or modification time."""
        try:
            now = _Identity.of(os.stat(self.path))
        except OSError as e:
            raise DataChanged(f"{self.what}: {self.path} changed since training started "
                              f"({e.strerror})") from None
        fd_size = os.fstat(self._fd.fd).st_size
        if now != self.opened or fd_size != self.opened.size:
            raise DataChanged(f"{self.what}: {self.path} changed since training started "
                              f"({_difference(self.opened, now, fd_size)}); restore it, or "
                              "train on it as new data in a new run")

    def read(self, lo: int, hi: int) -> np.ndarray:
        """Tokens [lo, hi) (clipped to the file) as a fresh array; DataChanged as `check`."""
        lo, hi = max(0, lo), min(self.size, hi)
        if hi <= lo:
            return np.zeros((0,), self.dtype)
        self.check()
        item = self.dtype.itemsize
        want = (hi - lo) * item
        raw = os.pread(self._fd.fd, want, self.offset + lo * item)
        if len(raw) != want:
            raise DataChanged(f"{self.what}: {self.path} changed since training started (a "
                              f"read of {want} bytes returned {len(raw)}: truncated)")
        return np.frombuffer(raw, self.dtype).copy()

    def __getitem__(self, key) -> np.ndarray:
        if isinstance(key, (int, np.integer)):
            i = int(key) + (self.size if key < 0 else 0)
            if not 0 <= i < self.size:
                raise IndexError(f"index {key} out of range for {self.size} tokens")
            return self.read(i, i + 1)[0]
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("a TokenFile is read by index or by a slice with step 1")
        lo, hi, _ = key.indices(self.size)
        return self.read(lo, hi)

    def __array__(self, dtype=None, copy=None):
        a = self.read(0, self.size)
        return a if dtype is None else a.astype(dtype)


def _difference(was: _Identity, now: _Identity, fd_size: int) -> str:
    if now.ino != was.ino or now.dev != was.dev:
        return "it was replaced by another file"
    if now.size != was.size or fd_size != was.size:
        return f"its size went from {was.size} to {now.size} bytes"
    return "it was rewritten (modification time changed)"


class DocEnds:
    """The cumulative document END offsets of one shard (a `.docs` file), searched through an
    in-memory index of every INDEX_EVERY-th end and one pread of the block it points to."""

    def __init__(self, path: Path, *, count: int, num_tokens: int, what: str):
        self.file = TokenFile(path, np.uint64, count=count, what=what)
        self.count, self.num_tokens = count, num_tokens
        self.index = np.concatenate([
            self.file.read(lo, lo + 1) for lo in range(0, count, INDEX_EVERY)]
        ).astype(np.int64) if count else np.zeros((0,), np.int64)

    def rank(self, x: int) -> int:
        """How many ends are <= x."""
        j = int(np.searchsorted(self.index, x, side="right"))
        if j == 0:
            return 0
        lo = (j - 1) * INDEX_EVERY
        block = self.file.read(lo, lo + INDEX_EVERY).astype(np.int64)
        return lo + int(np.searchsorted(block, x, side="right"))

    def ends_in(self, a: int, b: int) -> np.ndarray:
        """The ends e with a < e <= b, ascending, int64."""
        i0, i1 = self.rank(a), self.rank(b)
        return self.file.read(i0, i1).astype(np.int64)

    def all_ends(self, chunk: int = 1 << 20):
        """The ends in ascending chunks of int64 (never all at once)."""
        for lo in range(0, self.count, chunk):
            yield self.file.read(lo, lo + chunk).astype(np.int64)


class ShardSet:
    """A prepared split: its shards' tokens as one stream of `size` tokens, and its documents.

    `shards`: (tokens path, docs path, tokens, documents) per shard, in order. Reads and searches
    refuse a changed file (DataChanged); ValueError at open for a missing or short file.
    """

    def __init__(self, shards: list[tuple[Path, Path, int, int]], dtype, *, what: str):
        self.what = what
        for t, d, n, nd in shards:
            for path, want in ((t, n * np.dtype(dtype).itemsize), (d, nd * 8)):
                got = Path(path).stat().st_size
                if got != want:
                    raise ValueError(f"{what}: {path} holds {got} bytes, not the {want} its "
                                     "manifest says: it changed since `dropless data prepare`; "
                                     "prepare the data again")
        self.tokens = [TokenFile(t, dtype, count=n, what=what) for t, _, n, _ in shards]
        self.docs = [DocEnds(d, count=nd, num_tokens=n, what=what) for _, d, n, nd in shards]
        self.base_K = np.cumsum([0] + [n for *_, n, _ in shards]).astype(np.int64)
        self.size = int(self.base_K[-1])
        self.num_documents = int(sum(nd for *_, nd in shards))
        self.dtype = np.dtype(dtype)

    def __len__(self) -> int:
        return self.size

    def check(self) -> None:
        """DataChanged when any of the split's files changed since open."""
        for f in self.tokens:
            f.check()
        for d in self.docs:
            d.file.check()

    def _shards_of(self, lo: int, hi: int) -> range:
        k0 = int(np.searchsorted(self.base_K, lo, side="right")) - 1
        k1 = int(np.searchsorted(self.base_K, hi, side="left"))
        return range(max(k0, 0), min(k1, len(self.tokens)))

    def read(self, lo: int, hi: int) -> np.ndarray:
        """Global tokens [lo, hi), across shard boundaries."""
        lo, hi = max(0, lo), min(self.size, hi)
        parts = [self.tokens[k].read(lo - int(self.base_K[k]), hi - int(self.base_K[k]))
                 for k in self._shards_of(lo, hi)]
        return np.concatenate(parts) if parts else np.zeros((0,), self.dtype)

    def __getitem__(self, key) -> np.ndarray:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("a ShardSet is read by a slice with step 1")
        lo, hi, _ = key.indices(self.size)
        return self.read(lo, hi)

    def starts_in(self, a: int, b: int) -> np.ndarray:
        """Global document starts p with a < p <= b (a shard's end is the next one's start;
        the stream's end is no start), ascending int64."""
        out = []
        for k in self._shards_of(a, b + 1):
            base = int(self.base_K[k])
            out.append(self.docs[k].ends_in(a - base, b - base) + base)
        p = np.concatenate(out) if out else np.zeros((0,), np.int64)
        return p[p < self.size]

    def document_lengths(self):
        """Each document's length in tokens, in ascending chunks (int64)."""
        for d in self.docs:
            prev = 0
            for ends in d.all_ends():
                yield np.diff(ends, prepend=prev)
                prev = int(ends[-1])


HASH_AT_START_BYTES = 2 << 30   # a split up to this size has its token files hashed at start


def open_prepared(folder: Path, manifest, split: str | tuple[str, ...], *,
                  vocab_size: int | None) -> ShardSet:
    """The `split` of the prepared dataset in `folder` (its validated data.manifest.Manifest),
    or several splits' shards one after the other.

    Every file must exist with the size the manifest says; the `.docs` files are hashed and
    their ends checked (increasing, the last = the shard's tokens); a split of at most
    HASH_AT_START_BYTES has its `.tokens` hashed too, and its ids checked against
    `vocab_size` (a larger one relies on sizes, identity and `DataChanged` while training).
    Raises ValueError naming the file for anything that differs.
    """
    what = f"data={str(folder)!r}"
    item = np.dtype(manifest.dtype).itemsize
    entries = [sh for sp in ((split,) if isinstance(split, str) else split)
               for sh in manifest.splits[sp]]
    rows = []
    for sh in entries:
        t, d = Path(folder) / sh.tokens_file, Path(folder) / sh.docs_file
        for p in (t, d):
            if not p.exists():
                raise ValueError(f"{what}: shard file {p} is missing (named by "
                                 f"{Path(folder) / 'manifest.json'}); prepare the data again")
        rows.append((t, d, sh.tokens, sh.documents))
    ss = ShardSet(rows, manifest.dtype, what=what)
    small = ss.size * item <= HASH_AT_START_BYTES
    for sh, f, docs in zip(entries, ss.tokens, ss.docs):
        _check_hash(docs.file, sh.docs_sha256, what)
        _check_ends(docs, sh.tokens, what)
        if small:
            _check_hash(f, sh.sha256, what, vocab_size=vocab_size)
    return ss


def _check_hash(f: TokenFile, want: str, what: str, *, vocab_size: int | None = None) -> None:
    """ValueError unless the file's bytes hash to `want` (the change is what a user must
    hear about first) and its ids are < vocab_size."""
    h, bad = hashlib.sha256(), None
    for lo in range(0, f.size, CHUNK):
        a = f.read(lo, lo + CHUNK)
        h.update(a.tobytes())
        if bad is None and vocab_size is not None and a.size and int(a.max()) >= vocab_size:
            i = int(np.flatnonzero(a >= vocab_size)[0])
            bad = (lo + i, int(a[i]))
    if h.hexdigest() != want:
        raise ValueError(f"{what}: {f.path}'s sha256 differs from its manifest's: it changed "
                         "since `dropless data prepare`; prepare the data again")
    if bad is not None:
        raise ValueError(f"{what}: {f.path} holds token id {bad[1]} at position {bad[0]}, "
                         f"beyond the model's vocabulary (model.vocab_size={vocab_size})")


def _check_ends(d: DocEnds, tokens: int, what: str) -> None:
    prev = 0
    for ends in d.all_ends():
        if ends[0] <= prev or np.any(ends[1:] <= ends[:-1]):
            raise ValueError(f"{what}: {d.file.path}: document ends are not increasing; "
                             "prepare the data again")
        prev = int(ends[-1])
    if prev != tokens:
        raise ValueError(f"{what}: {d.file.path}: the last document ends at {prev}, not at the "
                         f"shard's {tokens} tokens; prepare the data again")
