"""The on-disk format of a training step, with orbax: write, read (the whole state, or the
parameters alone), the step folders present, and the conversion between parameter layouts.

A checkpoint holds the whole train state (parameters including router biases, optimizer state,
step, RNG) and a JSON record with the data position (the next batch index) and the corpus
fingerprint. Orbax writes each step into a temporary directory and renames it when complete, so
a run killed during a save leaves only an unfinished temporary directory, which restore ignores:
the run resumes from the last complete step. Every array's content hash is stored with the step
and compared when it is read (`checkpoint.integrity`): a step damaged later raises
integrity.CheckpointDamaged naming the step, the file or array and why, never returning damaged
data. `check_compatible` compares a checkpoint's stored shapes and dtypes with the state the
config builds before anything is restored, and names the parameter path and the config keys
that differ.
"""
from __future__ import annotations

import json
import weakref
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp

from dropless.checkpoint import integrity, noise

PARAMS = "params"          # the state's subtree `read_params` reads


class DoesNotFit(ValueError):
    """Stored arrays whose shapes or dtypes differ from the ones asked for: the files are
    intact but hold another model than the config describes (a config.json edited, a step
    copied in from another run). Not damage: nothing is moved aside."""


def manager(directory: str | Path, *, keep: int, async_save: bool = True
            ) -> ocp.CheckpointManager:
    """A CheckpointManager for the steps under `directory`. Orbax itself removes no step:
    `keep` (the newest `keep` steps stay) is applied by `checkpoint.Saver` through
    `reader.rotate`, which leaves a step a reader holds in place (`keep_of(mngr)` gives it)."""
    options = ocp.CheckpointManagerOptions(max_to_keep=None, create=True,
                                           enable_async_checkpointing=async_save,
                                           step_name_format=_OrbaxReadableSteps())
    mngr = ocp.CheckpointManager(
        Path(directory).absolute(), options=options,
        item_handlers={"state": ocp.StandardCheckpointHandler(),
                       "meta": ocp.JsonCheckpointHandler()})
    _KEEP[mngr] = keep
    return mngr


class _OrbaxReadableSteps:
    """Orbax's standard step names (`<step>`), listing only the steps whose
    `_CHECKPOINT_METADATA` orbax can take (a JSON object, or none): a manager reads that file of
    every step when it opens, and one holding a list (or not JSON) stops it there. The one
    reader (`checkpoint.reader`) finds such a step as damage and moves it aside."""

    def __init__(self):
        self._inner = ocp.path.step.standard_name_format()

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def find_all(self, base_path):
        return (m for m in self._inner.find_all(base_path)
                if _orbax_can_open(Path(str(m.path)) / "_CHECKPOINT_METADATA"))


def _orbax_can_open(path: Path) -> bool:
    if not path.exists():
        return True
    try:
        return isinstance(json.loads(path.read_bytes()), dict)
    except (OSError, ValueError, UnicodeDecodeError):
        return False


_KEEP: "weakref.WeakKeyDictionary[ocp.CheckpointManager, int]" = weakref.WeakKeyDictionary()


def keep_of(mngr: ocp.CheckpointManager) -> int | None:
    """The `keep` a manager was made with (`manager`), None for one made elsewhere."""
    return _KEEP.get(mngr)


def save(mngr: ocp.CheckpointManager, step: int, state: Any, meta: dict, *,
         hashes: bool = True) -> None:
    """Start saving (returns before the write finishes when asynchronous). `meta` is stored
    with the content hash of every array of `state` (integrity.py; `hashes=False` only for the
    cost measurement), which `restore` and `read_params` check."""
    if hashes:
        meta = {**meta, "hash": integrity.ALGORITHM, "hashes": integrity.tree_hashes(state)}
    mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                            meta=ocp.args.JsonSave(meta)), force=True)


def all_steps(directory: str | Path) -> list[int]:
    """Every step folder under `directory`, newest first (complete or not: orbax renames a step
    into place only when complete, so a numbered folder that is incomplete was damaged later);
    reads names only, creates nothing."""
    d = Path(directory)
    if not d.is_dir():
        return []
    return sorted((int(p.name) for p in d.iterdir() if p.name.isdigit() and p.is_dir()),
                  reverse=True)


def latest_step(directory: str | Path) -> int | None:
    """The newest step folder under `directory` (None when there is none or no directory)."""
    steps = all_steps(directory)
    return steps[0] if steps else None


def read_meta(directory: str | Path, step: int) -> dict:
    """The JSON record saved with `step` (data position, corpus fingerprint), read directly."""
    return json.loads((Path(directory) / str(step) / "meta" / "metadata").read_text())


def _saved_tree(mngr: ocp.CheckpointManager, step: int) -> Any:
    """The stored state's tree metadata (its dict keys tell the expert layout)."""
    md = mngr.item_metadata(step)["state"]
    return getattr(md, "tree", md)


def _state_tree(state_dir: Path) -> Any:
    """The tree metadata of the state stored in `state_dir` (<step>/state), read without a
    manager."""
    md = ocp.PyTreeCheckpointHandler().metadata(state_dir)
    return getattr(md, "tree", md)


def restore(mngr: ocp.CheckpointManager, step: int, like: Any, *, verify: bool = True
            ) -> tuple[Any, dict]:
    """(state, meta) of `step`; `like` is a state (or its jax.eval_shape) giving structure,
    dtypes and shardings. A checkpoint written in another parameter layout (decoder layers
    scanned or not, `scan_layers`; expert gate/up fused or not, `prefuse_moe_weights`) is read
    as stored and converted to `like`'s layout (both conversions are exact). Raises
    integrity.CheckpointDamaged when a file cannot be read or an array's bytes differ from the
    hash recorded at save time (`verify=False` skips the hashes, for the cost measurement)."""
    def read(abstract):
        out = mngr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        return out["state"], dict(out["meta"])
    return _read_step(Path(mngr.directory), step, like, read, lambda: _saved_tree(mngr, step),
                      verify=verify)


def read_params(directory: str | Path, step: int, like: Any, *, verify: bool = True) -> Any:
    """The parameters of checkpoint `step` under `directory`, alone: only the `params` subtree
    of the stored state is read (orbax's partial restore), so no optimizer state is built or
    read. `like` is a parameter tree (or its jax.eval_shape, e.g. of `init_params`) giving
    structure, dtypes and shardings (a leaf without one is placed as it was saved). As
    `restore`: another stored layout is converted to `like`'s, and damage (structure, files,
    the hashes of the arrays read) raises integrity.CheckpointDamaged."""
    directory = Path(directory).absolute()
    state_dir = directory / str(step) / "state"

    def stored() -> dict:
        return {integrity.path_str(p): m for p, m in
                jax.tree_util.tree_leaves_with_path(_state_tree(state_dir))}

    def fits(abstract):
        problems = fit_problems({k: m for k, m in stored().items()
                                 if k.startswith(f"{PARAMS}/")}, abstract,
                                wants="asked for", model="asked for")
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise DoesNotFit(f"checkpoint {step} in {directory} holds another model: "
                             f"{problems[0]}{more}")

    def read(abstract):
        have = stored()
        restore_args = jax.tree_util.tree_map_with_path(
            lambda p, x: _restore_arg(x, have.get(integrity.path_str(p))), abstract)
        with ocp.PyTreeCheckpointer() as ckptr:
            state = ckptr.restore(state_dir, args=ocp.args.PyTreeRestore(
                item=abstract, restore_args=restore_args, partial_restore=True))
        return state, read_meta(directory, step)
    state, _ = _read_step(directory, step, {PARAMS: like}, read, lambda: _state_tree(state_dir),
                          verify=verify, fits=fits)
    return state[PARAMS]


def read_saved_tree(path: str | Path, like: Any, *,
                    check: Callable[[Any], None] | None = None) -> Any:
    """The tree orbax's StandardCheckpointer saved at `path` (a `dropless convert` output's
    params/), read as `like` (a tree or its jax.eval_shape: structure, dtypes, shardings). Saved
    in the other parameter layout (`scan_layers`, `prefuse_moe_weights`) it is converted, as
    `restore` converts a step; `check(tree)` (its hashes) runs on the tree as stored, before
    that. Raises DoesNotFit, with nothing read, when the stored arrays differ from `like`'s in
    shape or dtype; orbax's own errors for files it cannot read."""
    path = Path(path).absolute()
    to_stored, to_mine = _layout_conversions(lambda: _state_tree(path), like)
    abstract = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        jax.eval_shape(to_stored, like) if to_stored else like)
    stored = {integrity.path_str(p): m for p, m in
              jax.tree_util.tree_leaves_with_path(_state_tree(path))}
    problems = fit_problems(stored, abstract, wants="asked for", model="asked for")
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise DoesNotFit(f"{path} holds another model: {problems[0]}{more}")
    tree = ocp.StandardCheckpointer().restore(path, abstract)
    if check is not None:
        check(tree)
    if to_mine:
        tree = jax.tree.map(lambda x, ref: jax.device_put(x, getattr(ref, "sharding", None)),
                            to_mine(tree), like)
    return tree


def fit_problems(stored: dict, wanted: Any, *, wants: str = "with this config",
                 model: str = "in this model") -> list[str]:
    """What keeps `stored` ({path: orbax array metadata}) from being read as `wanted` (a tree
    of arrays or ShapeDtypeStructs, in the stored layout): one phrase per array whose shape or
    dtype differs ('... in the checkpoint, (2, 4) float32 {wants}'), is missing, or is stored
    but not wanted ('... but not {model}'), parameters first; [] when it fits."""
    want = {integrity.path_str(p): x for p, x in jax.tree_util.tree_leaves_with_path(wanted)}
    problems = []
    for name in sorted(want, key=lambda n: (not n.startswith(f"{PARAMS}/"), n)):
        x, m = want[name], stored.get(name)
        if m is None:
            problems.append(f"{name} is not in the checkpoint")
        elif tuple(m.shape) != tuple(x.shape) or jax.numpy.dtype(m.dtype) != x.dtype:
            problems.append(f"{name} is {tuple(m.shape)} {jax.numpy.dtype(m.dtype)} in the "
                            f"checkpoint, {tuple(x.shape)} {jax.numpy.dtype(x.dtype)} {wants}")
    return problems + [f"{n} is in the checkpoint but not {model}" for n in stored
                       if n not in want]


def _restore_arg(x: jax.ShapeDtypeStruct, stored: Any) -> ocp.RestoreArgs:
    """How orbax reads leaf `x`: with `x`'s sharding, else the one it was saved with (as a
    full restore does), else as a NumPy array."""
    sharding = getattr(x, "sharding", None)
    if sharding is None and getattr(stored, "sharding", None) is not None:
        try:
            sharding = stored.sharding.to_jax_sharding()
        except ValueError:       # saved on devices this process does not have
            sharding = None
    if sharding is None:
        return ocp.RestoreArgs(restore_type=np.ndarray, dtype=x.dtype)
    return ocp.ArrayRestoreArgs(sharding=sharding, global_shape=x.shape, dtype=x.dtype)


def _read_step(directory: Path, step: int, like: Any,
               read: Callable[[Any], tuple[Any, dict]], stored_tree: Callable[[], Any], *,
               verify: bool, fits: Callable[[Any], None] | None = None) -> tuple[Any, dict]:
    """(tree, meta) of step `step` read by `read(abstract)` (`abstract`: `like` in the stored
    layout, `stored_tree()` says which): inspected before, `fits(abstract)` (raising
    DoesNotFit, passed on as it is) before anything is read, its hashes verified and its
    layout converted to `like`'s after; a read failure becomes integrity.CheckpointDamaged."""
    damage = integrity.inspect(directory, step)
    if damage is not None:
        raise integrity.CheckpointDamaged(damage)
    try:
        to_stored, to_mine = _layout_conversions(stored_tree, like)
        abstract = jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                           sharding=getattr(x, "sharding", None)),
            jax.eval_shape(to_stored, like) if to_stored else like)
        if fits is not None:
            fits(abstract)
        tree, meta = read(abstract)
    except DoesNotFit:
        raise
    except Exception as e:  # noqa: BLE001 - tensorstore's errors: which file, in one line
        noise.drop_late_callbacks()
        raise integrity.CheckpointDamaged(integrity.read_failure(e, step, directory)) from e
    if verify:
        integrity.verify(tree, meta.get("hashes"), step)
    if to_mine:
        tree = jax.tree.map(lambda x, ref: jax.device_put(x, getattr(ref, "sharding", None)),
                            to_mine(tree), like)
    return tree, meta


def _layout_conversions(stored_tree: Callable[[], Any], like: Any):
    """(to_stored, to_mine): functions converting a state between `like`'s parameter layout
    and the one the checkpoint was written in (`stored_tree()`, its tree metadata); (None,
    None) when they agree."""
    from dropless.models import scan
    from dropless.moe import convert_expert_weights, expert_layout
    try:
        tree = stored_tree()
    except (KeyError, TypeError, ValueError, FileNotFoundError):   # no readable tree metadata
        return None, None
    steps = []
    stored, mine = scan.is_scanned(tree), scan.is_scanned(like)
    if None not in (stored, mine) and stored != mine:
        steps.append((lambda t, v=stored: scan.to_layout(t, v),
                      lambda t, v=mine: scan.to_layout(t, v)))
    stored, mine = expert_layout(tree), expert_layout(like)
    if None not in (stored, mine) and stored != mine:
        steps.append((lambda t, v=stored: convert_expert_weights(t, prefuse=v),
                      lambda t, v=mine: convert_expert_weights(t, prefuse=v)))
    if not steps:
        return None, None

    def to_stored(t):
        for f, _ in steps:
            t = f(t)
        return t

    def to_mine(t):
        for _, g in reversed(steps):
            t = g(t)
        return t
    return to_stored, to_mine


def config_diff(saved: dict, now: dict, prefix: str = "") -> list[str]:
    """'KEY (A in the run's config.json, B now)' for every key whose value differs between the
    nested dicts `saved` and `now` (KEY dotted, after `prefix`)."""
    out = []
    for k in sorted(set(saved) | set(now)):
        a, b = saved.get(k), now.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_diff(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k} ({a!r} in the run's config.json, {b!r} now)")
    return out


def check_compatible(mngr: ocp.CheckpointManager, step: int, like: Any, *,
                     saved_model: dict | None, model: dict, run_dir: Path) -> None:
    """Raise ValueError if checkpoint `step` cannot be restored into `like` (a state or its
    eval_shape): names the first parameter whose shape or dtype differs (parameters before
    optimizer state) and the `model.*` config keys that differ from the run's config.json."""
    to_stored, _ = _layout_conversions(lambda: _saved_tree(mngr, step), like)
    if to_stored:                    # another layout of the same parameters restores exactly
        like = jax.eval_shape(to_stored, like)
    stored = {integrity.path_str(p): m for p, m in   # named as the live state's paths are
              jax.tree_util.tree_leaves_with_path(mngr.item_metadata(step)["state"])}
    problems = fit_problems(stored, like)
    if not problems:
        return
    keys = config_diff(saved_model or {}, model, "model.")
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    raise ValueError(
        f"checkpoint {step} in {run_dir} does not fit this config: "
        f"{problems[0]}{more}; config keys that differ: "
        f"{', '.join(keys) if keys else 'none found in model.*'}. Resume without those "
        "overrides, or start a new run (another run_name)")
