"""Scanned layers: runs of consecutive same-kind decoder layers stored stacked and run under one
`jax.lax.scan`, so compile time does not grow with depth; and the pure conversion between the two
parameter layouts, so a checkpoint written either way loads either way.

Legend: L layers in a run, E experts, D model dim.

Layouts of the decoder layers inside a parameter tree:
- per-layer (`scan_layers=False`): `"layers": [block, ...]`, one block per layer;
- scanned (`scan_layers=True`): `"layer_runs": [run, ...]`, one run per maximal stretch of
  consecutive layers of one kind (dense or MoE, as `ModelConfig.is_moe_layer` says), each run a
  block whose every array has a leading L axis (e.g. `moe/experts/w_gate_EDF` is [L, E, D, F]).
  DeepSeek-V3's 3 dense + 58 MoE layers are two runs; a Qwen3-MoE `mlp_only_layers` pattern is
  as many runs as it has stretches.
The kind of a block is whether it holds "moe"; the conversion needs no config, so it also works
inside optimizer states (whose moments mirror the parameter tree).
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from dropless.config import ModelConfig

PER_LAYER, SCANNED = "layers", "layer_runs"


def layer_runs(cfg: ModelConfig) -> list[tuple[int, int, bool]]:
    """[(start, stop, is_moe)] of maximal stretches of consecutive layers of one kind."""
    runs: list[tuple[int, int, bool]] = []
    for i in range(cfg.num_layers):
        moe = cfg.is_moe_layer(i)
        if runs and runs[-1][2] == moe:
            runs[-1] = (runs[-1][0], i + 1, moe)
        else:
            runs.append((i, i + 1, moe))
    return runs


def _kind_runs(blocks: list[Any]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for i, b in enumerate(blocks):
        if runs and ("moe" in blocks[runs[-1][0]]) == ("moe" in b):
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def stack_layers(params: dict, cfg: ModelConfig | None = None) -> dict:
    """Per-layer -> scanned layout (a new dict; other entries shared). With `cfg`, checks that
    the blocks match `cfg`'s layer count and kinds (ValueError naming the layer otherwise)."""
    if SCANNED in params:
        return params
    blocks = list(params[PER_LAYER])
    if cfg is not None:
        check_layers(blocks, cfg)
    out = {k: v for k, v in params.items() if k != PER_LAYER}
    out[SCANNED] = [jax.tree.map(lambda *xs: jnp.stack(xs), *blocks[a:b])
                    for a, b in _kind_runs(blocks)]
    return out


def unstack_layers(params: dict, cfg: ModelConfig | None = None) -> dict:
    """Scanned -> per-layer layout (a new dict; other entries shared). With `cfg`, checks the
    result against `cfg` (ValueError naming the layer otherwise)."""
    if SCANNED not in params:
        return params
    blocks = []
    for run in params[SCANNED]:
        n = jax.tree.leaves(run)[0].shape[0]
        blocks += [jax.tree.map(lambda x, i=i: x[i], run) for i in range(n)]
    if cfg is not None:
        check_layers(blocks, cfg)
    out = {k: v for k, v in params.items() if k != SCANNED}
    out[PER_LAYER] = blocks
    return out


def check_layers(blocks: list[Any], cfg: ModelConfig) -> None:
    """ValueError unless `blocks` has cfg.num_layers blocks of the kinds cfg.is_moe_layer says."""
    if len(blocks) != cfg.num_layers:
        raise ValueError(f"parameters hold {len(blocks)} decoder layers but "
                         f"ModelConfig.num_layers={cfg.num_layers}")
    for i, b in enumerate(blocks):
        if ("moe" in b) != cfg.is_moe_layer(i):
            kind = "an MoE" if "moe" in b else "a dense"
            raise ValueError(f"parameters hold {kind} layer {i} but ModelConfig.is_moe_layer({i})"
                             f"={cfg.is_moe_layer(i)}")


def to_layout(tree: Any, scan: bool) -> Any:
    """Convert every parameter-like dict in `tree` (parameters, optimizer moments, a whole train
    state) to the scanned (`scan=True`) or per-layer layout; other leaves are kept as they are.
    Pure: works on arrays and, under `jax.eval_shape`, on shapes."""
    convert: Callable[[dict], dict] = stack_layers if scan else unstack_layers

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            if PER_LAYER in node or SCANNED in node:
                node = convert(node)
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, (list, tuple)) and not hasattr(node, "_fields"):
            return type(node)(walk(v) for v in node)
        if hasattr(node, "_fields"):            # NamedTuple optimizer states (optax)
            return type(node)(*(walk(v) for v in node))
        return node
    return walk(tree)


def is_scanned(tree: Any) -> bool | None:
    """True/False when `tree` holds decoder layers in the scanned/per-layer layout, else None."""
    found: list[bool] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if PER_LAYER in node or SCANNED in node:
                found.append(SCANNED in node)
            for v in node.values():
                walk(v)
        elif isinstance(node, (list, tuple)):
            for v in node:
                walk(v)
    walk(tree)
    return found[0] if found else None


def run_layers(params: dict, x: jax.Array, layer_fn: Callable, *extra: Any
               ) -> tuple[jax.Array, list[dict[str, jax.Array]]]:
    """Apply the decoder layers to x in order, in whichever layout `params` holds them.

    `layer_fn(block, x, *extra) -> (x, aux)`. Scanned runs go through one `jax.lax.scan` each;
    returns (x, per-layer auxes of the layers that returned one, in layer order), the same list
    the per-layer loop gives.
    """
    auxes: list[dict[str, jax.Array]] = []
    if SCANNED not in params:
        for p in params[PER_LAYER]:
            x, aux = layer_fn(p, x, *extra)
            if aux:
                auxes.append(aux)
        return x, auxes
    for run in params[SCANNED]:
        x, aux_L = jax.lax.scan(lambda h, p: layer_fn(p, h, *extra), x, run)
        if aux_L:
            n = jax.tree.leaves(run)[0].shape[0]
            auxes += [{k: v[i] for k, v in aux_L.items()} for i in range(n)]
    return x, auxes


def to_config_layout(tree: Any, cfg: ModelConfig) -> Any:
    """`tree` (parameters, optimizer moments or a train state) in the layout `cfg` asks for:
    decoder layers scanned per `cfg.scan_layers`, expert gate/up fused per
    `cfg.moe.prefuse_moe_weights`. Exact (stack/split, concatenate/split)."""
    from dropless.moe import convert_expert_weights, expert_layout
    tree = to_layout(tree, cfg.scan_layers)
    if cfg.moe is not None and expert_layout(tree) is not None:
        tree = convert_expert_weights(tree, prefuse=cfg.moe.prefuse_moe_weights)
    return tree


def to_canonical_layout(tree: Any) -> Any:
    """`tree` with decoder layers as a per-layer list and expert gate/up unfused: the layout
    converters (dropless.hf) and the parameter counter read."""
    from dropless.moe import convert_expert_weights, expert_layout
    tree = to_layout(tree, False)
    if expert_layout(tree) is not None:
        tree = convert_expert_weights(tree, prefuse=False)
    return tree
