"""Batches for the step: each row addressed by (seed, step) under a packing, built only by the
process that holds it, and produced ahead of the step by a background thread.

Legend: B rows (global batch), S sequence length, R rows of this process, Q pieces (pad).

Addressing (`config.PACKINGS`); sample g = index * B + j of the run (g = first + (index - start)
* B + j for a Loader started at batch `start` on sample `first`: a resume with another global
batch continues at the first sample not trained on) is item perm_e[g mod n] of an epoch of n
items, e = g // n, perm_e seeded by (seed, e) as data.corpus.batch_at does:
- "stream": items are windows of S + 1 tokens at multiples of S over the token stream
  (`corpus.batch_at`'s windows, `batch.from_windows`): bitwise the batches runs made before
  packing.
- "documents": the same windows (the same tokens and targets as "stream"), with segment ids and
  positions reset at each document start inside the window and the target that crosses into
  the next document masked: Megatron-LM's `reset_position_ids` / `reset_attention_mask` /
  `eod_mask_loss` (megatron/core/datasets/gpt_dataset.py `_get_ltor_masks_and_position_ids`),
  with the boundary taken from the documents' end offsets instead of an EOD token. The first
  (partial) document of a window starts at position 0, as there.
- "pad": items are pieces of documents, one per row: a document of L tokens gives
  ceil((L - 1) / S) pieces of up to S + 1 tokens (adjacent pieces overlap by one, so every
  target inside the document is trained once); a row holds one piece's inputs and targets,
  then PAD_ID with segment id 0 and loss mask 0. Positions restart at 0 in each row.

A batch is a pure function of (data, seed, packing, S, B, its first sample number): the process
count only decides who builds which rows, so a resume on another number of processes with the
same global batch continues with exactly the batches the first run would have had.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable

import jax
import numpy as np

from dropless.data.batch import Batch, from_windows
from dropless.data.corpus import num_sequences, permutation

PAD_ID = 0


class ArrayStream:
    """An in-memory (or memory-mapped) token array as a stream of documents: `ends_D` holds the
    cumulative END offset of each document (the last = the array's size)."""

    def __init__(self, tokens_N, ends_D):
        self.tokens_N = tokens_N
        self.ends_D = np.asarray(ends_D, np.int64)
        self.size = int(tokens_N.size)

    def read(self, lo: int, hi: int) -> np.ndarray:
        return np.asarray(self.tokens_N[max(0, lo): min(self.size, hi)])

    def starts_in(self, a: int, b: int) -> np.ndarray:
        i0, i1 = np.searchsorted(self.ends_D, [a, b], side="right")
        p = self.ends_D[i0:i1]
        return p[p < self.size]

    def document_lengths(self):
        yield np.diff(self.ends_D, prepend=0)


def as_stream(tokens, ends_D=None):
    """A stream for `tokens`: a data.shards.ShardSet is one already; an array gets `ends_D`
    (default: one document)."""
    if hasattr(tokens, "starts_in"):
        return tokens
    return ArrayStream(tokens, [tokens.size] if ends_D is None else ends_D)


class Addressing:
    """Which tokens row g of the run holds and how, for one packing (module docstring).

    Raises ValueError when the stream holds no item (no window of S + 1 tokens; no document of
    two tokens under "pad").
    """

    def __init__(self, stream, *, seq_len: int, packing: str, seed: int, shuffle: bool = True):
        self.stream, self.s, self.packing = stream, seq_len, packing
        self.seed, self.shuffle = seed, shuffle
        if packing == "pad":
            self.doc_start_D, self.piece_end_D = _pieces(stream, seq_len)
            self.n = int(self.piece_end_D[-1]) if self.piece_end_D.size else 0
        else:
            self.n = num_sequences(stream, seq_len)
        if self.n == 0:
            raise ValueError(f"seq_len={seq_len} is longer than every {packing!r} item of the "
                             f"token stream ({stream.size} tokens)")

    def item(self, g: int) -> int:
        """The item (window or piece) sample g reads."""
        epoch, pos = divmod(g, self.n)
        return int(permutation(self.n, self.seed, epoch)[pos]) if self.shuffle else pos

    def rows(self, samples) -> Batch:
        """The rows of these sample numbers, as a Batch [len(samples), S]."""
        if self.packing == "pad":
            return _stack([self._pad_row(self.item(g)) for g in samples])
        wins = [self.stream.read(q * self.s, q * self.s + self.s + 1)
                for q in (self.item(g) for g in samples)]
        windows = np.stack(wins).astype(np.int32)
        if self.packing == "stream":
            return from_windows(windows)
        return _stack([_documents_row(w, q * self.s, self.stream)
                       for w, q in zip(windows, (self.item(g) for g in samples))])

    def _pad_row(self, q: int):
        d = int(np.searchsorted(self.piece_end_D, q, side="right"))
        first = int(self.piece_end_D[d - 1]) if d else 0
        lo = int(self.doc_start_D[d]) + (q - first) * self.s
        end = int(self.doc_start_D[d + 1])
        w = self.stream.read(lo, min(lo + self.s + 1, end)).astype(np.int32)
        k, s = w.size - 1, self.s
        tok, tgt = np.full(s, PAD_ID, np.int32), np.full(s, PAD_ID, np.int32)
        tok[:k], tgt[:k] = w[:-1], w[1:]
        seg = np.zeros(s, np.int32)
        seg[:k] = 1
        pos = np.zeros(s, np.int32)
        pos[:k] = np.arange(k, dtype=np.int32)
        return tok, tgt, seg, pos, seg.astype(np.float32)


def _pieces(stream, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(document start offsets [D + 1], cumulative piece count per document [D]) for "pad"."""
    lengths = np.concatenate(list(stream.document_lengths()) or [np.zeros(0, np.int64)])
    start = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    pieces = np.where(lengths >= 2, -(-(lengths - 1) // seq_len), 0)
    return start, np.cumsum(pieces).astype(np.int64)


def _documents_row(w, lo: int, stream):
    """(tokens, targets, segment ids, positions, loss mask) of the window w = stream[lo: lo+S+1]
    with the documents starting inside it (Megatron's reset_position_ids / reset_attention_mask,
    and the target of a document's last token, the next document's first, masked)."""
    s = w.size - 1
    starts = stream.starts_in(lo, lo + s) - lo         # in (0, S]
    t = np.arange(s)
    seen = np.searchsorted(starts, t, side="right")    # starts at or before each input
    seg = (1 + seen).astype(np.int32)
    begin = np.concatenate([[0], starts])[seen]         # the start of each input's document
    pos = (t - begin).astype(np.int32)
    mask = np.ones(s, np.float32)
    mask[starts - 1] = 0.0                              # target t+1 is a document start
    return w[:-1], w[1:], seg, pos, mask


def _stack(rows) -> Batch:
    cols = list(zip(*rows))
    return Batch(*(np.stack(c) for c in cols))


def process_rows(sharding, batch_size: int) -> tuple[tuple[int, int], ...]:
    """The [lo, hi) blocks of global rows this process's devices hold under `sharding`
    (None: all rows), ascending and distinct (devices holding the same rows share a block)."""
    if sharding is None:
        return ((0, batch_size),)
    idx = sharding.addressable_devices_indices_map((batch_size, 1))
    return tuple(sorted({(s[0].start or 0, batch_size if s[0].stop is None else s[0].stop)
                         for s in idx.values()}))


def place(tree, sharding, batch_size: int, blocks: tuple[tuple[int, int], ...]):
    """Host arrays of this process's `blocks` of rows (concatenated in order) -> the global
    batch on `sharding` (None: as is). Each device's shard is cut from the rows this process
    built (jax.make_array_from_callback), so no process needs another's rows."""
    if sharding is None:
        return tree
    at, n = {}, 0
    for lo, hi in blocks:
        at[lo], n = n, n + hi - lo

    def global_array(x):
        def shard(index):
            lo = index[0].start or 0
            hi = batch_size if index[0].stop is None else index[0].stop
            return x[at[lo]: at[lo] + hi - lo][(slice(None),) + tuple(index[1:])]
        return jax.make_array_from_callback((batch_size,) + x.shape[1:], sharding, shard)
    return jax.tree.map(global_array, tree)


class Loader:
    """Batches `start`, `start` + 1, ... of a run: this process's rows of each
    (`process_rows`; `rows`), turned into the step's input by `to_step` and placed on
    `sharding`. Batch `start` begins at sample `first_sample` (default `start` x `batch_size`,
    the run's own numbering).

    With `prefetch` > 0 a background thread builds up to `prefetch` batches ahead of `next()`
    (and holds one more while it waits to queue it); an error there (a changed data file,
    DataChanged) is raised by the `next()` that would have returned that batch. `wait_s[i]` is
    how long `next()` blocked for batch i. Raises ValueError for a `prefetch` below 0 (the
    upper bound is the config's, `TrainConfig.prefetch`).
    """

    def __init__(self, addressing: Addressing, *, batch_size: int, sharding=None,
                 prefetch: int = 0, start: int = 0, first_sample: int | None = None,
                 to_step: Callable[[Batch], Any] = lambda b: b):
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"Loader prefetch={prefetch!r} must be an int >= 0 (0: no thread)")
        self.addr, self.b, self.sharding, self.to_step = addressing, batch_size, sharding, to_step
        self.rows = process_rows(sharding, batch_size)
        self.start = start
        self.first_sample = start * batch_size if first_sample is None else first_sample
        self.next_index = start
        self.wait_s: dict[int, float] = {}
        self._q: queue.Queue | None = None
        self._stop = threading.Event()
        if prefetch > 0:
            self._q = queue.Queue(maxsize=prefetch)
            self._thread = threading.Thread(target=self._produce, args=(start,), daemon=True,
                                            name="dropless-loader")
            self._thread.start()

    def build(self, index: int):
        """Batch `index`, built now: the step's input, placed."""
        base = self.sample_of(index)
        local = self.addr.rows([base + r for lo, hi in self.rows for r in range(lo, hi)])
        return place(self.to_step(local), self.sharding, self.b, self.rows)

    def sample_of(self, index: int) -> int:
        """The sample number batch `index` begins at."""
        return self.first_sample + (index - self.start) * self.b

    def _produce(self, index: int) -> None:
        while not self._stop.is_set():
            try:
                item = (index, self.build(index), None)
            except BaseException as e:  # handed to the consumer, raised there
                item = (index, None, e)
            while not self._stop.is_set():
                try:
                    self._q.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[2] is not None:
                return
            index += 1

    def next(self):
        """The next batch in order (blocking until it is built)."""
        i = self.next_index
        t0 = time.perf_counter()
        if self._q is None:
            batch = self.build(i)
        else:
            got, batch, err = self._q.get()
            if err is not None:
                raise err
            assert got == i, (got, i)
        self.wait_s[i] = time.perf_counter() - t0
        self.next_index = i + 1
        return batch

    def close(self) -> None:
        """Stops the thread (batches built ahead are dropped)."""
        self._stop.set()
        if self._q is not None:
            self._thread.join(timeout=5)
