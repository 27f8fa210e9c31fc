"""`dropless report RUN_DIR`: the run's summary (JSON) and its plots, drawn to PNG files in
RUN_DIR by `dropless.report` (matplotlib, an optional dependency: pip install
'dropless[report]'; `make run` and `make test` install it)."""
from __future__ import annotations

import sys
from pathlib import Path

from dropless import json_out, report


def add_arguments(parser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (holds metrics.jsonl)")


def run(args) -> int:
    """Print the run's summary as JSON, then draw the plots. Without matplotlib the numbers are
    still printed and the missing plots explained (exit status 0). Output cut short by a closed
    pipe (`dropless report DIR | head`) ends quietly with 141, as other command-line tools do
    (`cli.main` handles the BrokenPipeError)."""
    skipped: list[str] = []
    m = report.read_metrics(args.run_dir, skipped)
    for line in skipped:
        print(f"dropless: warning: {line}; skipped", file=sys.stderr)
    if not m["step"]:
        raise ValueError(f"{Path(args.run_dir) / 'metrics.jsonl'} has no step records (the run "
                         "stopped before its first step): nothing to report, no plots drawn")
    s = report.summary(m)
    print(json_out.dumps(s, indent=2), flush=True)   # NaN loss: null + last_loss_nonfinite
    try:
        paths = report.draw(args.run_dir)
    except ImportError as e:
        print(f"no plots: {e.name or 'matplotlib'} is not installed (pip install "
              f"'dropless[report]'; `make run` and `make test` install it)", file=sys.stderr)
        return 0
    print("wrote " + ", ".join(str(p) for p in paths), flush=True)
    return 0
