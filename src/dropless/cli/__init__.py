"""The `dropless` command line: one module per command (`cli/<command>.py`, each with
`add_arguments(parser)` and `run(args) -> int`), `cli/main.py` the table of commands and the one
place an error becomes one line."""
from dropless.cli.main import build_parser, describe, main, misplaced_option

__all__ = ["build_parser", "describe", "main", "misplaced_option"]
