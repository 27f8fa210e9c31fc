"""The tokenizing side of `data prepare` (`data.prepare`): what a worker process does with a
chunk of records, and the pool of those processes.

Legend: N documents of a chunk, T tokens.

A worker parses a chunk's raw records (`readers.chunk_texts`) and encodes the texts with the
`tokenizers` batch encoder, one thread each (`encode_texts`). `start_pool(0, ...)` tokenizes in
the calling process instead; `worker_count` says how many processes a run starts: what it asked
for, up to MAX_WORKERS, no more than its inputs have chunks for, and no more than the memory
available holds (`worker_memory`; a note says so when that makes it fewer than asked).

What one worker costs at its peak (`worker_memory`; measured with fresh workers, VmHWM less the
idle worker's VmRSS, docs/data.md): the process; its tokenizer; and the chunk it encodes, which
`readers.chunk_text_bytes` sizes per input kind. `encode_texts` encodes a chunk's texts in
slices of at most SLICE_BYTES (a text larger than that is a slice of its own), so that
`tokenizers`' Encodings (ids, type ids, token strings, offsets, masks: 50-70 bytes a token) live
for one slice at a time: SLICE_PEAK per byte of the largest slice, with a tokenizer.json. The
rest grows with the chunk: its payload and pickle, the texts (Python holds a str at 1, 2 or 4
bytes a character, by its widest one), and the tokens, held twice and pickled once (2 or 4 bytes
a token each): ENCODE_PEAK per byte of the chunk's text. The token terms follow the tokens per
byte; the figures take one token a byte, the most a byte-level or byte-fallback tokenizer makes,
so that the bound holds for any text. A text larger than a slice (a text file is one string,
one document) is encoded alone, in pieces of about SLICE_BYTES whose ids are spliced where
`text_pieces` has checked that the splice changes none (the same ids as the string encoded
whole); `tokenizers` keeps offsets and alignments per byte of a string while it encodes it
(~300 bytes a byte of one long string, against ~80 for a slice of many records), so a piece
costs PIECE_PEAK per byte of it, and the text's share grows as a chunk of records' does. A text
no cut of which passes its checks within GROW slices is encoded whole only where `piece_fits`
finds the memory for it, and refused in one line otherwise. A text file larger than
`readers.TEXT_WHOLE_BYTES` is no worker's chunk: the main process encodes it as it reads it
(`stream_document`), in `stream_peak` whatever its size. The main process keeps 2 chunks
queued per worker (each payload, and its pickle while it waits to be sent): QUEUED_PEAK. What
the main process reads (one Parquet row group, one zstd block) does not grow with the workers;
MEMORY_SHARE leaves room for it.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing
import os
from typing import Iterable, Iterator

import numpy as np

from dropless.data import readers
from dropless.data.text_pieces import UncuttableText, stream_ids, text_ids
from dropless.data.tokenizer import tokenizer_file

MAX_WORKERS = 1024    # tokenizing processes: more is a typo (each holds a tokenizer in memory)
WORKER_BYTES = 32 << 20   # an idle worker: 17 MB private memory (30 MB resident), measured as
#                           the `dropless` command starts it
TOKENIZER_PEAK = 14       # loading a tokenizer.json: x its file size (2.3 MB: 30 MB, 9.3: 109)
SLICE_BYTES = 1 << 20     # text `encode_texts` encodes at once (its Encodings live that long)
# a worker's peak while it encodes a chunk, less its idle size, per byte of the chunk's text,
# by (chunk: many records or one whole text, tokenizer); measured, rounded up (module doc)
ENCODE_PEAK = {("records", "byte"): 13, ("records", "tokenizer.json"): 24,
               ("text", "byte"): 13, ("text", "tokenizer.json"): 24}
SLICE_PEAK = 80           # with a tokenizer.json, per byte of a chunk's largest slice of records
PIECE_PEAK = 320          # with a tokenizer.json, per byte of one text's piece encoded alone
QUEUED_PEAK = 4           # the main process's 2 queued chunks per worker: payload + pickle each
STREAM_HELD = 48 << 20    # the main process streaming a text file (`stream_document`): the text
#                           it holds (a few slices), its parts, the open shard's write buffer
MEMORY_SHARE = 0.8        # of the memory available, what the workers may take together


@dataclasses.dataclass(frozen=True, kw_only=True)
class Encoder:
    """What a worker needs to turn texts into documents' tokens."""
    tokenizer: str
    dtype: str
    bos: int | None     # prepended when set
    eos: int | None     # appended when set


_WORKER: dict = {}


def raw_tokenizer(name: str):
    """The `tokenizers.Tokenizer` of a tokenizer.json path (`tokenizer_file`: its
    padding and truncation off), or None for "byte"."""
    return None if name == "byte" else tokenizer_file(name)


def init_worker(enc: Encoder) -> None:
    """Load the tokenizer of `enc` into this process (a worker's start, or workers=0)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"   # one thread per worker process
    _WORKER["enc"], _WORKER["tok"] = enc, raw_tokenizer(enc.tokenizer)


def text_slices(sizes_N: list[int], limit: int) -> list[tuple[int, int]]:
    """[start, stop) of slices of consecutive texts, in order and covering all N, whose sizes sum
    to at most `limit`; a text larger than `limit` is a slice of its own; no texts, no slices.
    Sizes [3, 0, 5, 9, 1] at limit 8: (0, 3) of 3 + 0 + 5, (3, 4) the 9 alone, (4, 5) the 1."""
    slices, start, total = [], 0, 0
    for i, n in enumerate(sizes_N):
        if i > start and total + n > limit:
            slices.append((start, i))
            start, total = i, 0
        total += n
    if sizes_N:
        slices.append((start, len(sizes_N)))
    return slices


def utf8_size(text: str) -> int:
    """The bytes of `text` in UTF-8 (an ASCII str's length: `isascii` reads a flag, no copy)."""
    return len(text) if text.isascii() else len(text.encode("utf-8"))


def slice_ids(tok, texts: list[str], dtype: str) -> list[np.ndarray]:
    """Each text's ids by the `tokenizers.Tokenizer` `tok` (None: its UTF-8 bytes, uint8), without
    special tokens; the texts' Encodings, made at once, are dropped on return. A text larger
    than SLICE_BYTES (alone in its slice) is encoded in pieces of about SLICE_BYTES with the
    same ids (`text_pieces.text_ids`; UncuttableText where it cannot be)."""
    if tok is None:
        return [np.frombuffer(t.encode("utf-8"), np.uint8) for t in texts]
    if len(texts) == 1 and utf8_size(texts[0]) > SLICE_BYTES:
        return [text_ids(tok, texts[0], dtype, limit_bytes=SLICE_BYTES, fits=piece_fits)]
    return [np.array(e.ids, dtype)
            for e in tok.encode_batch_fast(texts, add_special_tokens=False)]


def stream_document(tok, parts: Iterable[str], total_bytes: int,
                    enc: Encoder) -> Iterator[np.ndarray]:
    """The tokens `framed` gives one text (BOS, its ids, EOS as `enc` says; nothing for a text of
    no token) as arrays of enc.dtype one after another, for the text that is `parts` joined
    (`total_bytes` of UTF-8): encoded by `tok` as `slice_ids` encodes it whole (None: its UTF-8
    bytes), reading the parts as it goes (`text_pieces.stream_ids`), so that only a few slices
    of it are held at a time. Raises UncuttableText."""
    if tok is None:
        ids = (np.frombuffer(p.encode("utf-8"), np.uint8) for p in parts)
    else:
        ids = stream_ids(tok, parts, total_bytes, enc.dtype, limit_bytes=SLICE_BYTES,
                         fits=piece_fits)
    started = False
    for a in ids:
        if not a.size:
            continue
        if not started and enc.bos is not None:
            yield np.array([enc.bos], enc.dtype)
        started = True
        yield a.astype(enc.dtype, copy=False)
    if started and enc.eos is not None:
        yield np.array([enc.eos], enc.dtype)


def stream_peak(tokenizer: str) -> int:
    """Bytes the main process takes over its idle size while it encodes a text file in parts
    (`stream_document`), whatever the file's size: STREAM_HELD, and with a tokenizer.json
    ("byte" otherwise) one piece of SLICE_BYTES encoded alone (PIECE_PEAK a byte). A piece
    grows past a slice (to GROW slices, or the rest of the text) only where `piece_fits`."""
    return STREAM_HELD + (0 if tokenizer == "byte" else PIECE_PEAK * SLICE_BYTES)


def piece_fits(text_bytes: int) -> bool:
    """Whether encoding a piece of `text_bytes` of one text at once (PIECE_PEAK a byte) fits in
    MEMORY_SHARE of the memory available now (unknown: yes); asked only for a text no cut of
    which passes its checks within a slice (`text_pieces`)."""
    room = available_memory()
    return room is None or PIECE_PEAK * text_bytes <= MEMORY_SHARE * room


def framed(ids: list[np.ndarray], enc: Encoder) -> tuple[np.ndarray, np.ndarray]:
    """(lengths_N int64, tokens_T of enc.dtype): the N documents' `ids` one after another, each
    between BOS and EOS as `enc` says; a document of no token has length 0 and no BOS / EOS."""
    extra = (enc.bos is not None) + (enc.eos is not None)
    lengths_N = np.fromiter((a.size + extra if a.size else 0 for a in ids), np.int64, len(ids))
    out_T = np.empty(int(lengths_N.sum()), enc.dtype)
    at = 0
    for a in ids:
        if not a.size:
            continue
        if enc.bos is not None:
            out_T[at] = enc.bos
            at += 1
        out_T[at: at + a.size] = a
        at += a.size
        if enc.eos is not None:
            out_T[at] = enc.eos
            at += 1
    return lengths_N, out_T


def encode_texts(tok, texts: list[str], enc: Encoder) -> tuple[np.ndarray, np.ndarray]:
    """(lengths_N int64, tokens_T of enc.dtype): each text's ids by the `tokenizers.Tokenizer`
    `tok` (None: UTF-8 bytes) without its special tokens, with BOS / EOS as `enc` says; a text of
    no token has length 0 (and no BOS / EOS either). The texts are encoded in slices of at most
    SLICE_BYTES of UTF-8 (`text_slices`), each text with the ids `tok.encode` gives it whole and
    alone, so only one slice's Encodings live at a time; a text larger than SLICE_BYTES (a
    whole text file) is a slice of its own, encoded in pieces (`slice_ids`). Raises
    UncuttableText, its `index` the text's, where such a text can be neither cut nor held."""
    slices = text_slices([utf8_size(t) for t in texts], SLICE_BYTES)
    parts = []
    for lo, hi in slices:
        try:
            parts.append(framed(slice_ids(tok, texts[lo:hi], enc.dtype), enc))
        except UncuttableText as e:
            e.index = lo
            raise
    if len(parts) == 1:
        return parts[0]
    return (np.concatenate([p[0] for p in parts] or [np.zeros(0, np.int64)]),
            np.concatenate([p[1] for p in parts] or [np.zeros(0, enc.dtype)]))


def encode_chunk(file: readers.InputFile, chunk: readers.Chunk, text_field: str):
    """(lengths_N, tokens_T) of a chunk's texts (`encode_texts`), in a started worker."""
    texts = readers.chunk_texts(file, chunk, text_field)
    try:
        return encode_texts(_WORKER["tok"], texts, _WORKER["enc"])
    except UncuttableText as e:
        raise ValueError(f"{readers.where(file, chunk.indices[e.index])}: {e}") from None


class _Done:
    """An already computed result with a Future's `result` (workers=0)."""

    def __init__(self, fn, args):
        self.value = fn(*args)

    def result(self):
        return self.value


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkerCount:
    """How many worker processes a run starts, and `note`: one line saying what was asked, what
    runs and why, when the memory available made it fewer than asked (else None)."""
    count: int
    note: str | None = None


def encode_peak(chunk: str, tokenizer: str, text_bytes: int, records_per_chunk: int) -> int:
    """Bytes a worker takes over its idle size to encode a chunk of `text_bytes` of text (module
    doc), by the kind of chunk ("records" or "text") and of `tokenizer` ("byte" or
    "tokenizer.json"). With a tokenizer.json, a chunk of records' largest slice is taken as
    SLICE_BYTES (never more than the chunk) at SLICE_PEAK, or, where its mean record is larger
    than that, one text's piece of SLICE_BYTES at PIECE_PEAK; a text's largest piece is
    SLICE_BYTES, or the whole text where it is smaller."""
    cost = ENCODE_PEAK[chunk, tokenizer] * text_bytes
    if tokenizer == "byte":
        return cost
    if chunk == "text":
        return cost + PIECE_PEAK * min(text_bytes, SLICE_BYTES)
    mean_record = -(-text_bytes // max(1, records_per_chunk))
    return cost + max(SLICE_PEAK * min(text_bytes, SLICE_BYTES),
                      PIECE_PEAK * min(mean_record, SLICE_BYTES))


def worker_memory(files: list[readers.InputFile], text_field: str, records_per_chunk: int,
                  tokenizer: str) -> tuple[int, readers.InputFile, int]:
    """(bytes one worker may take at its peak, counting its share of the main process's queue
    (module doc); the input file whose chunks make it most; the bytes of text in one of them)
    for `tokenizer` ("byte" or a tokenizer.json path) encoding `files`."""
    kind = "byte" if tokenizer == "byte" else "tokenizer.json"
    base = WORKER_BYTES + (0 if kind == "byte" else TOKENIZER_PEAK * os.path.getsize(tokenizer))
    sized = [(readers.chunk_text_bytes(f, text_field, records_per_chunk), f) for f in files]
    costs = [encode_peak("text" if f.kind == "text" else "records", kind, n, records_per_chunk)
             + QUEUED_PEAK * n for n, f in sized]
    worst = max(range(len(files)), key=costs.__getitem__)    # the first of equals
    return base + costs[worst], sized[worst][1], sized[worst][0]


def worker_count(workers: int, files: list[readers.InputFile], records_per_chunk: int, *,
                 text_field: str = "text", tokenizer: str = "byte",
                 available: int | None = None) -> WorkerCount:
    """The worker processes a run starts: `workers`, but no more than the chunks `files` can
    make when their sizes bound that (`readers.max_chunks`; a worker without a chunk would only
    start up), and no more than MEMORY_SHARE of `available` bytes (None: `available_memory()`;
    unknown: no bound) holds at `worker_memory` each, with a note then; at least 1. 0 stays 0
    (in this process). The output is the same for any count."""
    bounds = [readers.max_chunks(f, records_per_chunk) for f in files]
    if workers == 0 or None in bounds:
        count = workers
    else:
        count = max(1, min(workers, sum(bounds)))
    room = available_memory() if available is None and count > 1 else available
    if count <= 1 or room is None:
        return WorkerCount(count=count)
    each, file, text = worker_memory(files, text_field, records_per_chunk, tokenizer)
    fit = max(1, int(room * MEMORY_SHARE) // each)
    if fit >= count:
        return WorkerCount(count=count)
    tok = "the byte tokenizer" if tokenizer == "byte" else os.path.basename(tokenizer)
    return WorkerCount(count=fit, note=(
        f"note: data prepare starts {fit} tokenizing worker{'s' * (fit > 1)}, not the "
        f"{workers} of --workers: each may take ~{_size(each)} at its peak ({tok}, chunks of "
        f"~{_size(text)} of text in {file.path}) and {_size(room)} of memory is available; "
        "the output is the same"))


def _size(n: int) -> str:
    return f"{n / 2 ** 30:.1f} GiB" if n >= 2 ** 30 else f"{n / 2 ** 20:.0f} MiB"


def available_memory(proc: str = "/proc", cgroups: str = "/sys/fs/cgroup") -> int | None:
    """Bytes of memory this process can still take: the system's MemAvailable (/proc/meminfo;
    else free pages, os.sysconf), or less where a cgroup (v2 or v1) of this process or a folder
    above it sets a limit: the limit less its usage, page cache it may drop (inactive_file) not
    counted. None where neither can be read."""
    found = []
    try:
        with open(os.path.join(proc, "meminfo")) as f:
            found += [int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemAvailable:")]
    except OSError:
        pass
    if not found and hasattr(os, "sysconf") and "SC_AVPHYS_PAGES" in os.sysconf_names:
        found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    try:
        with open(os.path.join(proc, "self", "cgroup")) as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        if line.count(":") < 2:
            continue
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            base, names = cgroups, ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            base, names = (os.path.join(cgroups, "memory"),
                           ("memory.limit_in_bytes", "memory.usage_in_bytes",
                            "total_inactive_file"))
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):     # its own folder and every one above
            room = _cgroup_room(os.path.join(base, *parts[:depth]), *names)
            if room is not None:
                found.append(room)
    return min(found) if found else None


def _cgroup_room(folder: str, limit_file: str, usage_file: str, inactive: str) -> int | None:
    """A cgroup folder's limit less its usage (its inactive page cache not counted), or None
    where it has no limit or cannot be read."""
    try:
        with open(os.path.join(folder, limit_file)) as f:
            limit = f.read().strip()
        if limit == "max" or int(limit) >= 1 << 60:    # v1 writes "no limit" as ~2**63
            return None
        with open(os.path.join(folder, usage_file)) as f:
            usage = int(f.read())
    except (OSError, ValueError):
        return None
    try:
        with open(os.path.join(folder, "memory.stat")) as f:
            cache = next((int(ln.split()[1]) for ln in f if ln.split()[:1] == [inactive]), 0)
    except (OSError, ValueError, IndexError):
        cache = 0
    return max(0, int(limit) - max(0, usage - cache))


def start_pool(workers: int, enc: Encoder):
    """A pool of `workers` spawned processes, each started by `init_worker`; workers=0: None,
    after starting this process as the one worker (`submit` then runs each call at once)."""
    if workers == 0:
        init_worker(enc)
        return None
    # spawn: the parent may have imported JAX (threads), which fork would copy half-locked; a
    # spawned worker imports the data package and the main script (the `dropless` command's
    # imports only the command line, tests/cli/test_main_imports.py), never JAX;
    # a worker that dies (killed for memory) breaks the pool: an error here, never a hang
    return concurrent.futures.ProcessPoolExecutor(
        workers, mp_context=multiprocessing.get_context("spawn"), initializer=init_worker,
        initargs=(enc,))


def submit(pool, fn, args):
    """`fn(*args)` in the pool (a Future), or now, here, when `pool` is None."""
    return _Done(fn, args) if pool is None else pool.submit(fn, *args)
