"""The arithmetic model's numbers for one model (`dropless.models.arithmetic`: parameter counts,
FLOPs per token), remembered per model and sequence length: they depend on the model alone,
each is a walk over its layers, and a layout search (`plan.sweep.suggest`) asks for them once
a candidate, thousands of times. Each call returns a value of its own (a fresh dict), equal to
the arithmetic model's.
"""
from __future__ import annotations

import functools

from dropless.config import ModelConfig
from dropless.models import arithmetic as ar

CACHED_MODELS = 64   # models remembered (a search varies one model's buffer factor: a few)


@functools.lru_cache(maxsize=CACHED_MODELS)
def _param_counts(s: ModelConfig) -> tuple[tuple[str, int], ...]:
    return tuple(ar.param_counts(s).items())


def param_counts(s: ModelConfig) -> dict[str, int]:
    """`models.arithmetic.param_counts(s)`."""
    return dict(_param_counts(s))


@functools.lru_cache(maxsize=4 * CACHED_MODELS)
def _layer_params(s: ModelConfig, moe: bool) -> tuple[tuple[str, int], ...]:
    return tuple(ar.layer_params(s, moe).items())


def layer_params(s: ModelConfig, moe: bool) -> dict[str, int]:
    """`models.arithmetic.layer_params(s, moe)`."""
    return dict(_layer_params(s, moe))


@functools.lru_cache(maxsize=4 * CACHED_MODELS)
def _layer_forward_flops(s: ModelConfig, seq_len: int, moe: bool
                         ) -> tuple[tuple[str, float], ...]:
    return tuple(ar.layer_forward_flops(s, seq_len, moe).items())


def layer_forward_flops(s: ModelConfig, seq_len: int, moe: bool) -> dict[str, float]:
    """`models.arithmetic.layer_forward_flops(s, seq_len, moe)`."""
    return dict(_layer_forward_flops(s, seq_len, moe))


@functools.lru_cache(maxsize=CACHED_MODELS)
def _forward_flops(s: ModelConfig, seq_len: int) -> tuple[tuple[str, float], ...]:
    return tuple(ar.forward_flops(s, seq_len).items())


def forward_flops(s: ModelConfig, seq_len: int) -> dict[str, float]:
    """`models.arithmetic.forward_flops(s, seq_len)` (MTP included)."""
    return dict(_forward_flops(s, seq_len))


@functools.lru_cache(maxsize=CACHED_MODELS)
def model_flops_per_token(s: ModelConfig, seq_len: int) -> float:
    """`models.arithmetic.model_flops_per_token(s, seq_len)` (MTP included)."""
    return ar.model_flops_per_token(s, seq_len)


@functools.lru_cache(maxsize=CACHED_MODELS)
def six_n_flops_per_token(s: ModelConfig) -> float:
    """`models.arithmetic.six_n_flops_per_token(s)`."""
    return ar.six_n_flops_per_token(s)
