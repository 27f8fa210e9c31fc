"""`dropless bench prepare`: `data prepare`'s tokens/s per worker against the tokenizer's own
batch encoder on the same text, its scaling with workers, and its peak memory.

The corpus is written by `write_corpus`: documents cut from the Python standard library's
source files (real text on every machine), half as JSONL.zst, half as Parquet. The tokenizer is
a byte-level BPE trained here on the same kind of text (`train_bpe`, `tokenizers`' trainer), or
any tokenizer.json given. The baseline is `Tokenizer.encode_batch_fast` over the corpus's texts,
held in memory, in this process with one thread (TOKENIZERS_PARALLELISM=false, as each prepare
worker runs); it is timed before and after the prepare runs and the faster kept (the ratio is
then a conservative one). Each prepare run writes a fresh output folder; its rate is given over
the whole wall time (worker start-up included) and "steady" (from its first results on).
Peak memory: the largest resident total of this process and its workers during each run
(sampled every 0.2 s from /proc), beside this process's own before it (the texts of the
baseline are freed by then).
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

from dropless.data.corpus import stdlib_files

FILE_BYTES = 128 << 20     # text per corpus file


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrepareOptions:
    """corpus_mb: text to write (ignored with `corpus`); workers: the counts to run."""
    corpus_mb: int = 64
    corpus: str = ""
    tokenizer: str = ""
    vocab: int = 32000
    workers: tuple[int, ...] = (1, 2)
    quick: bool = False
    out: str | None = None

    def quick_sized(self) -> "PrepareOptions":
        return dataclasses.replace(self, corpus_mb=4, vocab=2000, workers=(1,), quick=False)


def _stdlib_text(limit: int) -> list[str]:
    texts, size = [], 0
    for p in stdlib_files():
        t = p.read_text(encoding="utf-8", errors="replace")
        texts.append(t)
        size += len(t)
        if size >= limit:
            break
    return texts


def _documents(seed: int):
    """An endless stream of documents: slices of 200..20,000 characters of stdlib files."""
    rng = random.Random(seed)
    pool = _stdlib_text(64 << 20)
    while True:
        t = pool[rng.randrange(len(pool))]
        n = min(len(t), int(rng.lognormvariate(7.5, 1.0)) + 200, 20_000)
        start = rng.randrange(max(1, len(t) - n))
        yield t[start: start + n]


def write_corpus(folder: str | Path, total_bytes: int, *, seed: int = 0) -> list[Path]:
    """Mixed JSONL.zst and Parquet files of ~total_bytes of text under `folder`, alternating
    (file i: JSONL.zst when i is even), FILE_BYTES each; returns their paths."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    docs, paths, written, i = _documents(seed), [], 0, 0
    while written < total_bytes:
        want = min(FILE_BYTES, total_bytes - written)
        if i % 2 == 0:
            path = folder / f"part-{i:03d}.jsonl.zst"
            with open(path, "wb") as raw, zstandard.ZstdCompressor(level=3).stream_writer(
                    raw) as z:
                n = 0
                while n < want:
                    d = next(docs)
                    z.write((json.dumps({"id": f"{i}-{n}", "text": d}) + "\n").encode())
                    n += len(d)
        else:
            path = folder / f"part-{i:03d}.parquet"
            writer, n = None, 0
            while n < want:
                batch = []
                while n < want and len(batch) < 4096:
                    batch.append(next(docs))
                    n += len(batch[-1])
                table = pa.table({"text": batch, "id": [f"{i}-{k}" for k in range(len(batch))]})
                writer = writer or pq.ParquetWriter(path, table.schema)
                writer.write_table(table)
            writer.close()
        paths.append(path)
        written += want
        i += 1
    return paths


def train_bpe(folder: str | Path, *, vocab: int, sample_bytes: int = 16 << 20) -> Path:
    """A GPT-2-style byte-level BPE of `vocab` tokens trained on stdlib text, saved as
    folder/tokenizer.json + tokenizer_config.json (EOS <|endoftext|>); returns tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_stdlib_text(sample_bytes), trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return folder / "tokenizer.json"


def _corpus_texts(paths) -> list[str]:
    from dropless.data import readers
    return [t for p in paths for f in readers.input_files(str(p))
            for c in readers.text_chunks(f, "text") for t in readers.chunk_texts(f, c, "text")]


def _baseline(tokenizer: str, texts: list[str]) -> dict:
    from dropless.data.tokenizer import tokenizer_file
    tok = tokenizer_file(tokenizer)
    t0 = time.perf_counter()
    n = 0
    for lo in range(0, len(texts), 1024):
        n += sum(len(e.ids) for e in tok.encode_batch_fast(texts[lo: lo + 1024],
                                                           add_special_tokens=False))
    dt = time.perf_counter() - t0
    return {"tokens": n, "seconds": dt, "tokens_per_s": n / dt}


def _tree_rss_mb(root: int) -> float:
    """Resident MB of process `root` and all its descendants now (Linux /proc)."""
    parent, rss = {}, {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            status = (d / "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        parent[int(d.name)] = int(fields.get("PPid", "0"))
        rss[int(d.name)] = int(fields.get("VmRSS", "0 kB").split()[0]) / 1024
    tree, grew = {root}, True
    while grew:
        more = {p for p, pp in parent.items() if pp in tree} - tree
        grew, tree = bool(more), tree | more
    return sum(rss.get(p, 0.0) for p in tree)


class _PeakMemory:
    """The largest resident total of this process and its workers, sampled every 0.2 s."""

    def __enter__(self):
        import threading
        self.peak, self.stop = 0.0, threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while not self.stop.wait(0.2):
            self.peak = max(self.peak, _tree_rss_mb(os.getpid()))

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def _prepare_once(corpus: list[Path], tokenizer: str, workers: int, out: Path) -> dict:
    from dropless.data.prepare import PrepareConfig, prepare
    shutil.rmtree(out, ignore_errors=True)
    first: list = []     # (time, tokens written) when the first results came back

    def seen(p) -> None:
        if not first and p.tokens:
            first.append((time.perf_counter(), p.tokens))
    before = _tree_rss_mb(os.getpid())
    t0 = time.perf_counter()
    with _PeakMemory() as mem:
        m = prepare(PrepareConfig(sources=tuple(map(str, corpus)), out=str(out),
                                  tokenizer=tokenizer, workers=workers, eval_fraction=0.02),
                    created_by="bench", on_progress=seen)
    dt = time.perf_counter() - t0
    written = sum(m.num_tokens.values())
    tokens = written - sum(m.num_documents.values())   # less the EOS
    t1, n1 = first[0] if first else (t0, 0)
    steady = (written - n1) / max(t0 + dt - t1, 1e-9)   # after start-up, with EOS
    return {"workers": workers, "tokens": tokens, "seconds": dt, "tokens_per_s": tokens / dt,
            "startup_s": t1 - t0, "steady_tokens_per_s": steady,
            "per_worker_tokens_per_s": tokens / dt / max(workers, 1),
            "per_worker_steady_tokens_per_s": steady / max(workers, 1),
            "rss_mb_before": round(before), "peak_rss_mb_all_processes": round(mem.peak)}


def run(opts: PrepareOptions) -> int:
    """Time the baseline and `prepare` at each worker count; print and append JSON lines."""
    from dropless.bench.harness import start, write_jsonl
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    opts, info, busy = start(opts)
    with tempfile.TemporaryDirectory(prefix="bench-prepare-") as tmp:
        tmp = Path(tmp)
        tokenizer = opts.tokenizer or str(train_bpe(tmp / "tok", vocab=opts.vocab))
        corpus = ([Path(opts.corpus)] if opts.corpus
                  else write_corpus(tmp / "corpus", opts.corpus_mb << 20))
        texts = _corpus_texts(corpus)
        text_bytes = sum(len(t.encode("utf-8")) for t in texts)
        base = [_baseline(tokenizer, texts)]
        del texts
        runs = [_prepare_once(corpus, tokenizer, w, tmp / "out") for w in opts.workers]
        texts = _corpus_texts(corpus)
        base.append(_baseline(tokenizer, texts))
        del texts
    base_rate = max(b["tokens_per_s"] for b in base)   # the faster: a conservative ratio
    records = []
    for r in runs:
        rec = {"bench": "prepare", **info, "busy_before": busy,
               "machine_shared": True, "text_bytes": text_bytes,
               "tokenizer": "byte" if tokenizer == "byte" else Path(tokenizer).name,
               "vocab": opts.vocab if not opts.tokenizer else None,
               "baseline_tokens_per_s": [round(b["tokens_per_s"]) for b in base],
               "baseline_tokens_per_s_best": round(base_rate), **{
                   k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()},
               "per_worker_vs_baseline": round(r["per_worker_tokens_per_s"] / base_rate, 3),
               "per_worker_steady_vs_baseline": round(
                   r["per_worker_steady_tokens_per_s"] / base_rate, 3)}
        records.append(rec)
        print(json.dumps(rec), flush=True)
    write_jsonl(opts.out, records)
    return 0
