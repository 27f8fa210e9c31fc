"""`dropless bench data`: how fast the loader turns prepared shards into device batches, against
what training consumes, and how much memory it holds.

Legend: B rows, S sequence length.

What it measures, in one process:
- a prepared dataset of `tokens` random ids (documents of geometric length, mean `doc_len`)
  is written under `dir` in shards (data.manifest's format), streamed: never held whole;
- per packing, `batches` batches of B x S are built by data.loader.Loader (the trainer's
  addressing and placement on the default device), without prefetch; tokens/s is B * S *
  batches over their wall time, after a first batch timed alone (it builds the epoch's
  permutation, which the trainer does before compiling); the median and max per-batch time;
- the consumption it is compared with: the `tiny` preset's measured training tokens/s on this
  machine (benchmarks/results/train_tiny_cpu.jsonl, read, not re-run), and what one H200 would
  consume on `deepseek3-test` at the given MFU by the arithmetic model
  (models.arithmetic.flops_per_token, machine.PROFILES["h200"].peak_bf16);
- the process's resident memory (VmRSS) before the loader is built and after every batch:
  flat means the loader holds no more than its windows, whatever the dataset's size;
- with `memory_steps`, `dropless train` (the tiny preset) on the dataset in a subprocess, its
  VmRSS sampled every 0.2 s and set against its step records: the trainer's memory at its first
  and last step, beside what the dataset's tokens would take in memory as int32.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from dropless import machine, text_table
from dropless.bench import harness

TINY_RESULT = Path(__file__).resolve().parents[3] / "benchmarks" / "results" / \
    "train_tiny_cpu.jsonl"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataOptions:
    dir: str = "/tmp/dropless-bench-data"   # where the prepared dataset is written (reused)
    tokens: int = 200_000_000                # train tokens of the dataset
    doc_len: int = 600                       # mean document length (geometric)
    shard_tokens: int = 50_000_000           # tokens per shard
    batch: int = 16                          # B (the tiny preset's global batch)
    seq_len: int = 128                       # S
    batches: int = 400                       # timed batches per packing
    packings: str = "documents,pad,stream"
    mfu: float = 0.4                         # the H200 consumption's assumed MFU
    memory_steps: int = 0                     # > 0: also train `tiny` that long on the dataset
    quick: bool = False
    out: str | None = None

    def quick_sized(self) -> "DataOptions":
        return dataclasses.replace(self, tokens=2_000_000, shard_tokens=700_000, batches=20,
                                   quick=False)


def rss_bytes() -> int:
    """This process's resident set size now (VmRSS of /proc/self/status)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def write_random_prepared(folder: Path, *, tokens: int, doc_len: int, shard_tokens: int,
                          vocab_size: int = 256, seed: int = 0) -> Path:
    """A prepared dataset of random ids in `folder` (kept when its manifest matches the ask),
    written shard by shard; 1% of the tokens again as the eval split. Returns the folder."""
    from dropless.data import manifest as manifest_lib
    folder = Path(folder)
    ask = {"tokens": tokens, "doc_len": doc_len, "shard_tokens": shard_tokens,
           "vocab_size": vocab_size, "seed": seed}
    marker = folder / "bench-ask.json"
    if marker.is_file() and json.loads(marker.read_text()) == ask and \
            (folder / manifest_lib.MANIFEST).is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    splits: dict[str, tuple] = {}
    for split, total in (("train", tokens), ("eval", max(tokens // 100, 4 * doc_len))):
        shards = []
        for k, lo in enumerate(range(0, total, shard_tokens)):
            n = min(shard_tokens, total - lo)
            lengths = rng.geometric(1 / doc_len, size=2 * n // doc_len + 16)
            ends = np.cumsum(lengths)
            ends = np.append(ends[ends < n], n).astype("<u8")
            toks = rng.integers(1, vocab_size, n, dtype=np.uint16)
            toks[(ends - 1).astype(np.int64)] = 0          # each document ends with EOS 0
            name = f"{split}-{k:05d}"
            (folder / f"{name}.tokens").write_bytes(toks.astype("<u2").tobytes())
            (folder / f"{name}.docs").write_bytes(ends.tobytes())
            shards.append(manifest_lib.Shard(
                tokens_file=f"{name}.tokens", docs_file=f"{name}.docs", tokens=n,
                documents=int(ends.size), sha256=hashlib.sha256(toks.tobytes()).hexdigest(),
                docs_sha256=hashlib.sha256(ends.tobytes()).hexdigest()))
        splits[split] = tuple(shards)
    docs = sum(sh.documents for s in splits.values() for sh in s)
    manifest_lib.write_manifest(folder, manifest_lib.Manifest(
        tokenizer=manifest_lib.TokenizerId(kind="byte", source="byte", sha256=None),
        vocab_size=vocab_size, dtype="uint16", bos_id=None, eos_id=0, add_bos=False,
        add_eos=True, eval_fraction=0.01, splits=splits,
        sources=(manifest_lib.Source(path="random", bytes=tokens * 2, sha256="0" * 64,
                                     weight=1.0, documents=docs, tokens=tokens),),
        created_by="dropless bench data"))
    marker.write_text(json.dumps(ask))
    return folder


def consumption(mfu: float, seq_len: int) -> dict:
    """Training tokens/s to compare the loader with: tiny here (measured, committed) and one
    H200 on deepseek3-test at `mfu` (arithmetic)."""
    from dropless.models.arithmetic import flops_per_token
    from dropless.presets import get_preset
    tiny = None
    if TINY_RESULT.is_file():
        rec = json.loads(TINY_RESULT.read_text().splitlines()[-1])
        tiny = {"tokens_per_s": rec["median_tokens_per_s"], "batch": rec["batch"],
                "source": "benchmarks/results/train_tiny_cpu.jsonl"}
    fpt = flops_per_token(get_preset("deepseek3-test"), seq_len)["model"]
    peak = machine.PROFILES["h200"].peak_bf16
    return {"tiny_here": tiny, "h200_deepseek3_test": {
        "flops_per_token": fpt, "peak_bf16": peak, "mfu": mfu, "seq_len": seq_len,
        "tokens_per_s": peak * mfu / fpt}}


def measure(corpus, packing: str, opts: DataOptions) -> dict:
    """Build `opts.batches` batches of one packing from step 0, timed one by one, with RSS."""
    import jax

    from dropless.data import loader
    rss0 = rss_bytes()
    addr = loader.Addressing(loader.as_stream(corpus.train_TOK, corpus.train_ends_D),
                             seq_len=opts.seq_len, packing=packing, seed=0)
    ld = loader.Loader(addr, batch_size=opts.batch,
                       to_step=lambda b: jax.device_put(b, jax.devices()[0]))
    rss_built = rss_bytes()
    t0 = time.perf_counter()
    jax.block_until_ready(ld.next())   # the epoch's permutation: built once, before compiling
    first = time.perf_counter() - t0
    times, rss = [], []
    t_all = time.perf_counter()
    for _ in range(opts.batches):
        t0 = time.perf_counter()
        jax.block_until_ready(ld.next())
        times.append(time.perf_counter() - t0)
        rss.append(rss_bytes())
    wall = time.perf_counter() - t_all
    ld.close()
    return {"packing": packing, "batches": opts.batches, "batch": f"{opts.batch} x {opts.seq_len}",
            "tokens_per_s": opts.batch * opts.seq_len * opts.batches / wall,
            "first_batch_ms": 1e3 * first, "median_batch_ms": 1e3 * float(np.median(times)),
            "max_batch_ms": 1e3 * float(np.max(times)),
            "rss_mb_before": rss0 / 2**20, "rss_mb_after_build": rss_built / 2**20,
            "rss_mb_first_batch": rss[0] / 2**20, "rss_mb_last_batch": rss[-1] / 2**20}


def _rss_of(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def train_memory(folder: Path, steps: int, tokens: int) -> dict:
    """Train the tiny preset `steps` steps on `folder` in a subprocess; its RSS over time."""
    with tempfile.TemporaryDirectory() as tmp:
        argv = [sys.executable, "-m", "dropless.cli", "train", f"data={folder}",
                f"steps={steps}", f"eval_every={steps}", "checkpoint_every=0",
                "time_kernels=false", f"run_dir={tmp}", "run_name=mem"]
        t0 = time.time()
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True, env=dict(os.environ))
        samples = []
        while proc.poll() is None:
            samples.append((time.time(), _rss_of(proc.pid)))
            time.sleep(0.2)
        err = proc.stderr.read()
        if proc.returncode:
            raise RuntimeError(f"dropless train exited {proc.returncode}: {err[-2000:]}")
        recs = [json.loads(x) for x in (Path(tmp) / "mem" / "metrics.jsonl").read_text()
                .splitlines()]
    steps_ = [r for r in recs if r["event"] == "step"]
    # the steps' span: the last sample is at exit; the steps ran in the sum of their times
    end = samples[-1][0]
    span = sum(r["step_time_s"] for r in steps_)
    during = [r for t, r in samples if end - span - 1.0 <= t <= end and r]
    half = max(1, len(during) // 2)
    return {"memory_steps": steps, "train_wall_s": end - t0,
            "train_rss_mb_peak": max(r for _, r in samples) / 2**20,
            "train_rss_mb_steps_first_half": float(np.median(during[:half])) / 2**20,
            "train_rss_mb_steps_second_half": float(np.median(during[half:] or during)) / 2**20,
            "dataset_as_int32_mb": tokens * 4 / 2**20,
            "median_input_wait_s": float(np.median([r["input_wait_s"] for r in steps_])),
            "median_step_time_s": float(np.median([r["step_time_s"] for r in steps_]))}


def run(opts: DataOptions) -> int:
    """Write (or reuse) the dataset, measure each packing, print a table, append JSON lines."""
    opts, info, busy = harness.start(opts)
    from dropless.data import corpus as corpus_lib
    t0 = time.perf_counter()
    folder = write_random_prepared(Path(opts.dir), tokens=opts.tokens, doc_len=opts.doc_len,
                                   shard_tokens=opts.shard_tokens)
    prep_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    c = corpus_lib.load_corpus(str(folder), vocab_size=256, seq_len=opts.seq_len)
    open_s = time.perf_counter() - t0
    want = consumption(opts.mfu, opts.seq_len)
    rows = []
    for packing in opts.packings.split(","):
        r = measure(c, packing, opts)
        if want["tiny_here"]:
            r["x_tiny_consumption"] = r["tokens_per_s"] / want["tiny_here"]["tokens_per_s"]
        r["x_h200_deepseek3_test"] = (r["tokens_per_s"]
                                      / want["h200_deepseek3_test"]["tokens_per_s"])
        rows.append(r)
    print(f"dataset: {folder} ({c.train_TOK.size:,} train tokens, "
          f"{c.train_TOK.size * 2 / 2**30:.2f} GiB on disk; written/reused in {prep_s:.1f} s, "
          f"opened (hashes checked) in {open_s:.1f} s)")
    print(text_table.format_table(rows, ["packing", "batch", "tokens_per_s", "first_batch_ms",
                                         "median_batch_ms",
                                         "max_batch_ms", "x_tiny_consumption",
                                         "x_h200_deepseek3_test", "rss_mb_first_batch",
                                         "rss_mb_last_batch"]))
    h = want["h200_deepseek3_test"]
    print(f"consumption: tiny here {want['tiny_here'] and want['tiny_here']['tokens_per_s']:.0f}"
          f" tok/s; one H200 on deepseek3-test at MFU {h['mfu']}: {h['tokens_per_s']:.3g} tok/s "
          f"({h['flops_per_token'] / 1e6:.2f} MFLOPs/token)")
    if opts.memory_steps:
        mem = train_memory(folder, opts.memory_steps, int(c.train_TOK.size))
        print("training tiny on it: " + ", ".join(f"{k} {v:.3g}" for k, v in mem.items()))
        rows.append({"packing": "documents", "part": "train_memory", **mem})
    harness.write_jsonl(opts.out, [{"bench": "data", **info, "busy_fraction": busy,
                                    "train_tokens": int(c.train_TOK.size),
                                    "open_s": open_s, "consumption": want, **r} for r in rows])
    return 0
