"""`data.text_pieces.stream_ids`: a text given in parts (as `readers.text_parts` reads a file)
gives the ids `text_ids` gives the whole string, which are `Tokenizer.encode`'s on it, for every
tokenizer style (`tests/_support/tokenizer_styles.py`) and parts of any size (CJK, emoji, CRLF
and runs of whitespace across their ends), while it holds only a few slices of the text; where
no cut passes, the rest is read whole only where `fits` allows, else refused as `text_ids`
refuses it.

Legend: T tokens."""
import random

import numpy as np
import pytest

from dropless.data import text_pieces as tp
from tests._support.tokenizer_styles import STYLE_CORPUS, STYLES, build

LIMIT, CONTEXT = 4096, 256
RNG = random.Random(1)


def _runs(n: int) -> str:
    fills = [lambda k: " " * k, lambda k: "\n" * k, lambda k: "\r\n" * (k // 2 + 1),
             lambda k: "\N{GRINNING FACE}" * (k // 40 + 1), lambda k: "日本" * (k // 8 + 1),
             lambda k: ""]
    return "".join(RNG.choice(STYLE_CORPUS) + RNG.choice(fills)(RNG.randrange(1, 1500))
                   for _ in range(n))


TEXTS = {
    "long runs": _runs(120),
    "CRLF": "".join(STYLE_CORPUS).replace("\n", "\r\n") * 2,
    "no newline at all": "".join(STYLE_CORPUS).replace("\n", " ") * 2,
    "CJK, no space": "".join(chr(0x4E00 + RNG.randrange(200)) for _ in range(30000)),
    "short": "a few words\r\n",
}


def _parts(text: str, seed: int):
    """`text` in parts of 1 to 3,000 characters."""
    rng, at = random.Random(seed), 0
    while at < len(text):
        n = rng.randrange(1, 3000)
        yield text[at: at + n]
        at += n


def _stream(tok, text, seed=0, **kw):
    ids = tp.stream_ids(tok, _parts(text, seed), len(text.encode()), "int64",
                        limit_bytes=LIMIT, context=CONTEXT, **kw)
    return np.concatenate(list(ids)).tolist()


@pytest.fixture(scope="module")
def toks():
    return {name: build(name) for name in STYLES}


@pytest.mark.parametrize("case", list(TEXTS))
@pytest.mark.parametrize("style", STYLES)
def test_parts_give_the_ids_of_the_whole_string(toks, monkeypatch, style, case):
    tok, text = toks[style], TEXTS[case]
    held = []
    real = tp._Rest.fill
    monkeypatch.setattr(tp._Rest, "fill",
                        lambda self, n: real(self, n) or held.append(len(self.text)))
    want = tok.encode(text, add_special_tokens=False).ids
    assert _stream(tok, text) == want
    if len(text) > 8 * LIMIT:     # never all of it: the piece before, GROW slices ahead
        assert max(held) <= 2 * tp.GROW * LIMIT + 3 * CONTEXT + 3000 < len(text), max(held)
    assert tp.text_ids(tok, text, "int64", limit_bytes=LIMIT, context=CONTEXT).tolist() == want


def test_without_a_cut_the_rest_is_read_whole_only_where_it_fits(toks, monkeypatch):
    """A run of spaces longer than GROW slices has no cut a byte-level BPE passes: the rest of
    the text is read and encoded whole when `fits` says so, else the one line of `text_ids`."""
    tok = toks["gpt2"]
    text = "".join(STYLE_CORPUS)[:3 * LIMIT] + " " * (6 * LIMIT) + "".join(STYLE_CORPUS) * 2
    asked, fills = [], []
    real = tp._Rest.fill
    monkeypatch.setattr(tp._Rest, "fill", lambda self, n: fills.append(n) or real(self, n))
    got = _stream(tok, text, fits=lambda n: asked.append(n) or True)
    assert got == tok.encode(text, add_special_tokens=False).ids and asked
    assert None in fills and fills.index(None) < len(fills) - 1     # read whole, mid-text
    with pytest.raises(tp.UncuttableText) as whole:
        tp.text_ids(tok, text, "int64", limit_bytes=LIMIT, context=CONTEXT,
                    fits=lambda n: False)
    with pytest.raises(tp.UncuttableText) as parts:
        _stream(tok, text, fits=lambda n: False)
    assert str(parts.value) == str(whole.value) and "\n" not in str(parts.value)
