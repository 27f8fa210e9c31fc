"""`prepare_workers.encode_texts`: a chunk's texts are encoded in slices of at most SLICE_BYTES
of UTF-8 (a larger text alone), and the result is, bit for bit, each text encoded alone by
`Tokenizer.encode` (or its UTF-8 bytes) between BOS and EOS, whatever the slices. SLICE_BYTES is
lowered here so that small texts fall on every side of a slice's edge.

Legend: N texts (documents), T tokens."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dropless.data import prepare_workers as pw
from tests._support.tokenizer_folders import reference_tokenizer, train_tokenizer

LIMIT = 16     # SLICE_BYTES in these tests
CASES = {      # name: texts, at slices of LIMIT bytes of UTF-8
    "none": [],
    "empty": [""],
    "empties": ["", "", ""],
    "at the limit": ["x" * LIMIT],
    "at the limit between": ["a", "x" * LIMIT, "", "b"],
    "one under, then two": ["y" * (LIMIT - 1), "zz"],
    "filling a slice exactly": ["abcdefgh", "ijklmnop", "q"],
    "larger than a slice": ["long " * 10],
    "larger ones among small": ["a", "long text " * 5, "b", "", "more long text " * 3, "c"],
    "many tiny": [chr(ord("a") + i % 26) * (i % 3) for i in range(200)],
    "words": ["The quick brown fox", "jumps over", "the lazy dog.", "", "A stitch in time"] * 9,
    "non-ASCII": ["é" * 8, "日本語", "\N{GRINNING FACE}", "naïve café \N{GRINNING FACE} 日本",
                  "Ünïcödé " * 4, "\N{GRINNING FACE}" * 4],
    "whitespace": [" ", "\n\n", "  two  spaces  ", "\t"],
}
FRAMES = [(None, None), (None, 2), (1, None), (1, 2)]     # (bos, eos)


def _reference(tok, texts: list[str], enc: pw.Encoder) -> tuple[np.ndarray, np.ndarray]:
    """Each text alone: its UTF-8 bytes or `tok.encode`'s ids, then BOS / EOS around it."""
    docs = []
    for t in texts:
        ids = list(t.encode("utf-8")) if tok is None else tok.encode(
            t, add_special_tokens=False).ids
        if ids:
            ids = [enc.bos] * (enc.bos is not None) + ids + [enc.eos] * (enc.eos is not None)
        docs.append(ids)
    return (np.array([len(d) for d in docs], np.int64),
            np.array([i for d in docs for i in d], enc.dtype))


def _assert_same(got, want) -> None:
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, w.dtype, g.shape, w.shape)
        assert g.tobytes() == w.tobytes()


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """name -> (tokenizer.json path or "byte", a fresh `Tokenizer` for the reference or None)."""
    from tokenizers import Tokenizer
    d = tmp_path_factory.mktemp("tok")
    reference_tokenizer().save(str(d / "sp.json"))
    train_tokenizer(byte_level=True).save(str(d / "bl.json"))
    return {name: (path, None if path == "byte" else Tokenizer.from_file(path))
            for name, path in (("byte", "byte"), ("sentencepiece-style BPE", str(d / "sp.json")),
                               ("byte-level BPE", str(d / "bl.json")))}


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
@pytest.mark.parametrize("bos, eos", FRAMES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("tokenizer", ["byte", "sentencepiece-style BPE", "byte-level BPE"])
def test_slices_give_each_text_alone(tokenizers, monkeypatch, tokenizer, case, bos, eos, dtype):
    path, ref_tok = tokenizers[tokenizer]
    monkeypatch.setattr(pw, "SLICE_BYTES", LIMIT)
    enc = pw.Encoder(tokenizer=path, dtype=dtype, bos=bos, eos=eos)
    texts = CASES[case]
    _assert_same(pw.encode_texts(pw.raw_tokenizer(path), texts, enc),
                 _reference(ref_tok, texts, enc))


@pytest.mark.parametrize("tokenizer", ["byte", "byte-level BPE"])
def test_across_the_real_slice_size(tokenizers, tokenizer):
    """Texts just under, at and over SLICE_BYTES itself, between small ones."""
    path, ref_tok = tokenizers[tokenizer]
    n = pw.SLICE_BYTES
    texts = ["def f(x): return x\n" * ((n - 1) // 19) + "a" * ((n - 1) % 19), "é",
             "x" * n, "", "The fox. " * (n // 9 + 1), "日本"]
    assert [pw.utf8_size(t) for t in texts[:3]] == [n - 1, 2, n]
    enc = pw.Encoder(tokenizer=path, dtype="uint16", bos=1, eos=2)
    _assert_same(pw.encode_texts(pw.raw_tokenizer(path), texts, enc),
                 _reference(ref_tok, texts, enc))


class _Recording:
    """A tokenizer that records the texts of each `encode_batch_fast` call."""

    def __init__(self, tok):
        self.tok, self.calls = tok, []

    def encode_batch_fast(self, texts, **kw):
        self.calls.append(list(texts))
        return self.tok.encode_batch_fast(texts, **kw)


def test_each_batch_is_one_slice(tokenizers, monkeypatch):
    """At most SLICE_BYTES of UTF-8 go to the encoder at once, unless one text is larger; the
    texts go in order, each once."""
    monkeypatch.setattr(pw, "SLICE_BYTES", LIMIT)
    rec = _Recording(pw.raw_tokenizer(tokenizers["byte-level BPE"][0]))
    texts = [t for case in CASES.values() for t in case]
    pw.encode_texts(rec, texts, pw.Encoder(tokenizer="t", dtype="uint16", bos=None, eos=None))
    assert [t for call in rec.calls for t in call] == texts
    for call in rec.calls:
        size = sum(len(t.encode()) for t in call)
        assert size <= LIMIT or len(call) == 1, call


def test_a_tokenizer_json_that_pads_or_truncates_still_gives_whole_documents(tokenizers,
                                                                              tmp_path):
    """Padding would put pad ids into documents (as many as the longest text of the slice asks)
    and truncation would cut them: both are turned off when a worker loads the tokenizer."""
    from tokenizers import Tokenizer
    path, ref_tok = tokenizers["sentencepiece-style BPE"]
    tok = Tokenizer.from_file(path)
    tok.enable_padding(pad_id=0, pad_token="<unk>")
    tok.enable_truncation(max_length=4)
    tok.save(str(tmp_path / "pads.json"))
    texts = CASES["words"]
    enc = pw.Encoder(tokenizer=str(tmp_path / "pads.json"), dtype="uint16", bos=None, eos=2)
    _assert_same(pw.encode_texts(pw.raw_tokenizer(enc.tokenizer), texts, enc),
                 _reference(ref_tok, texts, enc))


@pytest.mark.parametrize("sizes, limit, slices", [
    ([], 8, []),
    ([0], 8, [(0, 1)]),
    ([3, 0, 5, 9, 1], 8, [(0, 3), (3, 4), (4, 5)]),   # 3 + 0 + 5 = 8; 9 alone; 1
    ([8, 8], 8, [(0, 1), (1, 2)]),                    # each exactly the limit
    ([9, 0, 0], 8, [(0, 1), (1, 3)]),                 # the empty ones start the next slice
    ([0, 0, 9], 8, [(0, 2), (2, 3)]),
    ([1] * 5, 2, [(0, 2), (2, 4), (4, 5)]),
])
def test_text_slices_by_hand(sizes, limit, slices):
    assert pw.text_slices(sizes, limit) == slices


@given(st.lists(st.integers(0, 40), max_size=60), st.integers(1, 32))
def test_text_slices_cover_every_text_in_order_within_the_limit(sizes, limit):
    slices = pw.text_slices(sizes, limit)
    assert [i for lo, hi in slices for i in range(lo, hi)] == list(range(len(sizes)))
    for (lo, hi), after in zip(slices, slices[1:] + [None]):
        assert hi > lo and (sum(sizes[lo:hi]) <= limit or hi - lo == 1)
        if after:   # a slice ends only where the next text would not fit
            assert sum(sizes[lo:hi + 1]) > limit
