"""`dropless bench KIND`: one module per kind, each with `add_arguments` and `run`."""
from __future__ import annotations

import importlib

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


def add_arguments(parser) -> None:
    sub = parser.add_subparsers(dest="kind", required=True, metavar="KIND")
    for name, (module, help_text) in KINDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_bench_module=module)
        importlib.import_module(module).add_arguments(p)


def run(args) -> int:
    return int(importlib.import_module(args._bench_module).run(args) or 0)
