"""Vocabulary tiling as XLA:GPU compiles the train step (a compile-only H100,
train/compile_only.py): deepseek3-1gpu's attention and dense layers, two of them, with
DeepSeek-V3's vocabulary of 129,280 at 4 x 1024 tokens, where the head's float32 logits
(1.97 GiB) are the step's largest tensor. At 8 tiles the step holds at least 0.9 of a whole
float32 logits array less than at 1: the logits and their cotangent live a tile at a time, and
nothing of the vocabulary's size is hoisted out of the tile loop whole (XLA's loop-invariant
code motion moved `token_nll`'s iota and zeros out of it, 0.5 GiB at this size, before the tile
read its target's logit by a gather: train/cross_entropy.py). About 25 s a compile."""
from __future__ import annotations

from dropless.config_file import build_config
from dropless.train import compile_only, preflight
from tests._support import cuda_compile

cuda_compile.require_plugin()

TOKENS, VOCAB = 4 * 1024, 129280


def _total(tiles: int) -> float:
    cfg = build_config([("preset", "deepseek3-1gpu"), ("model.num_layers", 2),
                        ("model.first_k_dense", 2), ("model.vocab_size", VOCAB),
                        ("seq_len", 1024), ("per_device_batch_size", 4),
                        ("num_vocab_tiling", tiles)])
    return preflight.compiled(cfg, compile_only.devices("h100")[0])["total"]


def test_eight_tiles_hold_a_whole_logits_array_less():
    logits = TOKENS * VOCAB * 4
    whole, tiled = _total(1), _total(8)
    assert whole - tiled >= 0.9 * logits, (whole / 2 ** 30, tiled / 2 ** 30, logits / 2 ** 30)
