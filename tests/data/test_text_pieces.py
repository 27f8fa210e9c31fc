"""`data.text_pieces.text_ids`: a text longer than a slice, encoded in pieces, has exactly the ids
of `Tokenizer.encode(text, add_special_tokens=False)` on the whole string, for tokenizer.json
files of every style the hub ships (`tests/_support/tokenizer_styles.py`: start-of-string
prefixes, whitespace-run regexes, byte fallback, a BERT normalizer). The slice and the context
are lowered here (4 KiB and 256 characters) so that small texts are cut many times; the texts
put long runs of spaces and newlines, CRLF, CJK and emoji across the cut points.

Legend: T tokens."""
import random

import numpy as np
import pytest

from dropless.data import text_pieces as tp
from tests._support.tokenizer_styles import STYLE_CORPUS, STYLES, build

LIMIT, CONTEXT = 4096, 256
RNG = random.Random(0)
BASE = "".join(STYLE_CORPUS)


def _runs() -> str:
    """Corpus lines between runs of 1-2,000 spaces, newlines, CRLFs, tabs, emoji and CJK: runs
    longer than CONTEXT fall across cut points."""
    fills = [lambda n: " " * n, lambda n: "\n" * n, lambda n: "\r\n" * (n // 2 + 1),
             lambda n: "\N{GRINNING FACE}" * (n // 40 + 1), lambda n: "日本" * (n // 8 + 1),
             lambda n: "\t \n " * (n // 4 + 1)]
    return "".join(RNG.choice(STYLE_CORPUS) + RNG.choice(fills)(RNG.randrange(1, 2000))
                   for _ in range(60))


TEXTS = {
    "empty": "",
    "smaller than a slice": BASE[:LIMIT - 100],
    "lines": BASE * 2,
    "CRLF": BASE.replace("\n", "\r\n"),
    "no newline at all": BASE.replace("\n", " ") * 2,
    "CJK, no space": "".join(chr(0x4E00 + RNG.randrange(200)) for _ in range(12000)),
    "emoji at every point": ("ab \N{GRINNING FACE}\N{PARTY POPPER}\n" * 4000),
    "long runs": _runs(),
    "one run of spaces": "x" + " " * 30000 + "y",
    "one run of newlines": "\n" * 30000,
    "one letter repeated": "a" * 30000,
}


@pytest.fixture(scope="module")
def toks():
    return {name: build(name) for name in STYLES}


def _whole(tok, text: str) -> np.ndarray:
    return np.array(tok.encode(text, add_special_tokens=False).ids, np.int64)


@pytest.mark.parametrize("case", list(TEXTS))
@pytest.mark.parametrize("style", STYLES)
def test_pieces_give_the_ids_of_the_whole_string(toks, monkeypatch, style, case):
    tok, text = toks[style], TEXTS[case]
    pieces = []
    real = tp.fast_ids
    monkeypatch.setattr(tp, "fast_ids", lambda t, s: pieces.append(len(s)) or real(t, s))
    got = tp.text_ids(tok, text, "int64", limit_bytes=LIMIT, context=CONTEXT)
    want = _whole(tok, text)
    assert got.dtype == np.int64 and got.tolist() == want.tolist()
    if case in ("lines", "CRLF", "no newline at all", "emoji at every point", "long runs"):
        assert sum(n > 2 * CONTEXT for n in pieces) >= 3, pieces      # it was really cut
        assert max(pieces) <= tp.GROW * LIMIT + CONTEXT, pieces        # grown at most GROW


def test_a_naive_cut_would_change_the_ids(toks):
    """The texts are hard: encoding each slice alone gives other ids for every style but BERT's
    (a prepended "▁" or space, a run split in two), so the checks are what makes them equal."""
    text = TEXTS["long runs"]
    for style in STYLES:
        tok = toks[style]
        naive = [i for lo in range(0, len(text), LIMIT)
                 for i in tok.encode(text[lo: lo + LIMIT], add_special_tokens=False).ids]
        assert (naive != _whole(tok, text).tolist()) == (style != "bert"), style


def test_a_check_that_fails_after_the_piece_is_encoded_cuts_elsewhere(toks, monkeypatch):
    """Checks 3 and 4 (module doc) reject cuts on these texts, and the ids stay exact."""
    rejected = []
    real = tp._reject
    monkeypatch.setattr(tp, "_reject",
                        lambda r, c, can, **kw: rejected.append(c) or real(r, c, can, **kw))
    for style in ("gpt2", "llama3", "prepend"):
        tok = toks[style]
        text = TEXTS["long runs"]
        got = tp.text_ids(tok, text, "int64", limit_bytes=LIMIT, context=CONTEXT)
        assert got.tolist() == _whole(tok, text).tolist()
    assert rejected


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_the_ids_come_as_the_dtype_asked(toks, dtype):
    got = tp.text_ids(toks["gpt2"], TEXTS["lines"], dtype, limit_bytes=LIMIT, context=CONTEXT)
    assert got.dtype == np.dtype(dtype)
    assert got.tolist() == _whole(toks["gpt2"], TEXTS["lines"]).tolist()


def test_without_a_cut_the_rest_is_encoded_whole_where_memory_holds_it(toks):
    """A run of 30,000 spaces has no cut a byte-level BPE passes (its tokens' alignment and
    the regex's last space depend on the whole run): encoded whole when `fits` says so, else
    refused in one line, never cut blindly."""
    tok, text = toks["gpt2"], TEXTS["one run of spaces"]
    asked = []
    got = tp.text_ids(tok, text, "int64", limit_bytes=LIMIT, context=CONTEXT,
                      fits=lambda n: asked.append(n) or True)
    assert got.tolist() == _whole(tok, text).tolist() and asked
    with pytest.raises(tp.UncuttableText, match=r"^no place to cut this text of 0 MiB where its "
                                                r"tokens stay the same .*; split it into "
                                                r"smaller files") as e:
        tp.text_ids(tok, text, "int64", limit_bytes=LIMIT, context=CONTEXT,
                    fits=lambda n: False)
    assert "\n" not in str(e.value)


def test_a_piece_grows_only_while_memory_holds_it(toks):
    """No cut in the first slice: the next slice is searched only if the piece would fit."""
    tok = toks["gpt2"]
    text = " " * (3 * LIMIT) + BASE * 2
    sizes = []
    got = tp.text_ids(tok, text, "int64", limit_bytes=LIMIT, context=CONTEXT,
                      fits=lambda n: sizes.append(n) or n <= 6 * LIMIT)
    assert got.tolist() == _whole(tok, text).tolist()
    assert sizes and min(sizes) <= 2 * LIMIT


def test_the_byte_level_cut_never_splits_a_character(toks):
    """Positions are characters: a cut lands between code points, and a 4-byte emoji's byte
    tokens stay together (the emoji text is cut, `test_pieces_give_...`), here by hand."""
    text = TEXTS["emoji at every point"]
    cut, w = tp._next_cut(toks["gpt2"], text, 0, LIMIT, CONTEXT, set(), lambda n: True)
    assert w is not None and 0 < cut < len(text) and text[cut - 1] == "\n"
