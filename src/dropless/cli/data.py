"""`dropless data prepare SRC... OUT --tokenizer byte|hf:DIR|PATH`: read corpora (JSONL plain /
.gz / .zst, Parquet, Arrow and `save_to_disk` folders, text; globs; `SRC@WEIGHT`), tokenize them
in worker processes and write token shards and a manifest (`dropless.data.prepare`,
docs/data.md).

On a terminal a progress bar shows input read, documents/s, tokens/s and the ETA; elsewhere one
line every ~10 s. The last line is a JSON summary of the manifest. Errors (a bad record named by
file and line or row, a missing source, another run's unfinished folder) are one line, exit 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from dropless.runtime.progress import on_terminal, terminal_bar


def add_arguments(parser) -> None:
    from dropless.data.prepare_workers import MAX_WORKERS
    sub = parser.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    p = sub.add_parser("prepare", help="corpora -> token shards + manifest.json",
                       description="corpora -> token shards + manifest.json (docs/data.md)",
                       usage="dropless data prepare SRC... OUT --tokenizer TOKENIZER [options]")
    p.add_argument("paths", nargs="+", metavar="PATH",
                   help="SRC... OUT: the sources (a file, folder or glob; SRC@WEIGHT writes its "
                        "training documents WEIGHT times, see docs/data.md), then the output "
                        "folder")
    p.add_argument("--tokenizer", required=True,
                   help="byte, hf:DIR (the folder's tokenizer.json), or a tokenizer.json path")
    p.add_argument("--text-field", default="text",
                   help="the JSONL field / Parquet or Arrow column holding the text (text)")
    p.add_argument("--eval-fraction", type=float, default=0.02,
                   help="documents held out for eval, chosen by a hash of their name (0.02)")
    p.add_argument("--shard-tokens", type=int, default=1 << 26,
                   help="tokens per shard, cut at document boundaries (2**26)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                   help="tokenizing processes (default: the number of cores); 0 = in this "
                        f"process; at most {MAX_WORKERS}, and no more are started than the "
                        "inputs have chunks for")
    p.add_argument("--add-bos", action=argparse.BooleanOptionalAction, default=None,
                   help="put BOS before each document (default: as the tokenizer's "
                        "post-processor does; --no-add-bos: never)")
    p.add_argument("--add-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="put EOS after each document (default; --no-add-eos: never)")


def resolve_tokenizer(spec: str) -> str:
    """"byte" or the tokenizer.json path of `spec` (`model_dir.resolve_tokenizer`, the one
    reading every command shares). Raises ValueError naming --tokenizer."""
    from dropless.model_dir import resolve_tokenizer as resolve
    return resolve(spec, name="--tokenizer")


def _config(args):
    from dropless.data.prepare import PrepareConfig
    if len(args.paths) < 2:
        raise ValueError("dropless data prepare: give the sources and then the output folder "
                         "(SRC... OUT)")
    *sources, out = args.paths
    return PrepareConfig(sources=tuple(sources), out=out,
                         tokenizer=resolve_tokenizer(args.tokenizer),
                         tokenizer_source=args.tokenizer, text_field=args.text_field,
                         eval_fraction=args.eval_fraction, shard_tokens=args.shard_tokens,
                         add_bos=args.add_bos, add_eos=args.add_eos, workers=args.workers)


class _Display:
    """The bar of `runtime.progress` on a terminal (bytes read, documents/s, tokens/s, ETA),
    else a line every 10 s."""

    def __init__(self):
        self.start, self.bar, self.task, self.first = time.monotonic(), None, None, None
        self.last_line = self.start
        if on_terminal(stderr=True):
            self.bar = terminal_bar("prepare", count="bytes", stderr=True)
            self.bar.start()

    def __call__(self, p) -> None:
        if self.first is None:   # a resumed run counts from where it starts
            self.first = p
        self.last = p
        dt = max(time.monotonic() - self.start, 1e-9)
        rates = (f"{(p.documents - self.first.documents) / dt:,.0f} docs/s | "
                 f"{(p.tokens - p.resumed_tokens) / dt:,.0f} tok/s | {p.shards} shards")
        if self.bar is not None:
            if self.task is None:
                self.task = self.bar.add_task("prepare", total=p.bytes_total, status="")
            self.bar.update(self.task, completed=p.bytes_done, status=rates)
        elif time.monotonic() - self.last_line >= 10:
            self.last_line = time.monotonic()
            print(f"prepare: {100 * p.bytes_done / max(p.bytes_total, 1):.0f}% of "
                  f"{p.bytes_total:,} bytes | {p.documents:,} docs | {p.tokens:,} tokens | "
                  f"{rates}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def run(args) -> int:
    from importlib.metadata import PackageNotFoundError, version

    from dropless.data.prepare import prepare
    try:
        created_by = f"dropless {version('dropless')}"
    except PackageNotFoundError:   # run from a source tree that is not installed
        created_by = "dropless (source tree)"
    cfg = _config(args)
    display = _Display()
    try:
        t0 = time.monotonic()
        m = prepare(cfg, created_by=created_by, on_progress=display)
    finally:
        display.close()
    dt = time.monotonic() - t0
    print(json.dumps({"out": cfg.out, "num_tokens": m.num_tokens,
                      "num_documents": m.num_documents,
                      "shards": {s: len(m.splits[s]) for s in m.splits}, "dtype": m.dtype,
                      "vocab_size": m.vocab_size, "skipped": sum(s.skipped for s in m.sources),
                      "seconds": round(dt, 2), "resumed_tokens": display.last.resumed_tokens,
                      "tokens_per_s": round((sum(m.num_tokens.values())
                                             - display.last.resumed_tokens) / max(dt, 1e-9))}))
    return 0
