"""Checkpoint integrity: a content hash of every array a step holds, checked when it is restored,
and the structural checks that find a damaged step before any of its data is read.

A step directory written by `checkpoint.save` looks like this (orbax, one process):

    <step>/_CHECKPOINT_METADATA            JSON, orbax's record of the step
    <step>/meta/metadata                   JSON: the data position (train/resume.position),
                                           corpus, and `hashes`
    <step>/state/_METADATA                 JSON: the tree of arrays
    <step>/state/manifest.ocdbt            the root of the array store
    <step>/state/ocdbt.process_<i>/manifest.ocdbt, .../d/<chunk>   the array bytes

`hashes` maps each array's path ('params/layers/1/moe/w_up_EDF') to its xxh3-64 hash over the
array's bytes in C order, computed from the arrays being saved (so it covers what was meant to
be written, not what reached the disk). The array store keeps no checksum of its own: bits
flipped in a chunk file load silently unless the hash is compared.

`inspect` finds what can be seen without reading arrays (an empty step folder, a missing or
unparsable JSON file, a missing `state/`, a missing manifest, an empty chunk file);
`verify` compares restored arrays with the recorded hashes; `quarantine` moves a damaged step
to checkpoints/damaged/<step>-<reason>, out of orbax's sight, and never deletes it.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
import xxhash

ALGORITHM = "xxh3_64"
DAMAGED = "damaged"             # checkpoints/damaged/<step>-<reason>: steps moved aside


@dataclasses.dataclass(frozen=True)
class Damage:
    """Why checkpoint `step` cannot be used. `reason`: a short slug for the folder name
    (`hash-mismatch`); `detail`: the words for the one-line message (names the file)."""
    step: int
    reason: str
    detail: str

    def text(self) -> str:
        return f"checkpoint {self.step} is damaged: {self.detail}"


class CheckpointDamaged(Exception):
    """Restoring a step failed because its files are damaged (`damage` says which and why)."""

    def __init__(self, damage: Damage):
        super().__init__(damage.text())
        self.damage = damage


def path_str(path) -> str:
    """'params/layers/1/moe/w_up_EDF' for a tree path (dict keys, sequence indices and
    namedtuple fields all become plain names, as orbax's metadata tree spells them)."""
    def name(k):
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                return str(getattr(k, attr))
        return str(k)
    return "/".join(name(k) for k in path)


def array_hash(x) -> str:
    """The xxh3-64 hash (16 hex digits) of an array's bytes in C order; shape and dtype are
    checked by orbax's metadata, not by this hash."""
    a = np.ascontiguousarray(np.asarray(x))
    return xxhash.xxh3_64_hexdigest(a.reshape(-1).view(np.uint8))


def tree_hashes(tree: Any) -> dict[str, str]:
    """{path: hash} of every array leaf of `tree`; arrays this process cannot see whole
    (sharded over several hosts) are left out (each host would hash only its part)."""
    out = {}
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        if x is None or not getattr(x, "is_fully_addressable", True):
            continue
        out[path_str(path)] = array_hash(x)
    return out


def mismatches(tree: Any, expected: dict[str, str] | None) -> list[str]:
    """The paths of `tree`'s arrays whose hash differs from `expected` (sorted; [] when
    `expected` is None or empty: written before hashes were recorded)."""
    if not expected:
        return []
    got = tree_hashes(tree)
    return sorted(k for k, h in expected.items() if k in got and got[k] != h)


def mismatch_words(bad: list[str]) -> str:
    """The words for arrays `bad` (from `mismatches`) failing their hashes."""
    more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
    return (f"the bytes of {bad[0]}{more} differ from the {ALGORITHM} hash recorded when it "
            "was saved (the data files changed on disk)")


def verify(tree: Any, expected: dict[str, str] | None, step: int) -> None:
    """Raise CheckpointDamaged when an array of restored `tree` does not match the hash recorded
    at save time (`expected`; None for a checkpoint written before hashes were recorded)."""
    bad = mismatches(tree, expected)
    if bad:
        raise CheckpointDamaged(Damage(step, "hash-mismatch", mismatch_words(bad)))


def _json_problem(path: Path) -> str | None:
    if not path.is_file():
        return "is missing"
    try:
        json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError, OSError) as e:
        return f"is not readable JSON ({type(e).__name__})"
    return None


def _object(path: Path) -> dict:
    """The JSON object in `path` ({} when it is another JSON value; read after _json_problem)."""
    data = json.loads(path.read_bytes())
    return data if isinstance(data, dict) else {}


def meta_problem(meta: Any) -> str | None:
    """What is wrong with a step's JSON record (`meta/metadata`), None when it is one the
    trainer wrote: an object with an int `next_batch` >= 0, a `corpus` object and, when present,
    an int `next_sample` >= 0, an int `global_batch_size` >= 1, a `data_order` object and
    `hashes` mapping paths to hex strings."""
    if not isinstance(meta, dict) or not meta:
        return f"is not a JSON object with next_batch and corpus (it holds {type(meta).__name__})"
    nb = meta.get("next_batch")
    if "next_batch" not in meta or "corpus" not in meta:
        return "lacks next_batch/corpus"
    if type(nb) is not int or nb < 0:
        return f"has next_batch={str(nb)[:40]!r}, not an int >= 0"
    if not isinstance(meta["corpus"], dict):
        return f"has a corpus entry that is a {type(meta['corpus']).__name__}, not an object"
    for key, least in (("next_sample", 0), ("global_batch_size", 1)):
        v = meta.get(key, least)
        if type(v) is not int or v < least:
            return f"has {key}={str(v)[:40]!r}, not an int >= {least}"
    if not isinstance(meta.get("data_order", {}), dict):
        return (f"has a data_order entry that is a {type(meta['data_order']).__name__}, "
                "not an object")
    hashes = meta.get("hashes")
    if hashes is not None and not (isinstance(hashes, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in hashes.items())):
        return "has a hashes entry that is not an object of strings"
    return None


def inspect(directory: str | Path, step: int) -> Damage | None:
    """The structural damage of step folder directory/<step> (None when nothing is seen): read
    without touching any array, so it is cheap enough to run on every step at every resume.
    Malformed content counts as damage: a JSON file that does not parse, or parses to the wrong
    shape (an empty or list-shaped `_CHECKPOINT_METADATA` or `state/_METADATA`, a record whose
    next_batch is not an int or whose corpus is not an object)."""
    d = Path(directory) / str(step)
    rel = lambda p: str(p.relative_to(d.parent.parent))  # noqa: E731 - checkpoints/4/...
    if not d.is_dir() or not any(d.iterdir()):
        return Damage(step, "empty", f"its folder {d} is empty")
    for name, slug in (("_CHECKPOINT_METADATA", "bad-checkpoint-metadata"),
                       ("meta/metadata", "bad-meta")):
        problem = _json_problem(d / name)
        if problem:
            return Damage(step, slug, f"{rel(d / name)} {problem}")
    if not _object(d / "_CHECKPOINT_METADATA"):
        return Damage(step, "bad-checkpoint-metadata", f"{rel(d / '_CHECKPOINT_METADATA')} is "
                      "not a non-empty JSON object")
    problem = meta_problem(json.loads((d / "meta" / "metadata").read_bytes()))
    if problem:
        return Damage(step, "bad-meta", f"{rel(d / 'meta' / 'metadata')} {problem}")
    state = d / "state"
    if not state.is_dir():
        return Damage(step, "no-state", f"{rel(state)}/ is missing")
    problem = _json_problem(state / "_METADATA")
    if problem is None and not isinstance(_object(state / "_METADATA").get("tree_metadata"),
                                          dict):
        problem = "is not a JSON object with a tree_metadata object"
    if problem:
        return Damage(step, "bad-state-metadata", f"{rel(state / '_METADATA')} {problem}")
    manifests = [state / "manifest.ocdbt"] + [p / "manifest.ocdbt"
                                              for p in sorted(state.glob("ocdbt.process_*"))]
    for m in manifests:
        if not m.is_file() or m.stat().st_size == 0:
            return Damage(step, "no-manifest", f"{rel(m)} is "
                          f"{'missing' if not m.is_file() else 'empty'}")
    for chunk in sorted(state.glob("**/d/*")):
        if not chunk.is_file():
            return Damage(step, "unreadable", f"data file {rel(chunk)} is not a file")
        if chunk.stat().st_size == 0:
            return Damage(step, "truncated", f"data file {rel(chunk)} is empty")
    return None


def _chain_text(exc: BaseException) -> str:
    out, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        out.append(f"{type(exc).__name__}: {exc}")
        exc = exc.__cause__ or exc.__context__
    return "\n".join(out)


def read_failure(exc: BaseException, step: int, directory: Path) -> Damage:
    """A Damage for an exception orbax/tensorstore raised while reading step `step`: their
    messages run to thousands of characters; the array, the file and the kind of failure are
    kept (`Truncated Zstd-compressed stream`, `NOT_FOUND`)."""
    import re
    text = _chain_text(exc)
    array = re.search(r'Error reading "([^"/]+)', text) or re.search(r"'path': '([^'/]+)/'", text)
    what = f"the array {array.group(1).replace('.', '/')}" if array else "an array"
    why = re.search(r'in OCDBT database at [^:]*: ([^;\n]{3,120})', text) or \
        re.search(r"(NOT_FOUND|DATA_LOSS|FAILED_PRECONDITION|PERMISSION_DENIED)[^\n]{0,80}", text)
    cause = why.group(1 if why.re.groups else 0).strip() if why else text.splitlines()[0][:120]
    slug = "missing-data" if "NOT_FOUND" in text or "No such file" in text else "unreadable"
    return Damage(step, slug, f"{what} in {directory / str(step)}/state cannot be read "
                              f"({cause}): a data file is missing, truncated or corrupt")


def quarantine(directory: str | Path, damage: Damage) -> Path:
    """Move step folder directory/<step> to directory/damaged/<step>-<reason> (a `-2`, `-3`, ...
    suffix when that name is taken); returns the new path. Nothing is deleted."""
    d = Path(directory)
    (d / DAMAGED).mkdir(exist_ok=True)
    base = d / DAMAGED / f"{damage.step}-{damage.reason}"
    dest, n = base, 1
    while dest.exists():
        n += 1
        dest = base.with_name(f"{base.name}-{n}")
    (d / str(damage.step)).rename(dest)
    return dest
