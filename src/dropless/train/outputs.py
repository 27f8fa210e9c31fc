"""What the training loop writes and reads besides the state and checkpoints: the metrics.jsonl
lines, TensorBoard scalars, and the eval loss over the run's fixed eval batches."""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from dropless import json_out
from dropless.config import TrainConfig
from dropless.data import corpus as data_lib
from dropless.data import loader as loader_lib
from dropless.data import sft as sft_lib
from dropless.ops.gmm.fallback import compile_auto
from dropless.train import step as step_lib
from dropless.train.progress import Progress, Timed


class MetricsWriter:
    """metrics.jsonl: one JSON object a line, and the line for the terminal when given."""

    def __init__(self, path: Path, echo: Callable[[str], Any]):
        """Refuses (ValueError naming it) a `path` that is there and is not a regular file (a
        folder, a FIFO that would block, a device): checked when the run starts, before the
        step is compiled."""
        self.path, self.echo = path, echo
        if os.path.lexists(path) and not path.is_file():
            kind = "folder" if path.is_dir() else ("broken link" if not path.exists() else
                                                   "special file (not a regular file)")
            raise ValueError(f"{path} is a {kind}; the run appends its records to this file: "
                             "move it aside and run again")

    def record(self, rec: dict, line: str | None = None) -> None:
        with open(self.path, "a") as fh:
            fh.write(json_out.dumps(rec, default=float) + "\n")
        if line:
            self.echo(line)


def eval_batches(cfg: TrainConfig, corpus) -> list:
    """The run's fixed held-out batches (the first ones, unshuffled): [B, S + 1] windows under
    packing="stream", else data.batch.Batch rows packed as the training batches are (SFT
    examples when `corpus` is a data.sft.SftCorpus), of `global_batch_size` rows (a step's;
    `step.eval_sums` reads one in micro-batches where the run accumulates gradients). A split
    of fewer sequences than a batch is one Batch whose rows past the split (which repeat its
    first sequences) count no target, so the eval loss is the split's mean."""
    b = cfg.global_batch_size
    if isinstance(corpus, sft_lib.SftCorpus):
        addr = sft_lib.Addressing(corpus.eval, seq_len=cfg.seq_len, seed=cfg.seed,
                                  packing=cfg.packing, completion_only=cfg.sft_completion_only,
                                  shuffle=False)
    elif (cfg.packing == "stream"
          and data_lib.num_sequences(corpus.eval_TOK, cfg.seq_len) >= b):
        return data_lib.eval_batches(corpus, num_batches=cfg.eval_batches, batch_size=b,
                                     seq_len=cfg.seq_len)
    else:   # (a stream split shorter than a batch: its windows as a Batch, to mask the repeats)
        addr = loader_lib.Addressing(loader_lib.as_stream(corpus.eval_TOK, corpus.eval_ends_D),
                                     seq_len=cfg.seq_len, packing=cfg.packing, seed=cfg.seed,
                                     shuffle=False)
    if addr.n < b:   # rows n.. wrap around to the split's start: each sequence counts once
        rows = addr.rows(range(b))
        mask = np.array(rows.loss_mask_BS, np.float32)
        mask[addr.n:] = 0
        return [rows._replace(loss_mask_BS=mask)]
    n = min(cfg.eval_batches, addr.n // b)
    return [addr.rows(range(i * b, (i + 1) * b)) for i in range(n)]


class Evaluator:
    """The eval loss over the run's fixed eval batches: the per-token mean over every target
    they count (each batch's summed cross-entropy and target count added up in float64, then
    divided: batches that count different numbers of targets, under packing "documents" and
    "pad" or SFT, weigh by their targets); compiled at its first use."""

    def __init__(self, cfg: TrainConfig, corpus, mesh, prog: Progress):
        self.prog = prog
        self.batches = eval_batches(cfg, corpus)
        self.fn = functools.partial(step_lib.eval_sums, cfg=cfg, mesh=mesh)
        self.compiled = None

    def __call__(self, params) -> float:
        if self.compiled is None:
            with Timed(self.prog, "compiling eval", "compiled"):
                self.compiled, _ = compile_auto(self.fn, params, self.batches[0],
                                                what="eval step")
        sums = jax.device_get([self.compiled(params, b) for b in self.batches])
        nll = sum(float(s.nll) for s in sums)
        return nll / max(sum(float(s.targets) for s in sums), 1.0)


class Scalars:
    """TensorBoard scalars, the writer created at the first step (a refused run writes none).
    `start`: the step the run resumes from (0: a new run); the writer's session starts at
    start + 1, so TensorBoard drops what an earlier session wrote for the steps this one
    replays (train/tensorboard.py)."""

    def __init__(self, out_dir: Path, start: int = 0):
        self.out_dir, self.start, self.writer = out_dir, start, None

    def __call__(self, step: int, values: dict) -> None:
        if self.writer is None:
            from dropless.train.tensorboard import ScalarWriter
            self.writer = ScalarWriter(self.out_dir, first_step=self.start + 1)
        self.writer.scalars(step, values)
