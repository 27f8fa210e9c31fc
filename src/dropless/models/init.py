"""Initialisation schemes (ModelConfig.init): per parameter kind, the distribution and the std
each scheme draws from, as one table (`SCHEMES`), and the draw a model's init functions use.

Legend: V vocabulary, D model dim, E experts, F expert hidden dim, L num_layers.

Every weight is drawn through `initializer(cfg)` (a `moe.ffn.Draw`) with its kind and its
per-matrix fan-in (the size of the axes it contracts). The kinds (`PARAM_KINDS`):
  embed       the token embedding [V, D]
  head        the output head [D, V] (untied models only)
  attn        attention input projections (q, k, v; MLA's wq_a, wq_b, wkv_a, wkv_b)
  attn_out    attention output projection (wo)                      residual output
  ffn         dense-layer and shared-expert gate/up [D, F]
  ffn_out     dense-layer and shared-expert down [F, D]             residual output
  expert      routed-expert gate/up [E, D, F]
  expert_out  routed-expert down [E, F, D]                          residual output
  router      the router [D, E]
  mtp_proj    an MTP module's 2D -> D projection
Norm weights start at one and the router bias at zero in every scheme.

Schemes (docs/training.md "Initialisation" has the table with sources):
  fan_in   N(0, 1/fan_in) for every matrix, the head included; embedding N(0, 1).
  normal   N(0, init_std^2) for every matrix and the embedding (transformers' `_init_weights`
           with `initializer_range`; Megatron-LM's `init_method_normal(init_method_std)`).
  maxtext  MaxText's, leaf by leaf: embedding N(0, 1) (models/models.py `token_embedder`);
           attention kernels normal over the fan-in (attention_mla.py / attentions.py
           `nd_dense_init(1.0, "fan_in", "normal")`); the head, dense/shared MLPs, router and
           MTP projection truncated normal over the fan-in (linears.py, moe.py `GateLogit`,
           decoders.py `logits_dense`: `nd_dense_init(1.0, "fan_in", "truncated_normal")`);
           routed experts truncated normal with the expert axis as the input axis (moe.py
           `RoutedMoE`: in_axis 0, out_axis 1, so fan-in E*F for gate/up and E*D for down).
  legacy   fan_in with the head at N(0, 0.02^2): the init before schemes existed, bit for bit.
Overrides: head_init_std / embed_init_std (> 0) replace the scheme's std of that part (its
distribution kept); init_residual_scaling divides the std of the residual-output kinds by
sqrt(2 * L) (Megatron-LM's `scaled_init_method_normal`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp

from dropless.config import ModelConfig
from dropless.moe.ffn import Draw

PARAM_KINDS = ("embed", "head", "attn", "attn_out", "ffn", "ffn_out", "expert", "expert_out",
               "router", "mtp_proj")
RESIDUAL_OUT_KINDS = ("attn_out", "ffn_out", "expert_out")
DISTRIBUTIONS = ("normal", "truncated_normal")
# std of a unit truncated normal on [-2, 2]: jax.nn.initializers.variance_scaling divides by it
# so that the truncated draw has the std asked for
TRUNCATED_STD = 0.87962566103423978


@dataclasses.dataclass(frozen=True, kw_only=True)
class Leaf:
    """What a std rule may read: the weight's kind, shape and per-matrix fan-in."""

    kind: str
    shape: tuple[int, ...]
    fan_in: int


# A std rule: (leaf, cfg) -> (numerator, denominator) of the std. Kept as a fraction because
# the fan-in rules divide by sqrt(fan_in), exactly as the draws did before schemes (legacy is
# bitwise); `std()` is numerator / denominator.
STD_RULES: dict[str, Callable[[Leaf, ModelConfig], tuple[float, float]]] = {
    "one": lambda leaf, cfg: (1.0, 1.0),
    "fan_in": lambda leaf, cfg: (1.0, math.sqrt(leaf.fan_in)),
    # variance_scaling with in_axis=0, out_axis=1 on an [E, in, out] kernel: fan-in E * out
    "expert_axis_fan_in": lambda leaf, cfg: (1.0, math.sqrt(leaf.shape[0] * leaf.shape[-1])),
    "init_std": lambda leaf, cfg: (cfg.init_std, 1.0),
    "0.02": lambda leaf, cfg: (0.02, 1.0),
}


@dataclasses.dataclass(frozen=True)
class Rule:
    """One table cell: a distribution (DISTRIBUTIONS) and a std rule (STD_RULES)."""

    dist: str
    std: str


def _every(rule: Rule, **cells: Rule) -> dict[str, Rule]:
    return {kind: cells.get(kind, rule) for kind in PARAM_KINDS}


_N_FAN, _T_FAN = Rule("normal", "fan_in"), Rule("truncated_normal", "fan_in")
# THE table: scheme -> parameter kind -> rule (keys are config.INIT_SCHEMES, tested)
SCHEMES: dict[str, dict[str, Rule]] = {
    "fan_in": _every(_N_FAN, embed=Rule("normal", "one")),
    "normal": _every(Rule("normal", "init_std")),
    "maxtext": _every(_T_FAN, embed=Rule("normal", "one"), attn=_N_FAN, attn_out=_N_FAN,
                      expert=Rule("truncated_normal", "expert_axis_fan_in"),
                      expert_out=Rule("truncated_normal", "expert_axis_fan_in")),
    "legacy": _every(_N_FAN, embed=Rule("normal", "one"), head=Rule("normal", "0.02")),
}
# the overrides of ModelConfig: kind -> field (> 0 replaces the scheme's std)
STD_OVERRIDES = {"head": "head_init_std", "embed": "embed_init_std"}


def std_fraction(cfg: ModelConfig, kind: str, shape: tuple[int, ...], fan_in: int
                 ) -> tuple[str, float, float]:
    """(distribution, numerator, denominator) of the std that `cfg` gives a weight of `kind`
    with `shape` and `fan_in`: the scheme's rule, then an override, then the residual scaling.
    Raises KeyError for a kind not in PARAM_KINDS."""
    rule = SCHEMES[cfg.init][kind]
    num, den = STD_RULES[rule.std](Leaf(kind=kind, shape=tuple(shape), fan_in=fan_in), cfg)
    override = STD_OVERRIDES.get(kind)
    if override and getattr(cfg, override) > 0:
        num, den = float(getattr(cfg, override)), 1.0
    if cfg.init_residual_scaling and kind in RESIDUAL_OUT_KINDS:
        den *= math.sqrt(2 * cfg.num_layers)
    return rule.dist, num, den


def std(cfg: ModelConfig, kind: str, shape: tuple[int, ...], fan_in: int) -> float:
    """The std a weight of `kind` starts with under `cfg` (the truncated normal's included)."""
    _, num, den = std_fraction(cfg, kind, shape, fan_in)
    return num / den


def sample(key: jax.Array, shape: tuple[int, ...], dist: str, num: float, den: float,
           dtype) -> jax.Array:
    """z * num / den in float32, cast to `dtype`: z ~ N(0, 1), or for "truncated_normal" a
    normal truncated to [-2, 2] rescaled to unit std (as jax's variance_scaling draws it).
    A factor of 1 is not applied, so the fan-in draw is exactly N(0,1) / sqrt(fan_in)."""
    if dist == "truncated_normal":
        z = jax.random.truncated_normal(key, -2.0, 2.0, shape, jnp.float32)
        num = num / TRUNCATED_STD
    else:
        z = jax.random.normal(key, shape, jnp.float32)
    if num != 1.0:
        z = num * z
    if den != 1.0:
        z = z / den
    return z.astype(dtype)


def initializer(cfg: ModelConfig) -> Draw:
    """The draw (moe.ffn.Draw) of `cfg`'s scheme and overrides, for every init function."""
    def draw(key: jax.Array, kind: str, shape: tuple[int, ...], fan_in: int, dtype) -> jax.Array:
        dist, num, den = std_fraction(cfg, kind, shape, fan_in)
        return sample(key, shape, dist, num, den, dtype)
    return draw


def describe(cfg: ModelConfig) -> dict[str, str]:
    """kind -> "distribution std-rule" for `cfg` (what `dropless config show` prints), the
    overrides and the residual scaling written in."""
    out = {}
    for kind in PARAM_KINDS:
        rule = SCHEMES[cfg.init][kind]
        what = rule.std if rule.std != "init_std" else f"{cfg.init_std:g}"
        override = STD_OVERRIDES.get(kind)
        if override and getattr(cfg, override) > 0:
            what = f"{getattr(cfg, override):g} ({override})"
        if cfg.init_residual_scaling and kind in RESIDUAL_OUT_KINDS:
            what += f" / sqrt(2*{cfg.num_layers})"
        out[kind] = f"{rule.dist} {what}"
    return out
