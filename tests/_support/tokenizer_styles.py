"""Small real tokenizer.json files of the styles the hub ships, trained offline with the
`tokenizers` library on STYLE_CORPUS (whitespace runs, CRLF, CJK, emoji, code), for the tests of
cutting a long text (`data.text_pieces`): what differs between them is what a cut could change.

STYLES (name -> a `tokenizers.Tokenizer`, `build(name)`):
* gpt2: byte-level BPE behind the GPT-2 split regex (`\\s+(?!\\S)`: a whitespace run leaves its
  last space to the next word), ByteLevel post-processor trimming offsets
* llama3: byte-level BPE behind the Llama-3 split regex (`\\s*[\\r\\n]+`, numbers of 1-3 digits)
* bytelevel_prefix: ByteLevel(add_prefix_space=True): a space is added before the string's start
* metaspace_first: SentencePiece-style BPE, Metaspace(prepend_scheme="first"): "▁" at the
  string's start only
* prepend: Llama-2 / Mistral style: normalizer Prepend("▁") + Replace(" ", "▁"), no
  pre-tokenizer (the whole text is one word for the BPE), byte fallback (<0x0A> for a newline)
* bert: WordPiece behind BertNormalizer (lowercase, accents stripped, CJK characters spaced)
  and BertPreTokenizer
"""
from __future__ import annotations

import json

GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}"
                r"\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
STYLE_CORPUS = [
    "The quick brown fox jumps over the lazy dog.\n", "def f(x):\n    return x + 1\n\n",
    "    indented    with    runs    of    spaces\n", "line one\r\nline two\r\n\r\n",
    "日本語のテキストです。東京と大阪。\n", "emoji \N{GRINNING FACE}\N{PARTY POPPER} here\n",
    "Ünïcödé naïve café façade résumé\n", "numbers 12345 and 3.14159 and 2026\n",
    "\n\n\n\t\ttabs\n", "        \n", "a" * 40 + "\n",
] * 30
VOCAB = 400
SPECIALS = ["<unk>", "<s>", "</s>", "<|endoftext|>"]
STYLES = ("gpt2", "llama3", "bytelevel_prefix", "metaspace_first", "prepend", "bert")


def _bpe_byte_level(split: str | None, *, add_prefix_space: bool = False):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, \
        trainers
    tok = Tokenizer(models.BPE())
    level = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=split is None)
    tok.pre_tokenizer = level if split is None else pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated"), level])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=True)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(STYLE_CORPUS, trainer)
    return tok


def _metaspace_first():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = decoders.Metaspace(prepend_scheme="first")
    tok.train_from_iterator(STYLE_CORPUS, trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False))
    return tok


def _prepend():
    """Trained without the byte tokens, then given <0x00>..<0xFF> in its vocabulary and byte
    fallback, as Llama-2's tokenizer.json has them (a newline is not among its characters)."""
    from tokenizers import Tokenizer, models, normalizers, trainers
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.train_from_iterator([t.replace("\n", "") for t in STYLE_CORPUS], trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False))
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab) + len(SPECIALS))
    spec["model"]["byte_fallback"] = True
    spec["model"]["ignore_merges"] = False
    return Tokenizer.from_str(json.dumps(spec))


def _bert():
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True, strip_accents=True,
                                                handle_chinese_chars=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(STYLE_CORPUS, trainers.WordPieceTrainer(
        vocab_size=VOCAB, special_tokens=["[UNK]", "[CLS]", "[SEP]"], show_progress=False))
    return tok


def build(name: str):
    """The `tokenizers.Tokenizer` of style `name` (module doc), trained here (well under a
    second each)."""
    if name == "gpt2":
        return _bpe_byte_level(GPT2_SPLIT)
    if name == "llama3":
        return _bpe_byte_level(LLAMA3_SPLIT)
    if name == "bytelevel_prefix":
        return _bpe_byte_level(None, add_prefix_space=True)
    if name == "metaspace_first":
        return _metaspace_first()
    if name == "prepend":
        return _prepend()
    if name == "bert":
        return _bert()
    raise ValueError(f"unknown tokenizer style {name!r}; known: {', '.join(STYLES)}")
