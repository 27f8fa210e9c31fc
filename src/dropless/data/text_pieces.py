"""A long text encoded in pieces, with exactly the ids of encoding it whole.

Legend: T tokens; a position is a character index of the text (`tokenizers` reports offsets in
characters of a Python str), so a cut never falls inside a UTF-8 character.

Why: `tokenizers` keeps offsets and alignments per byte of a string while it encodes it, ~300-400
bytes a byte of text (docs/data.md), so a text file (one string, one document) of 1 GB would
need hundreds of GB encoded whole. `text_ids` encodes it in pieces of about `limit_bytes` of
UTF-8 instead, and splices their ids where it has checked that the splice changes none.

A piece [s, e) is encoded with CONTEXT characters of the text before it, [s - CONTEXT, e), and
the ids of that context dropped: whatever the tokenizer does at a string's start (a Prepend("▁")
normalizer, Metaspace's prepend_scheme, ByteLevel's add_prefix_space, a `\\s+(?!\\S)` split
regex seeing a run start) happens CONTEXT characters before s, not at s. A cut c is accepted
when the window W = [c - CONTEXT, c + CONTEXT), encoded whole with offsets:
1. has a token boundary at c: its first k tokens end at or before c and the others start at or
   after it;
2. begins as [c - CONTEXT, c) alone does (its ids == W's first k: nothing at c changes when the
   string ends there);
3. ends, before c, as the piece [s - CONTEXT, c) does: the piece's last ids == W's ids that start
   in [c - CONTEXT / 2, c) (the piece sees its own left context, W another);
4. begins as the next piece [c - CONTEXT, e') does: the next piece's first ids == W's ids up to
   those that start before c + CONTEXT / 2 (W sees CONTEXT of right context, the next piece all
   of it up to e'); its first k ids are then dropped.
So around each cut the output is W's own tokens, and each piece's tokens agree with a second
encoding of other extent on CONTEXT / 2 characters on either side of the cut. That the tokens
around a point depend on less than that of the text each side of it is the assumption (every
split regex, normalizer and model of the hub's tokenizer.json files: a BPE merge, a WordPiece
or a Unigram token spans a few characters, a pre-token is cut at whitespace or punctuation);
a text where it fails a check is cut elsewhere.

Candidates for a cut near each piece's end (`_candidates`): after a newline followed by a
non-space character (nearest first), then after any newline, then before a space that follows
a non-space character, then evenly spaced points, TRIES of each; a check that fails at the
piece (3) or at the next piece (4) rejects that cut and the piece is encoded again up to
another one. Where no cut in a band of a piece passes, the piece grows by a slice, at most
GROW slices and only while `fits(bytes of the piece)` says the memory holds it; then the rest
of the text is encoded whole where `fits` holds it, or `UncuttableText` is raised: never
different ids.

`stream_ids` makes the same cuts on a text given in parts (a text file as it is read,
`data.prepare`), holding only the text from CONTEXT characters before the last piece not yet
given out to GROW slices and CONTEXT characters past the piece being cut (`_Rest`), so a text of
any size costs a few slices; `text_ids` is the same loop on a string held whole.
"""
from __future__ import annotations

import bisect
import dataclasses
from typing import Callable, Iterable, Iterator

import numpy as np

CONTEXT = 4096    # characters of text each side of a cut that its checks see (module doc)
TRIES = 8         # candidates of each kind per band of a piece
GROW = 4          # a piece grows to at most this many slices while no cut is found
REJECTS = 64      # cuts a text may reject after encoding a piece up to them, then it is refused


class UncuttableText(ValueError):
    """No cut of a text passes its checks and the rest of it is too large to encode whole;
    `index`: which text of a chunk (set by the caller that knows)."""
    index = 0


@dataclasses.dataclass(frozen=True)
class _Window:
    """W of a cut c (module doc): its ids, k of them before c, j of those start at or after
    c - CONTEXT / 2, and `span` of them start before c + CONTEXT / 2."""
    cut: int
    ids: list[int]
    k: int
    j: int
    span: int


def fast_ids(tok, text: str) -> list[int]:
    """`text`'s ids by the `tokenizers.Tokenizer` `tok`, without special tokens or offsets."""
    return tok.encode_batch_fast([text], add_special_tokens=False)[0].ids


def _window(tok, text: str, c: int, context: int) -> _Window | None:
    """W of the cut c when checks 1 and 2 (module doc) hold for it, else None."""
    lo = c - context
    enc = tok.encode(text[lo: c + context], add_special_tokens=False)
    ids, offsets = enc.ids, enc.offsets
    starts = [a for a, _ in offsets]
    if any(a > b for a, b in zip(starts, starts[1:])):
        return None                     # offsets out of order: no cut is read from them
    rel = c - lo
    k = bisect.bisect_left(starts, rel)
    j = k - bisect.bisect_left(starts, rel - context // 2)
    span = bisect.bisect_left(starts, rel + context // 2)
    if j < 1 or span - k < 1 or any(end > rel for _, end in offsets[:k]):
        return None                     # no token boundary at c (1)
    if fast_ids(tok, text[lo:c]) != ids[:k]:
        return None                     # the text ending at c changes its tokens (2)
    return _Window(cut=c, ids=ids, k=k, j=j, span=span)


def _candidates(text: str, lo: int, hi: int) -> Iterator[int]:
    """Positions in (lo, hi] to try as a cut, in order (module doc), each once."""
    seen: set[int] = set()

    def after_newline(plain: bool) -> Iterator[int]:
        at, found = hi, 0
        while found < TRIES:
            i = text.rfind("\n", lo, at)
            if i < 0:
                return
            at = i
            if not plain or not text[i + 1].isspace():
                found += 1
                yield i + 1

    def before_space() -> Iterator[int]:
        at, found = hi + 1, 0
        while found < TRIES:
            i = text.rfind(" ", lo + 1, at)
            if i < 0:
                return
            at = i
            if not text[i - 1].isspace():
                found += 1
                yield i

    spaced = (hi - (hi - lo) * t // TRIES for t in range(TRIES))
    for gen in (after_newline(True), after_newline(False), before_space(), spaced):
        for c in gen:
            if lo < c <= hi and c not in seen:
                seen.add(c)
                yield c


def _utf8_size(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8"))


def _slice_chars(text: str, s: int, limit_bytes: int) -> int:
    """Characters from s that hold about `limit_bytes` of UTF-8."""
    size = _utf8_size(text[s: s + limit_bytes])
    return limit_bytes if size <= limit_bytes else max(1, limit_bytes * limit_bytes // size)


def _next_cut(tok, text: str, s: int, limit_bytes: int, context: int, rejected: set[int],
              fits: Callable[[int], bool], rest: _Rest | None = None
              ) -> tuple[int, _Window | None]:
    """(end of the piece from s, W of its cut; None at the text's end) (module doc). `rest`:
    where `text` is the start of a longer text (`stream_ids`), its sizes; then (-1, None) says
    that the rest of the text is to be encoded whole, and must be read first."""
    n = len(text)
    size = _slice_chars(text, s, limit_bytes)
    if n - s <= size:
        return n, None
    for grow in range(GROW):
        hi = min(s + (grow + 1) * size, n - context)
        if grow and not fits(_utf8_size(text[s:hi])):
            break
        for c in _candidates(text, max(s + context, hi - (size if grow else size // 2)), hi):
            if c not in rejected:
                w = _window(tok, text, c, context)
                if w is not None:
                    return c, w
        if hi == n - context:
            break
    total = _utf8_size(text) if rest is None else rest.total_bytes
    at = 0 if rest is None else rest.dropped_chars
    left = (_utf8_size(text[s:]) if rest is None else rest.after(s)) + context
    if not fits(left):
        raise UncuttableText(
            f"no place to cut this text of {total / 2 ** 20:.0f} MiB where its tokens stay "
            f"the same was found after character {s + at}, and encoding the remaining "
            f"{left / 2 ** 20:.0f} MiB whole takes more memory than is available; split it "
            "into smaller files, or prepare it where more memory is free")
    return (n, None) if rest is None or rest.at_end else (-1, None)


class _Rest:
    """The part of a text read so far and not dropped yet (`text`, from character
    `dropped_chars` of the whole on), from an iterator of its parts; `total_bytes`: the UTF-8
    size of the whole text; `at_end`: every part is read. `dropping` False: `drop` keeps all
    (a text held whole anyway is not copied again)."""

    def __init__(self, parts: Iterable[str], total_bytes: int, *, dropping: bool = True):
        self.parts, self.total_bytes, self.dropping = iter(parts), total_bytes, dropping
        self.text, self.at_end, self.dropped_bytes, self.dropped_chars = "", False, 0, 0

    def fill(self, chars: int | None) -> None:
        """Read parts until `text` holds `chars` characters (None: all of them) or the end."""
        got = [self.text]
        have = len(self.text)
        while not self.at_end and (chars is None or have < chars):
            part = next(self.parts, None)
            if part is None:
                self.at_end = True
            else:
                got.append(part)
                have += len(part)
        self.text = "".join(got)

    def after(self, s: int) -> int:
        """UTF-8 bytes of the whole text from `text[s]` on."""
        return self.total_bytes - self.dropped_bytes - _utf8_size(self.text[:s])

    def drop(self, chars: int) -> int:
        """Drop the first `chars` characters of `text`; how many were dropped (0 or chars)."""
        if not self.dropping or chars <= 0:
            return 0
        self.dropped_bytes += _utf8_size(self.text[:chars])
        self.dropped_chars += chars
        self.text = self.text[chars:]
        return chars


def _piece_ids(tok, rest: _Rest, dtype: str, limit_bytes: int, fits: Callable[[int], bool],
               context: int) -> Iterator[np.ndarray]:
    """The ids of the text `rest` reads, piece by piece (module doc), as arrays of `dtype`. It
    holds the text from CONTEXT characters before the last piece not yet given out (a check
    that fails at the next piece re-cuts that one) to GROW slices and CONTEXT characters past
    the piece being cut: what a cut's search reads. Raises UncuttableText."""
    ahead = GROW * limit_bytes + context + 1
    s, head, pending, rejected = 0, None, None, set()
    while True:
        rest.fill(s + ahead)
        text = rest.text
        if s >= len(text):
            break
        end, w = _next_cut(tok, text, s, limit_bytes, context, rejected, fits, rest)
        if end < 0:                     # the rest is encoded whole: read it all
            rest.fill(None)
            continue
        ids = fast_ids(tok, text[s - context if head else 0: end])
        if head is not None:
            if ids[:head.span] != head.ids[:head.span]:       # (4) fails: cut s is rejected
                _reject(rejected, s, pending, at=rest.dropped_chars)
                (s, head, _), pending = pending, None         # re-cut from the piece before
                continue
            del ids[:head.k]
        if w is not None and ids[len(ids) - w.j:] != w.ids[w.k - w.j: w.k]:
            _reject(rejected, end, True, at=rest.dropped_chars)  # (3) fails: cut elsewhere
            continue
        if pending is not None:
            yield np.array(pending[2], dtype)
        pending, s, head = (s, head, ids), end, w
        if pending[1] is not None:      # text before the pending piece's context is done
            d = rest.drop(pending[0] - context)
            pending, s = (pending[0] - d, *pending[1:]), s - d
            rejected = {r - d for r in rejected}
    if pending is not None:
        yield np.array(pending[2], dtype)


def text_ids(tok, text: str, dtype: str, *, limit_bytes: int,
             fits: Callable[[int], bool] = lambda nbytes: True,
             context: int = CONTEXT) -> np.ndarray:
    """`tok.encode(text, add_special_tokens=False).ids` as `dtype` (`tok` a
    `tokenizers.Tokenizer`), computed in pieces of about `limit_bytes` of UTF-8 (module doc);
    `fits(bytes)`: whether a piece of that many bytes of text may be encoded (the memory
    holds it), asked only where no cut is found within a slice. Raises UncuttableText."""
    if len(text) <= 4 * context or _utf8_size(text) <= limit_bytes:
        return np.array(fast_ids(tok, text), dtype)
    out = list(_piece_ids(tok, _Rest([text], _utf8_size(text), dropping=False), dtype,
                          limit_bytes, fits, context))
    return np.concatenate(out) if out else np.zeros(0, dtype)


def stream_ids(tok, parts: Iterable[str], total_bytes: int, dtype: str, *, limit_bytes: int,
               fits: Callable[[int], bool] = lambda nbytes: True,
               context: int = CONTEXT) -> Iterator[np.ndarray]:
    """The ids `text_ids` gives the text that is `parts` joined (`total_bytes` of UTF-8), as
    arrays of `dtype` one after another, reading the parts as it goes: it holds a few slices
    of the text (`_piece_ids`), not all of it, unless no cut passes and the rest is encoded
    whole (only where `fits` holds it). The cuts, and so the ids, are those of `text_ids` on
    the whole string. Raises UncuttableText."""
    rest = _Rest(parts, total_bytes)
    rest.fill(GROW * limit_bytes + context + 1)
    if rest.at_end:                     # short: as text_ids takes it, whole or in pieces
        yield text_ids(tok, rest.text, dtype, limit_bytes=limit_bytes, fits=fits,
                       context=context)
        return
    yield from _piece_ids(tok, rest, dtype, limit_bytes, fits, context)


def _reject(rejected: set[int], cut: int, can: object, *, at: int = 0) -> None:
    """Add `cut` to the rejected ones; UncuttableText where that cannot go on (`can` falsy: the
    piece before it is already written, or REJECTS are reached); `at`: the characters of the
    text before position 0 (dropped), for the message."""
    if not can or len(rejected) >= REJECTS:
        raise UncuttableText(
            f"the tokens around character {cut + at} of this text depend on more than "
            f"{CONTEXT // 2} characters each side of it, and {len(rejected)} other cuts were "
            "rejected; split it into smaller files, or report the tokenizer to dropless")
    rejected.add(cut)
