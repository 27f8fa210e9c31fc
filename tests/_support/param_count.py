"""The test oracle of `dropless.models.arithmetic`: parameter counts read from the shapes
`init_params` really creates (under `jax.eval_shape`, no memory is allocated). Nothing in the
library calls it; the tests check that the arithmetic model equals it, part by part, for every
preset and for small variants (tests/models/test_arithmetic.py).

Published conventions: `total` is the main model (embedding and output head included, MTP
modules excluded and reported as `mtp`); `active` counts the parameters one token touches:
every non-expert weight, the shared experts and top_k of the num_experts routed experts.
"""
from __future__ import annotations

import math

import jax

from dropless.config import ModelConfig


def _size(tree) -> int:
    return sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(tree))


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """{"total", "active", "embedding", "lm_head", "attention", "dense_ffn", "routed_experts",
    "shared_experts", "router", "norms", "mtp", "router_bias", "mtp_matmul_active"}: parameter
    counts (not bytes). Attention counts include its q/kv norms (MLA, qk-norm)."""
    from dropless.models.decoder import init_params
    from dropless.models.scan import unstack_layers
    shapes = jax.eval_shape(lambda k: unstack_layers(init_params(k, cfg)), jax.random.key(0))
    counts = {"embedding": _size(shapes["embed"]), "lm_head": _size(shapes.get("lm_head", {})),
              "attention": 0, "dense_ffn": 0, "routed_experts": 0, "shared_experts": 0,
              "router": 0, "norms": _size(shapes["final_norm"]),
              "mtp": _size(shapes.get("mtp", []))}
    for blk in shapes["layers"]:
        counts["attention"] += _size(blk["attn"])
        counts["norms"] += _size(blk["attn_norm_D"]) + _size(blk["ffn_norm_D"])
        if "moe" in blk:
            counts["routed_experts"] += _size(blk["moe"]["experts"])
            counts["shared_experts"] += _size(blk["moe"].get("shared", {}))
            counts["router"] += _size(blk["moe"]["router"])
        else:
            counts["dense_ffn"] += _size(blk["ffn"])
    counts["total"] = sum(v for k, v in counts.items() if k != "mtp")
    inactive = 0
    if cfg.moe is not None:
        inactive = counts["routed_experts"] * (cfg.moe.num_experts - cfg.moe.top_k) \
            // cfg.moe.num_experts
    counts["active"] = counts["total"] - inactive
    counts["router_bias"] = sum(_size(b["moe"]["router"]["bias_E"]) for b in shapes["layers"]
                                if "moe" in b)
    counts["mtp_matmul_active"] = sum(_mtp_matmul_active(m, cfg) for m in shapes.get("mtp", []))
    return counts


def _mtp_matmul_active(module, cfg: ModelConfig) -> int:
    """Matmul weights one token uses in an MTP module (head excluded: it is shared)."""
    blk = module["block"]
    n = _size(module["proj_2DD"]) + _size(blk["attn"]) - sum(
        _size(v) for k, v in blk["attn"].items() if "norm" in k)
    if "moe" in blk:
        moe = cfg.moe
        n += _size(blk["moe"]["router"]["w_DE"]) + _size(blk["moe"].get("shared", {}))
        n += _size(blk["moe"]["experts"]) * moe.top_k // moe.num_experts
    else:
        n += _size(blk["ffn"])
    return n
