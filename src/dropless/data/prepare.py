"""`dropless data prepare`: sources -> token shards + manifest (format: `data.manifest`).

Legend: N documents of a chunk, T tokens.

The pipeline: the main process reads each file in chunks (`readers.text_chunks`: raw JSONL lines
or a column's strings; it only reads and decompresses), worker processes parse and tokenize the
chunks (`prepare_workers`: the `tokenizers` batch encoder, one thread each; as many processes
as asked for, up to its MAX_WORKERS, no more than the inputs have chunks for, and no more than
the memory available holds, said in a note on stderr when that makes it fewer), and the main
process takes the results back in reading order and appends each document to its split's open
shard. The output is therefore the same for any number of workers. At most `2 * workers` chunks
are in flight and a shard is written to disk as it grows, so memory is bounded whatever the
input's size. A text file larger than `readers.TEXT_WHOLE_BYTES` (one document that no chunk
should hold whole, `readers.streamed`) is no worker's: the main process reads it in parts and
encodes it as it reads (`_stream_text`, `prepare_workers.stream_document`), appending its tokens
to the open shard as they come, with the ids and the shards of the whole file as one chunk.

What each document becomes:
* its text encoded without the tokenizer's special tokens, then BOS first when `add_bos` and EOS
  last when `add_eos`; a text that encodes to no token is skipped (counted per source);
* held out for eval when `corpus.is_eval_document(identity, eval_fraction)` holds, identity =
  the file's path relative to its source's root, ':' and the record index (`readers.identity`);
* a training document of a source of weight w is written floor(w) times, and once more when the
  CRC32 of "weight:" + identity, over 2**32, is below w - floor(w) (so 0.5 keeps a stable half
  of the documents, 2.5 writes each twice and half of them a third time); eval documents once.

Safety: one writer per output (`prepare_lock`, held for the whole run); each input is identified
by the SHA-256 of its bytes, computed before any work; a file reached twice (named twice, a glob
and a name, a link) is refused (`_refuse_repeated`); the resume state is written before the
first token, so a run killed at any point resumes; an input whose stat (size, mtime, inode)
differs after its read from the one taken with its hash is refused (`_check_unchanged`), and a
resume checks the finished shards it keeps (`_check_finished`).

Shards: both splits' open shards are closed together ("a cut") after the document that brings
either to `shard_tokens`, so shard boundaries depend only on the input and the settings. At each
cut the shard files are written beside and renamed, then `OUT/.prepare/state.json` records the
input position reached; a killed run started again with the same command resumes from the last
cut (finished shards kept, anything after them removed). manifest.json is written last and the
state removed: a folder without manifest.json is not a dataset. A bad input (a ValueError: a bad
record, a source without text) ends the run and removes what it wrote, since the command must
change and nothing of it could be resumed.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import math
import os
import re
import shutil
import sys
import time
import zlib
from pathlib import Path
from typing import Callable

import numpy as np

from dropless.data import manifest as mf
from dropless.data import readers
from dropless.data.corpus import is_eval_document
from dropless.data.prepare_lock import PrepareLock
from dropless.data.prepare_workers import MAX_WORKERS, Encoder, encode_chunk, raw_tokenizer, \
    start_pool, stream_document, submit, worker_count
from dropless.data.text_pieces import UncuttableText
from dropless.data.tokenizer import HFTokenizer, make_tokenizer

STATE_DIR = ".prepare"
SHARD_NAME = re.compile(r"^(train|eval)-\d{5}\.(tokens|docs)$")
WRITE_BUFFER = 8 << 20


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrepareConfig:
    """What `prepare` reads and how it writes (module doc).

    sources: `PATH[@WEIGHT]` each (`readers.input_files`); out: the dataset folder;
    tokenizer: "byte" or a tokenizer.json path; tokenizer_source: how the user named it (kept in
    the manifest; default: `tokenizer`); add_bos: None = as the tokenizer's post-processor does;
    workers: tokenizing processes (0: in this process; at most MAX_WORKERS, and a run starts
    no more than its inputs have chunks for and the memory available holds, `worker_count`)."""
    sources: tuple[str, ...]
    out: str
    tokenizer: str = "byte"
    tokenizer_source: str = ""
    text_field: str = "text"
    eval_fraction: float = 0.02
    shard_tokens: int = 1 << 26
    add_bos: bool | None = None
    add_eos: bool = True
    workers: int = 1
    records_per_chunk: int = readers.CHUNK_RECORDS

    def __post_init__(self):
        if not self.sources:
            raise ValueError("prepare: give at least one source")
        if not 0 <= self.eval_fraction < 1:
            raise ValueError(f"--eval-fraction={self.eval_fraction} must be in [0, 1)")
        if self.shard_tokens < 1:
            raise ValueError(f"--shard-tokens={self.shard_tokens} must be >= 1")
        if not 0 <= self.workers <= MAX_WORKERS:
            raise ValueError(f"--workers={self.workers} must be from 0 (tokenize in this "
                             f"process) to {MAX_WORKERS}; the default, one per core "
                             f"({os.cpu_count() or 1} here), keeps every core busy")
        if not self.text_field:
            raise ValueError("--text-field must not be empty")
        if self.records_per_chunk < 1:
            raise ValueError(f"records_per_chunk={self.records_per_chunk} must be >= 1")


@dataclasses.dataclass(frozen=True)
class PrepareStatus:
    """Where a running `prepare` is: input bytes read of the total, documents and tokens
    written (a resumed run's earlier part included: `resumed_tokens` of them), shards finished."""
    bytes_done: int
    bytes_total: int
    documents: int
    tokens: int
    shards: int
    resumed_tokens: int = 0


# --- the shards ---------------------------------------------------------------------------------

class _ShardWriter:
    """The open shard of one split: tokens appended to a temporary file as they come (hashed on
    the way), document ends kept; `close` renames it into place and returns its Shard."""

    def __init__(self, out: Path, split: str, dtype: str, index: int):
        self.out, self.split, self.dtype = out, split, np.dtype(dtype).newbyteorder("<")
        self.index = index
        self._open()

    def _open(self) -> None:
        self.name = f"{self.split}-{self.index:05d}"
        self.tmp = self.out / f".{self.name}.tokens.tmp"
        self.file = open(self.tmp, "wb")
        self.hash = hashlib.sha256()
        self.buffer: list[bytes] = []
        self.buffered = 0
        self.tokens = 0
        self.ends: list[int] = []
        self.doc_start: int | None = None     # of a document coming in parts (`extend`)

    def add(self, tokens_T: np.ndarray, copies: int) -> None:
        data = tokens_T.astype(self.dtype, copy=False).tobytes()
        for _ in range(copies):
            self.buffer.append(data)
            self.buffered += len(data)
            self.tokens += tokens_T.size
            self.ends.append(self.tokens)
        if self.buffered >= WRITE_BUFFER:
            self._flush()

    def extend(self, tokens_T: np.ndarray) -> None:
        """Append the next part of a document that comes in parts (`end_document` ends it)."""
        if self.doc_start is None:
            self.doc_start = self.tokens
        data = tokens_T.astype(self.dtype, copy=False).tobytes()
        self.buffer.append(data)
        self.buffered += len(data)
        self.tokens += tokens_T.size
        if self.buffered >= WRITE_BUFFER:
            self._flush()

    def end_document(self, copies: int) -> None:
        """End the document `extend` gave the parts of, written `copies` (>= 1) times in all: the
        copies after the first are read back from the file, a WRITE_BUFFER at a time."""
        start, end, self.doc_start = self.doc_start, self.tokens, None
        self.ends.append(end)
        if copies < 2:
            return
        self._flush()
        self.file.flush()
        item = self.dtype.itemsize
        with open(self.tmp, "rb") as f:
            for _ in range(copies - 1):
                f.seek(start * item)
                left = (end - start) * item
                while left:
                    block = f.read(min(left, WRITE_BUFFER))
                    self.hash.update(block)
                    self.file.write(block)
                    left -= len(block)
                self.tokens += end - start
                self.ends.append(self.tokens)

    def _flush(self) -> None:
        for b in self.buffer:
            self.hash.update(b)
            self.file.write(b)
        self.buffer, self.buffered = [], 0

    def close(self) -> mf.Shard | None:
        """Finish the shard (None when it holds no document) and open the next."""
        self._flush()
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        if not self.ends:
            self.tmp.unlink()
            self._open()
            return None
        ends = np.asarray(self.ends, mf.DOCS_DTYPE).tobytes()
        docs_tmp = self.out / f".{self.name}.docs.tmp"
        with open(docs_tmp, "wb") as f:
            f.write(ends)
            f.flush()
            os.fsync(f.fileno())
        shard = mf.Shard(tokens_file=f"{self.name}.tokens", docs_file=f"{self.name}.docs",
                         tokens=self.tokens, documents=len(self.ends),
                         sha256=self.hash.hexdigest(),
                         docs_sha256=hashlib.sha256(ends).hexdigest())
        os.replace(self.tmp, self.out / shard.tokens_file)
        os.replace(docs_tmp, self.out / shard.docs_file)
        self.index += 1
        self._open()
        return shard

    def abandon(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)


def copies_of(identity: str, weight: float) -> int:
    """How many times a training document of a source of `weight` is written (module doc)."""
    whole = math.floor(weight)
    frac = weight - whole
    return whole + int(frac > 0 and zlib.crc32(b"weight:" + identity.encode("utf-8"))
                       < frac * 2 ** 32)


# --- the run ------------------------------------------------------------------------------------

@dataclasses.dataclass
class _FileStats:
    documents: int = 0
    tokens: int = 0
    skipped: int = 0
    sha256: str | None = None


class _Run:
    """One `prepare` from its resume point to the manifest."""

    def __init__(self, cfg: PrepareConfig, created_by: str,
                 on_progress: Callable[[PrepareStatus], None] | None):
        self.cfg, self.created_by, self.on_progress = cfg, created_by, on_progress
        self.out = Path(cfg.out)
        self.groups = [(spec, readers.input_files(spec)) for spec in cfg.sources]
        self.files = [f for _, files in self.groups for f in files]
        self.tok = make_tokenizer(cfg.tokenizer)
        self.enc = _encoder(self.tok, cfg)
        _refuse_repeated(self.groups)
        self.hashes: list[str] = []
        self.settings: dict = {}
        self.stats = [_FileStats() for _ in self.files]
        self.shards: dict[str, list[mf.Shard]] = {s: [] for s in mf.SPLITS}
        self.position = (0, 0)

    def _settings(self) -> dict:
        """What a resumed run must share with the one it resumes (inputs as found on disk)."""
        c = self.cfg
        return {"sources": list(c.sources), "tokenizer": _tokenizer_id(c).__dict__,
                "text_field": c.text_field, "eval_fraction": c.eval_fraction,
                "shard_tokens": c.shard_tokens, "bos": self.enc.bos, "eos": self.enc.eos,
                "dtype": self.enc.dtype,
                "files": [[str(f.path), f.size, h] for f, h in zip(self.files, self.hashes)]}

    # resume state

    def start(self) -> None:
        """Refuse an OUT that holds something else; load the state of an interrupted run."""
        if (self.out / mf.MANIFEST).exists():
            raise ValueError(f"{self.out} already holds a prepared dataset ({mf.MANIFEST}); "
                             "remove it or choose another output folder")
        state_path = self.out / STATE_DIR / "state.json"
        if self.out.exists() and not self.out.is_dir():
            raise ValueError(f"output {self.out} is a file, not a folder")
        if self.out.is_dir() and not (self.out / STATE_DIR).is_dir():
            if any(self.out.iterdir()):
                raise ValueError(f"output folder {self.out} is not empty and holds no "
                                 "unfinished prepare; choose an empty or new folder")
        self.lock = PrepareLock(self.out / STATE_DIR)
        if (self.out / mf.MANIFEST).exists():
            raise ValueError(f"{self.out} already holds a prepared dataset ({mf.MANIFEST}); "
                             "remove it or choose another output folder")
        # inputs are identified by their content: a rewritten file of the same size and time
        # is another input; the stat taken with the hash catches a change while it is read
        self.identities = [_identity(f.path) for f in self.files]
        self.hashes = [mf.file_sha256(f.path) for f in self.files]
        for fi in range(len(self.files)):
            self._check_unchanged(fi)
        self.settings = self._settings()
        for st, h in zip(self.stats, self.hashes):
            st.sha256 = h
        if state_path.is_file():
            self._load(state_path)
        self._remove_unrecorded()
        # the resume state exists before any work: a run killed at any point resumes
        self._save_state()

    def _load(self, path: Path) -> None:
        try:
            state = json.loads(path.read_text())
            saved = state["settings"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: unreadable ({e}); remove {self.out} to start "
                             "again") from None
        for key, value in self.settings.items():
            if saved.get(key) != value:
                what = ("an input file changed (its content) or the files differ"
                        if key == "files" else f"{key} differs")
                raise ValueError(f"{self.out} holds an unfinished prepare of other inputs or "
                                 f"settings ({what}: was {json.dumps(saved.get(key))[:120]}); "
                                 f"remove {self.out} to start again, or run the same command")
        self.position = tuple(state["position"])
        self.shards = {s: [mf.Shard(**d) for d in state["shards"][s]] for s in mf.SPLITS}
        for st, d in zip(self.stats, state["stats"]):
            st.__dict__.update(d)
        for s in mf.SPLITS:
            for sh in self.shards[s]:
                self._check_finished(sh)

    def _check_finished(self, sh: mf.Shard) -> None:
        """A shard the state records as finished must still be the one written (the manifest
        will vouch for it): refused, naming it, when missing, cut or rewritten since."""
        item = np.dtype(self.enc.dtype).itemsize
        for name, size, sha in ((sh.tokens_file, sh.tokens * item, sh.sha256),
                                (sh.docs_file, sh.documents * 8, sh.docs_sha256)):
            path = self.out / name
            problem = ("is missing" if not path.is_file() else
                       f"holds {path.stat().st_size} bytes, not {size}"
                       if path.stat().st_size != size else
                       "has another sha256" if mf.file_sha256(path) != sha else None)
            if problem:
                raise ValueError(f"{path} {problem}: it changed since the interrupted `data "
                                 f"prepare` wrote it; remove {self.out} to start again")

    def _check_unchanged(self, fi: int) -> None:
        """Input `fi` must be the file that was hashed, of the size found (no append, cut or
        rewrite while this run reads it): ValueError naming it otherwise."""
        f, was = self.files[fi], self.identities[fi]
        try:
            now = _identity(f.path)
        except OSError as e:
            now = (e.strerror,)
        if now != was or was[0] != f.size:
            raise ValueError(f"{f.path} changed while `data prepare` read it (size "
                             f"{f.size} -> {now[0]} bytes, or rewritten); let it be written "
                             "completely, then run the command again")

    def _remove_unrecorded(self) -> None:
        """Delete shard files no recorded shard names and temporary files (a killed run's)."""
        keep = {n for s in mf.SPLITS for sh in self.shards[s]
                for n in (sh.tokens_file, sh.docs_file)}
        for p in self.out.iterdir():
            if (SHARD_NAME.match(p.name) and p.name not in keep) or (
                    p.name.startswith(".") and p.name.endswith(".tmp")):
                p.unlink()

    def _save_state(self) -> None:
        mf.write_json_atomic(self.out / STATE_DIR / "state.json", {
            "settings": self.settings, "position": list(self.position),
            "shards": {s: [dataclasses.asdict(x) for x in self.shards[s]] for s in mf.SPLITS},
            "stats": [dataclasses.asdict(x) for x in self.stats]})

    # the loop

    def run(self) -> mf.Manifest:
        created = not self.out.exists()
        self.lock, started = None, False
        try:
            self.start()
            started = True
            return self._run()
        except ValueError:
            # a bad input: the command must change, so nothing written here can be resumed
            if started:
                self._discard(remove_out=created)
            raise
        finally:
            if self.lock is not None:
                self.lock.release()

    def _discard(self, *, remove_out: bool) -> None:
        self.shards = {s: [] for s in mf.SPLITS}
        self._remove_unrecorded()
        shutil.rmtree(self.out / STATE_DIR, ignore_errors=True)
        if remove_out and not any(self.out.iterdir()):
            self.out.rmdir()

    def _run(self) -> mf.Manifest:
        self.resumed_tokens = sum(sh.tokens for s in mf.SPLITS for sh in self.shards[s])
        self.writers = {s: _ShardWriter(self.out, s, self.enc.dtype, len(self.shards[s]))
                        for s in mf.SPLITS}
        self.total = sum(f.size for f in self.files)
        self.done_bytes = sum(f.size for f in self.files[:self.position[0]])
        self.last_report = 0.0
        count = worker_count(self.cfg.workers, self.files, self.cfg.records_per_chunk,
                             text_field=self.cfg.text_field, tokenizer=self.cfg.tokenizer)
        if count.note:
            print(count.note, file=sys.stderr, flush=True)
        self.workers = count.count
        pool = start_pool(self.workers, self.enc)
        try:
            self._read_all(pool)
            self.position = (len(self.files), 0)
            self._cut()
        finally:
            for w in self.writers.values():
                w.abandon()
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
        m = self._manifest()
        mf.write_manifest(self.out, m)
        shutil.rmtree(self.out / STATE_DIR)
        self._report()
        return m

    def _read_all(self, pool) -> None:
        first, start = self.position
        for fi in range(first, len(self.files)):
            f = self.files[fi]
            base = self.done_bytes
            try:
                if not readers.streamed(f):
                    self._read_chunks(fi, base, start if fi == first else 0, pool)
                elif fi != first or start == 0:
                    self._stream_text(fi, base)
            except ValueError:
                self._check_unchanged(fi)    # a line cut by a change is the change, not bad JSON
                raise
            self._check_unchanged(fi)
            self.done_bytes = base + f.size

    def _read_chunks(self, fi: int, base: int, start: int, pool) -> None:
        """Encode file `fi`'s records from index `start` on in the pool's workers, at most
        2 x workers chunks in flight, consumed in reading order."""
        f, pending = self.files[fi], collections.deque()
        for chunk in readers.text_chunks(f, self.cfg.text_field, start=start,
                                         records_per_chunk=self.cfg.records_per_chunk):
            job = submit(pool, encode_chunk, (f, chunk, self.cfg.text_field))
            pending.append((fi, chunk.indices, base + chunk.bytes_done, job))
            while len(pending) > 2 * max(1, self.workers):
                self._consume(*pending.popleft())
        while pending:
            self._consume(*pending.popleft())

    def _consume(self, fi: int, indices: list[int], bytes_done: int, job) -> None:
        lengths_N, tokens_T = job.result()
        f, st = self.files[fi], self.stats[fi]
        ends = np.cumsum(lengths_N)
        for j, idx in enumerate(indices):
            n = int(lengths_N[j])
            if n == 0:
                st.skipped += 1
                continue
            doc = tokens_T[ends[j] - n: ends[j]]
            ident = readers.identity(f, idx)
            st.documents += 1
            st.tokens += n
            if is_eval_document(ident, self.cfg.eval_fraction):
                self.writers["eval"].add(doc, 1)
            else:
                self.writers["train"].add(doc, copies_of(ident, f.weight))
            if max(w.tokens for w in self.writers.values()) >= self.cfg.shard_tokens:
                self.position = (fi, idx + 1)
                self._cut()
        self._report(bytes_done)

    def _stream_text(self, fi: int, base: int) -> None:
        """Encode text file `fi` (one document, `readers.streamed`) here, in parts as it is
        read, appending its tokens to its split's open shard as they come
        (`prepare_workers.stream_document`): the same tokens as a worker's chunk of the whole
        text, in memory that does not grow with the file. A cut follows the document, as
        `_consume` makes it; a run killed inside it resumes from the cut before (the open
        shard's temporary file is removed then)."""
        f, st = self.files[fi], self.stats[fi]
        ident = readers.identity(f, 0)
        if is_eval_document(ident, self.cfg.eval_fraction):
            writer, copies = self.writers["eval"], 1
        else:
            writer, copies = self.writers["train"], copies_of(ident, f.weight)

        def parts():
            for text, done in readers.text_parts(f):
                yield text
                self._report(base + done)

        tok = None if self.cfg.tokenizer == "byte" else self.tok.raw
        n = 0
        try:
            for part_T in stream_document(tok, parts(), readers.text_size(f), self.enc):
                n += part_T.size
                if copies:
                    writer.extend(part_T)
        except UncuttableText as e:
            raise ValueError(f"{readers.where(f, 0)}: {e}") from None
        if n == 0:
            st.skipped += 1
            return
        st.documents += 1
        st.tokens += n
        if copies:
            writer.end_document(copies)
        if max(w.tokens for w in self.writers.values()) >= self.cfg.shard_tokens:
            self.position = (fi, 1)
            self._cut()

    def _cut(self) -> None:
        """Close both open shards, then record the position reached (module doc)."""
        for s, w in self.writers.items():
            shard = w.close()
            if shard is not None:
                self.shards[s].append(shard)
        self._save_state()

    def _report(self, bytes_done: int | None = None) -> None:
        """Call on_progress (at most 5 times a second; bytes_done None: the end, always)."""
        now = time.monotonic()
        if self.on_progress is None or (bytes_done is not None and now - self.last_report < 0.2):
            return
        self.last_report = now
        done = self.total if bytes_done is None else bytes_done
        shards = [sh for s in mf.SPLITS for sh in self.shards[s]]
        self.on_progress(PrepareStatus(
            bytes_done=done, bytes_total=self.total,
            documents=sum(sh.documents for sh in shards) + sum(
                len(w.ends) for w in self.writers.values()),
            tokens=sum(sh.tokens for sh in shards) + sum(
                w.tokens for w in self.writers.values()), shards=len(shards),
            resumed_tokens=self.resumed_tokens))

    def _manifest(self) -> mf.Manifest:
        for spec, files in self.groups:
            idx = [self.files.index(f) for f in files]
            if not any(self.stats[i].documents for i in idx):
                why = ("every record of it encodes to no token"
                       if any(self.stats[i].skipped for i in idx)
                       else "no record at all: only blank lines, or no rows")
                raise ValueError(f"source {spec!r} holds no document with text ({why})")
        if not self.shards["train"]:
            raise ValueError(f"the train split of {self.out} is empty (every document was "
                             f"held out: --eval-fraction={self.cfg.eval_fraction}); lower it")
        return mf.Manifest(
            tokenizer=_tokenizer_id(self.cfg), vocab_size=self.tok.vocab_size,
            dtype=self.enc.dtype, bos_id=self.tok.bos_id, eos_id=self.tok.eos_id,
            add_bos=self.enc.bos is not None, add_eos=self.enc.eos is not None,
            eval_fraction=self.cfg.eval_fraction,
            splits={s: tuple(self.shards[s]) for s in mf.SPLITS},
            sources=tuple(mf.Source(path=str(f.path), bytes=f.size, sha256=st.sha256,
                                    weight=f.weight, documents=st.documents, tokens=st.tokens,
                                    skipped=st.skipped)
                          for f, st in zip(self.files, self.stats)),
            created_by=self.created_by)


def _identity(path: Path) -> tuple[int, int, int, int]:
    """(size, mtime_ns, inode, device) of a file: another value means another content."""
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev


def _refuse_repeated(groups) -> None:
    """A file reached twice (named twice, by a glob and by name, or through a link) would
    double its documents: refused, naming both ways it was named."""
    seen: dict[Path, str] = {}
    for spec, files in groups:
        for f in files:
            real = Path(os.path.realpath(f.path))
            if real in seen:
                raise ValueError(f"{f.path} (source {spec!r}) is also read by source "
                                 f"{seen[real]!r}; name each file once (set a weight with "
                                 "PATH@WEIGHT to read it more often)")
            seen[real] = spec


def _tokenizer_id(cfg: PrepareConfig) -> mf.TokenizerId:
    if cfg.tokenizer == "byte":
        return mf.TokenizerId(kind="byte", source=cfg.tokenizer_source or "byte", sha256=None)
    return mf.TokenizerId(kind="hf", source=cfg.tokenizer_source or cfg.tokenizer,
                          sha256=mf.file_sha256(cfg.tokenizer))


def _encoder(tok, cfg: PrepareConfig) -> Encoder:
    """The BOS / EOS policy: add_bos None follows the tokenizer's post-processor."""
    if isinstance(tok, HFTokenizer):
        raw = raw_tokenizer(cfg.tokenizer)
        with_sp, without = raw.encode("a").ids, raw.encode("a", add_special_tokens=False).ids
        default_bos = (tok.bos_id is not None and with_sp[:1] == [tok.bos_id]
                       and without[:1] != [tok.bos_id])
    else:
        default_bos = False
    add_bos = default_bos if cfg.add_bos is None else cfg.add_bos
    if add_bos and tok.bos_id is None:
        raise ValueError(f"--add-bos: tokenizer {tok.name} has no BOS token")
    if cfg.add_eos and tok.eos_id is None:
        raise ValueError(f"--add-eos: tokenizer {tok.name} has no EOS token")
    return Encoder(tokenizer=cfg.tokenizer, dtype=mf.dtype_for_vocab(tok.vocab_size),
                    bos=tok.bos_id if add_bos else None, eos=tok.eos_id if cfg.add_eos else None)


def prepare(cfg: PrepareConfig, *, created_by: str,
            on_progress: Callable[[PrepareStatus], None] | None = None) -> mf.Manifest:
    """Read `cfg.sources`, tokenize and write the dataset folder `cfg.out` (module doc); returns
    its manifest. `on_progress` is called at most 5 times a second and once at the end. Raises
    ValueError naming the file and line / row of a bad record, a source that does not exist or
    holds no text, an output folder that holds something else or an unfinished prepare of other
    inputs. A run refused for a bad input removes what it wrote (an output folder it created
    too); a killed or failed one leaves only finished shards and the resume state."""
    return _Run(cfg, created_by, on_progress).run()
