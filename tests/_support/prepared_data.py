"""A small prepared dataset written by hand (the layout `dropless data prepare` writes, through
data.manifest's own writer), for the reader's and the loader's tests."""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from dropless.data import manifest as manifest_lib


def write_prepared(out: Path, split_docs: dict[str, list[list[np.ndarray]]], *,
                   vocab_size: int = 256, dtype: str = "uint16", eos_id: int | None = 0
                   ) -> manifest_lib.Manifest:
    """Write `out`: per split a list of shards, each a list of documents (token arrays, their
    EOS included). Returns the manifest written."""
    out.mkdir(parents=True, exist_ok=True)
    splits = {}
    for split in manifest_lib.SPLITS:
        shards = []
        for k, docs in enumerate(split_docs.get(split, [])):
            toks = np.concatenate(docs).astype(np.dtype(dtype).newbyteorder("<"))
            ends = np.cumsum([d.size for d in docs]).astype("<u8")
            tname, dname = f"{split}-{k:05d}.tokens", f"{split}-{k:05d}.docs"
            (out / tname).write_bytes(toks.tobytes())
            (out / dname).write_bytes(ends.tobytes())
            shards.append(manifest_lib.Shard(
                tokens_file=tname, docs_file=dname, tokens=int(toks.size), documents=len(docs),
                sha256=hashlib.sha256(toks.tobytes()).hexdigest(),
                docs_sha256=hashlib.sha256(ends.tobytes()).hexdigest()))
        splits[split] = tuple(shards)
    total = sum(sh.tokens for s in splits.values() for sh in s)
    m = manifest_lib.Manifest(
        tokenizer=manifest_lib.TokenizerId(kind="byte", source="byte", sha256=None),
        vocab_size=vocab_size, dtype=dtype, bos_id=None, eos_id=eos_id, add_bos=False,
        add_eos=eos_id is not None, eval_fraction=0.1, splits=splits,
        sources=(manifest_lib.Source(path="hand.jsonl", bytes=total, sha256="0" * 64,
                                     weight=1.0, documents=sum(len(d) for s in split_docs.values()
                                                               for d in s), tokens=total),),
        created_by="tests")
    manifest_lib.write_manifest(out, m)
    return m


def random_docs(rng: np.random.Generator, n: int, *, lo: int = 1, hi: int = 40,
                vocab: int = 250, eos: int = 0) -> list[np.ndarray]:
    """n documents of random length in [lo, hi), each ending with `eos`."""
    return [np.append(rng.integers(1, vocab, int(rng.integers(lo, hi))), eos) for _ in range(n)]
