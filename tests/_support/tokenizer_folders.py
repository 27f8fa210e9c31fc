"""Tiny real tokenizer folders for the tokenizer tests, trained with the `tokenizers` library
itself (a SentencePiece-style BPE of 120 tokens, so they fit the 256-token fixture models), laid
out as the hub ships them: tokenizer.json + tokenizer_config.json (+ generation_config.json).

FOLDERS:
* llama: Mixtral / DeepSeek-V3 style, LlamaTokenizerFast with add_bos_token (BOS <s>, EOS </s>)
* llama_eos: the same with add_eos_token too
* qwen: Qwen3 style, no BOS, EOS <|endoftext|>, generation stops at two ids
* template: the tokenizer.json's own post-processor adds BOS, no add_bos_token flag
(every tokenizer.json adds what its flags say, as the released folders do)
* plain: a bare tokenizer.json and a config naming only eos_token
"""
from __future__ import annotations

import json
from pathlib import Path

SPECIALS = ["<unk>", "<s>", "</s>", "<|endoftext|>", "<|im_end|>"]
CORPUS = ["The quick brown fox jumps over the lazy dog.", "A stitch in time saves nine.",
          "All that glitters is not gold.", "Where there is smoke there is fire.",
          "def fib(n): return n if n < 2 else fib(n - 1) + fib(n - 2)", "one\ntwo  three"] * 20
VOCAB = 120

LLAMA = {"tokenizer_class": "LlamaTokenizerFast", "add_bos_token": True,
         "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
FOLDERS = {   # name: (tokenizer_config.json, generation_config.json, post-processor template)
    "llama": (LLAMA, {"bos_token_id": 1, "eos_token_id": 2}, "<s> $A"),
    "llama_eos": (dict(LLAMA, add_eos_token=True, bos_token={
        "content": "<s>", "lstrip": False, "normalized": False, "rstrip": False,
        "single_word": False, "__type": "AddedToken"}), None, "<s> $A </s>"),
    "qwen": ({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
              "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"},
             {"bos_token_id": 3, "eos_token_id": [3, 4]}, None),
    "template": ({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
                  "eos_token": "</s>"}, None, "<s> $A"),
    "plain": ({"eos_token": "</s>"}, None, None),
    # the llama folder with a tokenizer.json that sets truncation and padding (as some hub files
    # do): transformers' tokenizer(text) turns both off unless the call asks for them
    "truncating": (LLAMA, {"bos_token_id": 1, "eos_token_id": 2}, "<s> $A",
                   {"truncation": {"max_length": 3}, "padding": {"length": 12, "pad_id": 0}}),
}
# add_bos_token=true over a tokenizer.json that adds none: transformers 4.57 adds BOS, 5.x not
DISAGREE = (LLAMA, None, None)


def train_tokenizer(*, byte_level: bool = False):
    """A SentencePiece-style (Metaspace) BPE of VOCAB tokens trained on CORPUS, as Llama /
    Mixtral / DeepSeek ship; `byte_level`: a GPT-2 / Qwen style byte-level one (256 + merges +
    specials: more tokens than the 256-token fixture models hold)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    if byte_level:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        alphabet = []
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


REFERENCE = Path(__file__).parent / "tokenizer_reference.json"


def reference_tokenizer():
    """train_tokenizer()'s result as committed in tokenizer_reference.json (with transformers'
    ids for it), so a tokenizers release that trains differently cannot move the reference."""
    from tokenizers import Tokenizer
    return Tokenizer.from_str(json.dumps(json.loads(REFERENCE.read_text())["tokenizer"]))


def write_folder(d: Path, tc: dict, gc: dict | None, template: str | None,
                 limits: dict | None = None, *, tok=None) -> Path:
    """One tokenizer folder: tokenizer.json (with `template` as its post-processor, and the
    `limits` {"truncation": enable_truncation's arguments, "padding": enable_padding's} saved in
    it), the tokenizer_config.json `tc` and, if given, the generation_config.json `gc`."""
    from tokenizers import processors
    tok = tok or reference_tokenizer()
    if template:
        specials = [(t, tok.token_to_id(t)) for t in ("<s>", "</s>") if t in template]
        tok.post_processor = processors.TemplateProcessing(single=template,
                                                           special_tokens=specials)
    if limits:
        tok.enable_truncation(**limits["truncation"])
        tok.enable_padding(**limits["padding"])
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    if gc is not None:
        (d / "generation_config.json").write_text(json.dumps(gc))
    return d


def build_folders(root: Path) -> dict[str, Path]:
    """Write every FOLDERS entry under root; returns name -> folder."""
    return {name: write_folder(root / name, *spec) for name, spec in FOLDERS.items()}
