"""Checkpoints with orbax: periodic, asynchronous, keep-N, atomic.

A checkpoint holds the whole train state (parameters including router biases, optimizer state,
step, RNG) and a JSON record with the data position (the next batch index) and the corpus
fingerprint. Orbax writes each step into a temporary directory and renames it when complete, so
a run killed during a save leaves only an unfinished temporary directory, which restore ignores:
the run resumes from the last complete step.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp


def manager(directory: str | Path, *, keep: int, async_save: bool = True
            ) -> ocp.CheckpointManager:
    """A CheckpointManager keeping the newest `keep` complete steps under `directory`."""
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                           enable_async_checkpointing=async_save)
    return ocp.CheckpointManager(Path(directory).absolute(), options=options)


def save(mngr: ocp.CheckpointManager, step: int, state: Any, meta: dict) -> None:
    """Start saving (returns before the write finishes when asynchronous)."""
    mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                            meta=ocp.args.JsonSave(meta)), force=True)


def latest_step(mngr: ocp.CheckpointManager) -> int | None:
    """The newest complete step, or None."""
    return mngr.latest_step()


def restore(mngr: ocp.CheckpointManager, step: int, like: Any) -> tuple[Any, dict]:
    """(state, meta) of `step`; `like` is a state (or its jax.eval_shape) giving structure,
    dtypes and shardings. A state stored with the other decoder-layer layout (scan_layers on vs
    off) is restored as stored and converted to `like`'s (dropless.models.scan)."""
    from dropless.models import scan
    try:
        stored = scan.is_scanned(getattr(mngr.item_metadata(step)["state"], "tree", None))
    except (KeyError, TypeError, ValueError, FileNotFoundError):   # no readable tree metadata
        stored = None
    mine = scan.is_scanned(like)
    if None not in (stored, mine) and stored != mine:
        state, meta = restore(mngr, step, jax.eval_shape(lambda t: scan.to_layout(t, stored), like))
        state = jax.tree.map(lambda x, ref: jax.device_put(x, getattr(ref, "sharding", None)),
                             scan.to_layout(state, mine), like)
        return state, meta
    abstract = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        like)
    out = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                     meta=ocp.args.JsonRestore()))
    return out["state"], dict(out["meta"])
