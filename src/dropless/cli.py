"""`dropless` command line: parses arguments and calls the library, nothing more.

Each subcommand lives in its own module exposing `add_arguments(parser)` and `run(args) -> int`;
the table below is the only place that lists them.
"""
from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "bench": ("dropless.bench.cli", "benchmarks: grouped matmul, MoE layer, ... (JSON lines)"),
    "train": ("dropless.train.cli", "train a model (no arguments: the tiny preset on the "
                                    "Python stdlib's source, into runs/)"),
    "config": ("dropless.config_cli", "show the effective config, or list the accepted keys"),
    "report": ("dropless.train.report", "draw loss, throughput and expert load of a run to PNG"),
    "plan": ("dropless.plan.cli", "plan a cluster run: memory, FLOPs, bytes, step time, layouts"),
    "convert": ("dropless.hf.cli", "Hugging Face checkpoint -> dropless directory, and back"),
    "eval": ("dropless.eval_cli", "loss and perplexity of a model on a text or JSONL file"),
    "generate": ("dropless.generate_cli", "continue a prompt (greedy or temperature sampling)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dropless", description="Dropless MoE training in JAX.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
