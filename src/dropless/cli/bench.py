"""`dropless bench KIND`: one module per kind, each with `add_arguments` and `run`.

Every kind's arguments are checked here, before its module runs (so before anything is compiled
or timed): sizes and repeats are positive, buffer factors >= 1, comma lists name known dtypes,
backends, routings and dispatchers, `--experts E:K` has 0 < K <= E (`bench gpu` checks its
own `--sections`, `--shapes` and `--inject-fault` first thing). A bad one is a
ValueError naming the flag and the value (one line, exit 2, at the command line).
"""
from __future__ import annotations

import importlib
import math

KINDS = {
    "dispatch": ("dropless.bench.dispatch",
                 "expert-parallel dispatchers: latency, rows/bytes moved, dedup saving"),
    "gpu": ("dropless.bench.gpu", "the prepared device check for one NVIDIA GPU: GPU tests, "
            "grouped matmul vs cuBLAS and torch, MoE layer, a few training steps (--dry-run: CPU)"),
    "gmm": ("dropless.bench.gmm", "grouped matmul backends vs a dense matmul of equal FLOPs"),
    "moe": ("dropless.bench.moe", "MoE layer (dropless and capacity) vs a dense SwiGLU FFN"),
    "quant": ("dropless.bench.quant", "MXFP8 vs bf16 / per-tensor FP8: error, emulation cost, "
              "convergence"),
}
POSITIVE = ("tokens", "d_model", "d_ff", "top_k", "ep", "host_devices", "devices_per_node",
            "repeats", "m", "k", "n", "rows", "steps", "train_steps", "tests_timeout_s",
            "budget_s", "shape", "error_shape")
AT_LEAST_ZERO = ("projection_tokens",)
AT_LEAST_ONE = ("buffer_factor",)
ROUTINGS = {"gmm": None, "gpu": None, "moe": ("uniform", "zipf"), "dispatch": ("uniform", "zipf")}


def add_arguments(parser) -> None:
    sub = parser.add_subparsers(dest="kind", required=True, metavar="KIND")
    for name, (module, help_text) in KINDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_bench_module=module)
        importlib.import_module(module).add_arguments(p)


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _items(args, dest: str) -> list[str]:
    text = getattr(args, dest)
    items = [x.strip() for x in str(text).split(",")]
    if not all(items):
        raise ValueError(f"{_flag(dest)} {text!r} has an empty item (a comma list: a,b,c)")
    return items


def _one_of(args, dest: str, known) -> None:
    for item in _items(args, dest):
        if item not in known:
            raise ValueError(f"{_flag(dest)}: {item!r} is not one of {', '.join(known)}")


def _numbers(args, dest: str, convert, low: float, what: str) -> None:
    for item in _items(args, dest):
        try:
            ok = math.isfinite(convert(item)) and convert(item) >= low
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"{_flag(dest)}: {item!r} is not {what}")


def _dtypes(args) -> None:
    import jax.numpy as jnp
    for item in _items(args, "dtypes"):
        try:
            ok = jnp.issubdtype(jnp.dtype(item), jnp.floating)
        except TypeError:
            ok = False
        if not ok:
            raise ValueError(f"--dtypes: {item!r} is not a floating dtype (float32, bfloat16, "
                             "float16)")


def _experts_pairs(args) -> None:
    for item in _items(args, "experts"):
        e, sep, k = item.partition(":")
        if not (sep and e.isdigit() and k.isdigit()):
            raise ValueError(f"--experts: {item!r} is not E:K (experts:top_k, e.g. 8:2)")
        if not 0 < int(k) <= int(e):
            raise ValueError(f"--experts: {item!r} needs 0 < top_k <= experts (top_k={k}, "
                             f"experts={e})")


def check_arguments(kind: str, args) -> None:
    """Raise ValueError naming the flag and value of the first bad argument of `kind`."""
    for dest in POSITIVE + AT_LEAST_ZERO + AT_LEAST_ONE:
        value = getattr(args, dest, None)
        if value is None:
            continue
        low = 0 if dest in AT_LEAST_ZERO else 1 if dest in AT_LEAST_ONE else None
        values = value if isinstance(value, (list, tuple)) else [value]
        if not all(math.isfinite(v) and (v > 0 if low is None else v >= low) for v in values):
            need = "> 0" if low is None else f">= {low}"
            raise ValueError(f"{_flag(dest)} {' '.join(map(str, values))} must be {need}")
    if kind == "dispatch":
        if not 0 < args.top_k <= args.experts:
            raise ValueError(f"--top-k {args.top_k} must be in [1, --experts={args.experts}]")
        if args.host_devices % args.ep:
            raise ValueError(f"--ep={args.ep} does not divide --host-devices={args.host_devices}")
        from dropless.moe.dispatch import DISPATCHERS
        _one_of(args, "dispatchers", tuple(DISPATCHERS))
    if isinstance(getattr(args, "experts", None), str):
        _experts_pairs(args)
    if getattr(args, "groups", None) is not None:
        _numbers(args, "groups", int, 1, "a positive number of groups")
    if getattr(args, "capacity_factors", None):
        _numbers(args, "capacity_factors", float, 1e-300, "a capacity factor > 0")
    if getattr(args, "dtypes", None) is not None:
        _dtypes(args)
    for dest in ("backends", "backend"):   # gmm, moe: a comma list; quant: one name
        if getattr(args, dest, None) is not None:
            from dropless.ops.gmm.registry import check_backend_name
            for item in _items(args, dest):
                check_backend_name(item, where=_flag(dest))
    if getattr(args, "routings", None) is not None:
        known = ROUTINGS.get(kind)
        if known is None:
            from dropless.bench.gmm import ROUTINGS as known
        _one_of(args, "routings", known)


def run(args) -> int:
    check_arguments(args.kind, args)
    return int(importlib.import_module(args._bench_module).run(args) or 0)
