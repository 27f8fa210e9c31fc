"""Tokenizers: UTF-8 bytes, or a Hugging Face `tokenizer.json` with the special tokens its folder
declares. Read by training data (`data.corpus.load_corpus`), `init_from`, `eval`, `generate`, `convert`.

Which tokenizer a model folder implies is `dropless.model_dir`'s (`folder_tokenizer`,
`hf_tokenizer`): its `tokenizer.json`. A folder that holds only a SentencePiece `tokenizer.model`
is refused with the command that writes `tokenizer.json` (transformers' converter needs
sentencepiece and protobuf, which training does not), and a folder with no tokenizer at all is
refused too: an HF model is never fed byte tokens unless the user asks for `byte`.

Special tokens, as transformers reads them from the files beside `tokenizer.json`:
* BOS / EOS: `tokenizer_config.json`'s `bos_token` / `eos_token` (a string or an AddedToken
  dict; null: none), else (key absent) `generation_config.json`'s `bos_token_id` /
  `eos_token_id` (an int or a list: the first is the EOS, all of them stop generation), else a
  token named `</s>`, `<|endoftext|>`, `<eos>` or `<|end_of_text|>` in the vocabulary (a bare
  tokenizer.json).
* Adding them: the tokenizer.json's own post-processor decides (a `TemplateProcessing` that
  puts BOS first: Mixtral, DeepSeek-V3; none: Qwen), as transformers 5 does (it drops
  tokenizer_config.json's `add_bos_token` / `add_eos_token` when there is a tokenizer.json).
  transformers 4.x's Llama tokenizer rebuilds the post-processor from those flags instead, so a
  folder whose flags disagree with its tokenizer.json would be read differently by the two
  releases: it is refused, naming both.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

BYTE_VOCAB = 256
BYTE_EOS = 0   # NUL never occurs in source text; it separates documents
EOS_NAMES = ("</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>")
SIDE_FILES = ("tokenizer_config.json", "generation_config.json", "special_tokens_map.json")


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255; vocab 256, so an untrained model's loss is ln 256 = 5.55."""
    name = "byte"
    vocab_size = BYTE_VOCAB
    eos_id = BYTE_EOS
    bos_id = None
    stop_ids = (BYTE_EOS,)

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), np.uint8)

    def decode(self, ids) -> str:
        return bytes(np.asarray(ids, np.uint8)).decode("utf-8", errors="replace")

    def encode_offsets(self, text: str, *, add_special_tokens: bool = True
                       ) -> tuple[np.ndarray, np.ndarray]:
        """`encode(text)` and, per token, the [start, end) characters of `text` it came from
        (every byte of a character points at that character)."""
        del add_special_tokens   # bytes have no special tokens
        ids = self.encode(text)
        starts = np.repeat(np.arange(len(text)), [len(c.encode("utf-8")) for c in text])
        return ids, np.stack([starts, starts + 1], axis=1).reshape(-1, 2)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpecialTokens:
    """What the folder says about BOS / EOS; add_bos / add_eos: tokenizer_config.json's flags
    (None: not set), checked against the post-processor."""
    bos_id: int | None
    eos_id: int | None
    stop_ids: tuple[int, ...]
    add_bos: bool | None
    add_eos: bool | None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_id(tok, where: Path, key: str, value) -> int | None:
    """The id of a special token given as a string or an AddedToken dict ({"content": ...})."""
    if value is None:
        return None
    text = value.get("content") if isinstance(value, dict) else value
    if not isinstance(text, str):
        raise ValueError(f"{where}: {key}={value!r} is not a token string")
    tid = tok.token_to_id(text)
    if tid is None:
        raise ValueError(f"{where}: {key}={text!r} is not in the tokenizer's vocabulary")
    return tid


def _ids(where: Path, key: str, value) -> tuple[int, ...]:
    vals = value if isinstance(value, list) else [value]
    if not vals or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                           for v in vals):
        raise ValueError(f"{where}: {key}={value!r} must be a token id or a list of them")
    return tuple(vals)


def _flag(where: Path, key: str, value) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    raise ValueError(f"{where}: {key}={value!r} must be true or false")


def vocab_span(tok) -> int:
    """The largest id of the `tokenizers.Tokenizer` `tok` + 1 (its added tokens included): what
    an embedding table and a token dtype must hold. `get_vocab_size` counts the entries, which is
    less where the ids have gaps (a vocab missing some ids, added tokens placed above it)."""
    vocab = tok.get_vocab(with_added_tokens=True)
    return max(tok.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1)


def special_tokens(tok, folder: Path) -> SpecialTokens:
    """BOS / EOS of the `tokenizers.Tokenizer` `tok` from the files in `folder` (module doc).
    Raises ValueError naming the file and key of a malformed or unknown special token."""
    tc_path, gc_path = folder / "tokenizer_config.json", folder / "generation_config.json"
    tc, gc = _read_json(tc_path), _read_json(gc_path)
    bos = _token_id(tok, tc_path, "bos_token", tc.get("bos_token"))
    eos = _token_id(tok, tc_path, "eos_token", tc.get("eos_token"))
    stops = _ids(gc_path, "eos_token_id", gc["eos_token_id"]) \
        if gc.get("eos_token_id") is not None else ()
    if "bos_token" not in tc and gc.get("bos_token_id") is not None:   # null there: no BOS
        bos = _ids(gc_path, "bos_token_id", gc["bos_token_id"])[0]
    if eos is None:
        eos = stops[0] if stops else next(
            (tok.token_to_id(t) for t in EOS_NAMES if tok.token_to_id(t) is not None), None)
    size = vocab_span(tok)
    for key, tid in (("bos", bos), ("eos", eos)) + tuple(("eos_token_id", s) for s in stops):
        if tid is not None and tid >= size:
            raise ValueError(f"{folder}: {key} id {tid} is outside the tokenizer's vocabulary "
                             f"({size} tokens)")
    return SpecialTokens(bos_id=bos, eos_id=eos, stop_ids=stops or ((eos,) if eos is not None
                                                                     else ()),
                         add_bos=_flag(tc_path, "add_bos_token", tc.get("add_bos_token")),
                         add_eos=_flag(tc_path, "add_eos_token", tc.get("add_eos_token")))


def tokenizer_file(path: str | Path):
    """The `tokenizers.Tokenizer` of a tokenizer.json as transformers' `tokenizer(text)` uses it:
    the padding and truncation the file may set are off (transformers turns them off unless a
    call asks for them), so a document's ids are all its own, whole, in any batch. The one place
    a tokenizer.json is loaded (training, eval, generate, `data prepare`'s workers). ValueError
    naming the file when the tokenizers library cannot read it."""
    from tokenizers import Tokenizer
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception
        raise ValueError(f"tokenizer {path}: cannot be read by the tokenizers library "
                         f"({str(e).splitlines()[0][:200]})") from None
    tok.no_padding()
    tok.no_truncation()
    return tok


class HFTokenizer:
    """A local Hugging Face `tokenizer.json` (nothing downloaded) and its special tokens."""

    def __init__(self, path: str | Path):
        self.name = str(path)
        self._tok = tokenizer_file(path)
        self.special = special_tokens(self._tok, Path(path).parent)
        self.vocab_size = vocab_span(self._tok)
        if self.special.eos_id is None:
            raise ValueError(f"tokenizer {path}: no end-of-sequence token (set eos_token in "
                             "tokenizer_config.json beside it)")
        self.eos_id, self.bos_id = self.special.eos_id, self.special.bos_id
        self.stop_ids = self.special.stop_ids
        self._check_flags(path)

    def _check_flags(self, path) -> None:
        """Refuse add_bos_token / add_eos_token that the post-processor does not do (module doc)."""
        s = self.special
        with_sp = self._tok.encode("a").ids
        without = self._tok.encode("a", add_special_tokens=False).ids
        adds = {"add_bos_token": (s.bos_id is not None and with_sp[:1] == [s.bos_id]
                                  and without[:1] != [s.bos_id]),
                "add_eos_token": with_sp[-1:] == [s.eos_id] and without[-1:] != [s.eos_id]}
        for key, flag in (("add_bos_token", s.add_bos), ("add_eos_token", s.add_eos)):
            if flag is not None and flag != adds[key]:
                raise ValueError(
                    f"{Path(path).parent / 'tokenizer_config.json'}: {key}={str(flag).lower()} "
                    f"but {path}'s post-processor {'adds' if adds[key] else 'does not add'} that "
                    "token; transformers 4 and 5 read this folder differently: make them agree")

    @property
    def raw(self):
        """The `tokenizers.Tokenizer` (`tokenizer_file`: padding and truncation off)."""
        return self._tok

    def encode(self, text: str) -> np.ndarray:
        """The ids transformers' tokenizer(text) gives: special tokens as the post-processor adds
        them (module doc)."""
        return np.asarray(self._tok.encode(text).ids, np.int32)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])

    def encode_offsets(self, text: str, *, add_special_tokens: bool = True
                       ) -> tuple[np.ndarray, np.ndarray]:
        """The ids of `text` (with the post-processor's special tokens, or without them as
        transformers' apply_chat_template encodes a rendered chat) and, per token, the
        [start, end) characters of `text` it covers ((0, 0) for an added BOS / EOS)."""
        enc = self._tok.encode(text, add_special_tokens=add_special_tokens)
        return (np.asarray(enc.ids, np.int32),
                np.asarray(enc.offsets, np.int64).reshape(-1, 2))


def make_tokenizer(name: str):
    """"byte" or a path to a tokenizer.json. Raises ValueError otherwise."""
    if name == "byte":
        return ByteTokenizer()
    if name.endswith(".json") and Path(name).is_file():
        return HFTokenizer(name)
    if not name:
        raise ValueError("no tokenizer is known for this model (it was converted from a folder "
                         "without tokenizer.json); choose one: --tokenizer byte|PATH (eval, "
                         "generate), tokenizer=byte|PATH (train)")
    raise ValueError(f"tokenizer={name!r} must be 'byte' or an existing tokenizer.json path")


def check_fits(tok, vocab_size: int, *, what: str) -> None:
    """Refuse a tokenizer whose ids can exceed the model's embedding table."""
    if tok.vocab_size > vocab_size:
        raise ValueError(f"{what}: tokenizer {tok.name} has {tok.vocab_size} tokens, more than "
                         f"the model's vocab_size={vocab_size}")


def side_files(tokenizer_json: str | Path) -> list[Path]:
    """tokenizer.json and the special-token files beside it, to copy along with a model."""
    p = Path(tokenizer_json)
    return [p] + [p.parent / n for n in SIDE_FILES if (p.parent / n).is_file()]
