"""The tokenizing side of `data prepare` (`data.prepare`): what a worker process does with a
chunk of records, and the pool of those processes.

Legend: N documents of a chunk, T tokens.

A worker parses a chunk's raw records (`readers.chunk_texts`) and encodes the texts with the
`tokenizers` batch encoder, one thread each (`encode_texts`). `start_pool(0, ...)` tokenizes in
the calling process instead; `worker_count` says how many processes a run starts: what it asked
for, up to MAX_WORKERS, and no more than its inputs have chunks for.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing
import os

import numpy as np

from dropless.data import readers

MAX_WORKERS = 1024    # tokenizing processes: more is a typo (each holds a tokenizer in memory)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Encoder:
    """What a worker needs to turn texts into documents' tokens."""
    tokenizer: str
    dtype: str
    bos: int | None     # prepended when set
    eos: int | None     # appended when set


_WORKER: dict = {}


def raw_tokenizer(name: str):
    """The `tokenizers.Tokenizer` of a tokenizer.json path, or None for "byte"."""
    if name == "byte":
        return None
    from tokenizers import Tokenizer
    return Tokenizer.from_file(name)


def init_worker(enc: Encoder) -> None:
    """Load the tokenizer of `enc` into this process (a worker's start, or workers=0)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"   # one thread per worker process
    _WORKER["enc"], _WORKER["tok"] = enc, raw_tokenizer(enc.tokenizer)


def encode_texts(tok, texts: list[str], enc: Encoder) -> tuple[np.ndarray, np.ndarray]:
    """(lengths_N int64, tokens_T of enc.dtype): each text's ids by the `tokenizers.Tokenizer`
    `tok` (None: UTF-8 bytes) without its special tokens, with BOS / EOS as `enc` says; a text of
    no token has length 0 (and no BOS / EOS either)."""
    if tok is None:
        ids = [np.frombuffer(t.encode("utf-8"), np.uint8) for t in texts]
    else:
        ids = [np.array(e.ids, enc.dtype)
               for e in tok.encode_batch_fast(texts, add_special_tokens=False)]
    raw_N = np.fromiter((a.size for a in ids), np.int64, len(ids))
    flat = np.concatenate(ids) if ids else np.zeros(0, enc.dtype)
    extra = (enc.bos is not None) + (enc.eos is not None)
    if not extra:
        return raw_N, flat.astype(enc.dtype)
    lengths_N = np.where(raw_N > 0, raw_N + extra, 0)
    out_T = np.empty(int(lengths_N.sum()), enc.dtype)
    ends = np.cumsum(lengths_N)
    starts = ends - lengths_N
    keep = raw_N > 0
    # place each document's ids after its BOS slot: a position map over the flat ids
    src_start = np.cumsum(raw_N) - raw_N
    shift = np.repeat((starts + (enc.bos is not None) - src_start)[keep], raw_N[keep])
    out_T[np.arange(flat.size) + shift] = flat
    if enc.bos is not None:
        out_T[starts[keep]] = enc.bos
    if enc.eos is not None:
        out_T[ends[keep] - 1] = enc.eos
    return lengths_N, out_T


def encode_chunk(file: readers.InputFile, chunk: readers.Chunk, text_field: str):
    """(lengths_N, tokens_T) of a chunk's texts (`encode_texts`), in a started worker."""
    texts = readers.chunk_texts(file, chunk, text_field)
    return encode_texts(_WORKER["tok"], texts, _WORKER["enc"])


class _Done:
    """An already computed result with a Future's `result` (workers=0)."""

    def __init__(self, fn, args):
        self.value = fn(*args)

    def result(self):
        return self.value


# A worker imports the data package alone: `dropless/__init__.py` imports JAX (seconds and
# ~150 MB a process), which tokenizing never needs. The initializer is `exec` (a builtin:
# unpickling it imports nothing) of WORKER_START, which registers `dropless` as a bare package
# (its path, no __init__ run) before anything of dropless is unpickled, then starts the worker.
WORKER_START = """
import importlib.util, sys, types
if "dropless" not in sys.modules:
    spec = importlib.util.find_spec("dropless")
    pkg = types.ModuleType("dropless")
    pkg.__path__, pkg.__spec__ = list(spec.submodule_search_locations), spec
    sys.modules["dropless"] = pkg
from dropless.data.prepare_workers import Encoder, init_worker
init_worker(Encoder(**enc))
"""


def worker_count(workers: int, files: list[readers.InputFile], records_per_chunk: int) -> int:
    """The worker processes a run starts: `workers`, but no more than the chunks `files` can
    make when their sizes bound that (`readers.max_chunks`; a worker without a chunk would
    only start up); 0 stays 0 (in this process). The output is the same for any count."""
    bounds = [readers.max_chunks(f, records_per_chunk) for f in files]
    if workers == 0 or None in bounds:
        return workers
    return max(1, min(workers, sum(bounds)))


def start_pool(workers: int, enc: Encoder):
    """A pool of `workers` spawned processes, each started by `init_worker`; workers=0: None,
    after starting this process as the one worker (`submit` then runs each call at once)."""
    if workers == 0:
        init_worker(enc)
        return None
    # spawn: the parent may have imported JAX (threads), which fork would copy half-locked;
    # a worker that dies (killed for memory) breaks the pool: an error here, never a hang
    return concurrent.futures.ProcessPoolExecutor(
        workers, mp_context=multiprocessing.get_context("spawn"), initializer=exec,
        initargs=(WORKER_START, {"enc": dataclasses.asdict(enc)}))


def submit(pool, fn, args):
    """`fn(*args)` in the pool (a Future), or now, here, when `pool` is None."""
    return _Done(fn, args) if pool is None else pool.submit(fn, *args)
