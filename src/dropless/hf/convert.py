"""`load` a Hugging Face checkpoint folder into our parameters (saving is `hf/save.py`).

Streaming: tensors are read, converted and placed one at a time, so host memory holds about one
tensor (one stacked expert tensor of ours, [E, D, F], is the largest) rather than the model. With
a `mesh`, each parameter is placed shard by shard with `jax.make_array_from_callback` using the
training placement (`parallel.sharding.param_spec`, the path table); stacked expert weights
read only the experts each shard holds.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

import jax
import numpy as np

from dropless.config import ModelConfig
from dropless.hf import config_map as cm
from dropless.hf.layout import Layout, Leaf, leaves, mtp_shared_copies
from dropless.hf.config_formats import BadCheckpoint, read_json
from dropless.hf.reader import CheckpointReader

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)   # a buffer older exports save; recomputed here


def _get(tree: Any, path: tuple) -> Any:
    for k in path:
        tree = tree[k]
    return tree


def _set(tree: Any, path: tuple, value: Any) -> None:
    _get(tree, path[:-1])[path[-1]] = value


def _converted(reader: CheckpointReader, name: str, leaf: Leaf, shape: tuple, dtype) -> np.ndarray:
    """One HF tensor as our array of `shape`: its dtype and shape checked before it is read."""
    what = "/".join(map(str, leaf.path))
    reader.check(name, leaf.conv.hf_shape(tuple(shape)), what)
    y = leaf.conv.fwd(reader.read(name))
    if tuple(y.shape) != tuple(shape):   # hf_shape and fwd disagree: a bug in the layout table
        raise ValueError(f"{reader.folder}: tensor {name!r} {tuple(reader.info(name)['shape'])} "
                         f"gives {tuple(y.shape)} for {what}, expected {tuple(shape)}")
    return y.astype(dtype, copy=False)


def _host(reader: CheckpointReader, leaf: Leaf, shape: tuple, dtype, experts=None) -> np.ndarray:
    """The whole parameter (or, for stacked ones, the experts in `experts`) on the host."""
    if not leaf.hf:
        return np.zeros(shape if experts is None else (len(experts),) + shape[1:], dtype)
    if not leaf.stacked:
        return _converted(reader, leaf.hf[0], leaf, shape, dtype)
    ids = range(shape[0]) if experts is None else experts
    out = np.empty((len(ids),) + tuple(shape[1:]), dtype)
    for j, e in enumerate(ids):   # one expert at a time into the preallocated stack
        out[j] = _converted(reader, leaf.hf[e], leaf, shape[1:], dtype)
    return out


def _place(reader: CheckpointReader, leaf: Leaf, like: jax.ShapeDtypeStruct, mesh) -> jax.Array:
    """The parameter on its device(s), transferred before returning: an asynchronous
    device_put keeps its host buffer alive, and a reader faster than the transfers would pile
    up host copies of many tensors."""
    return _transfer(reader, leaf, like, mesh).block_until_ready()


def _transfer(reader: CheckpointReader, leaf: Leaf, like: jax.ShapeDtypeStruct, mesh) -> jax.Array:
    shape, dtype = tuple(like.shape), np.dtype(like.dtype)
    if mesh is None:
        return jax.device_put(_host(reader, leaf, shape, dtype))
    from jax.sharding import NamedSharding
    from dropless.parallel.sharding import param_spec
    path = "/".join(map(str, leaf.path))
    sharding = NamedSharding(mesh, param_spec(path, shape, mesh))
    if not leaf.stacked:
        host = _host(reader, leaf, shape, dtype)
        return jax.make_array_from_callback(shape, sharding, lambda idx: host[idx])
    cache: dict[tuple, np.ndarray] = {}

    def shard(idx):   # read only the experts this shard holds (cached across replicas)
        e = range(shape[0])[idx[0]]
        key = (e.start, e.stop, e.step)
        if key not in cache:
            cache.clear()
            cache[key] = _host(reader, leaf, shape, dtype, experts=e)
        return cache[key][(slice(None),) + tuple(idx[1:])]
    return jax.make_array_from_callback(shape, sharding, shard)


def _mtp_depth(hf: dict, reader: CheckpointReader, requested: int | None, where: str) -> int:
    f = cm.Fields(hf, cm.DEEPSEEK, where)
    available = f.int("num_nextn_predict_layers", 0, nullable=True, low=0) or 0
    n = f.int("num_hidden_layers")
    present = sum(f"model.layers.{n + k}.eh_proj.weight" in reader for k in range(available))
    if requested is None:
        return present
    if requested > present:
        raise ValueError(f"mtp_depth={requested} but {reader.folder} holds {present} MTP "
                         f"modules (num_nextn_predict_layers={available})")
    return requested


def _config_json(path: Path) -> tuple[dict, str]:
    """(canonical config dict, its file name for errors); FileNotFoundError without one."""
    conf = Path(path) / "config.json"
    if not conf.is_file():
        raise FileNotFoundError(f"{path}: no config.json (not a Hugging Face folder)")
    return cm.canonical(read_json(conf), str(conf)), str(conf)


@contextlib.contextmanager
def _opened(path: Path, *, dtype: str | None, mtp_depth: int | None
            ) -> Iterator[tuple[dict, ModelConfig, Layout, CheckpointReader]]:
    """(config.json, ModelConfig, layout, open reader) of a Hugging Face folder; config.json's
    errors are raised before the weight files are opened."""
    hf, where = _config_json(path)
    cm.model_config(hf, dtype=dtype, where=where)
    with CheckpointReader(path) as reader:
        depth = _mtp_depth(hf, reader, mtp_depth, where) if cm.architecture(hf) == cm.DEEPSEEK \
            else 0
        cfg, lay = cm.model_config(hf, dtype=dtype, mtp_depth=depth, where=where)
        yield hf, cfg, lay, reader


def read_config(path: str | Path, *, dtype: str | None = None, mtp_depth: int | None = None
                ) -> tuple[ModelConfig, Layout]:
    """The ModelConfig (and layout) of a Hugging Face folder, without reading any weights."""
    with _opened(Path(path), dtype=dtype, mtp_depth=mtp_depth) as (_, cfg, lay, _reader):
        return cfg, lay


def load(path: str | Path, *, dtype: str | None = None, mesh: Any = None,
         mtp_depth: int | None = None) -> tuple[ModelConfig, dict]:
    """(ModelConfig, params) from a local Hugging Face folder (config.json + *.safetensors).

    `dtype` sets the model's dtype/weight_dtype (default: the checkpoint's; bfloat16 for FP8
    checkpoints, which are dequantized). `mesh` (a jax.sharding.Mesh with data/fsdp/expert
    axes) places each parameter as training does. `mtp_depth` (DeepSeek-V3): how many MTP
    modules to load (default: all the folder holds). Raises UnsupportedCheckpoint for
    architectures or features we do not implement, ValueError for a tensor whose shape does not
    match config.json or a tensor the mapping does not consume.
    """
    from dropless.models.decoder import init_params
    with _opened(Path(path), dtype=dtype, mtp_depth=mtp_depth) as (hf, cfg, lay, reader):
        shapes = jax.eval_shape(lambda k: init_params(k, cfg), jax.random.key(0))
        todo = list(leaves(cfg, lay))
        _check_all(reader, todo, shapes, cfg, hf)     # before the first tensor is read
        params = jax.tree.map(lambda _: None, shapes)
        for leaf in todo:
            _set(params, leaf.path, _place(reader, leaf, _get(shapes, leaf.path), mesh))
    return cfg, params


def _check_all(reader: CheckpointReader, todo: list[Leaf], shapes: Any, cfg: ModelConfig,
               hf: dict) -> None:
    """Every tensor the parameters need present with its dtype and shape, and every tensor of
    the folder consumed, checked from the headers alone: a bad checkpoint is refused before
    any tensor is read, however large."""
    for leaf in todo:
        shape = tuple(_get(shapes, leaf.path).shape)
        for name in leaf.hf:
            reader.check(name, leaf.conv.hf_shape(shape[1:] if leaf.stacked else shape),
                         "/".join(map(str, leaf.path)))
    _check_consumed(reader, {n for leaf in todo for n in leaf.hf}, cfg, hf)


def _check_consumed(reader: CheckpointReader, used: set[str], cfg: ModelConfig, hf: dict) -> None:
    skipped = set(mtp_shared_copies(cfg))
    n = cfg.num_layers
    extra_mtp = range(n + cfg.mtp_depth, n + int(hf.get("num_nextn_predict_layers") or 0))
    left = []
    for name in reader.names():
        base = name[:-len("_scale_inv")] if name.endswith("_scale_inv") else name
        if base in used or name in skipped or name.endswith(IGNORED_SUFFIXES):
            continue
        if any(name.startswith(f"model.layers.{i}.") for i in extra_mtp):
            continue   # MTP modules the caller chose not to load (mtp_depth)
        left.append(name)
    if cfg.tie_embeddings and "lm_head.weight" in left:   # which of the two would be used?
        raise BadCheckpoint(f"{reader.path('lm_head.weight')}: holds tensor 'lm_head.weight' but "
                            f"{reader.folder / 'config.json'} says tie_word_embeddings=true (the "
                            "output layer is the embedding); set it to false to use "
                            "lm_head.weight, or remove the tensor")
    if left:
        raise ValueError(f"{reader.folder}: {len(left)} tensors are not mapped to any parameter "
                         f"(unsupported layout?): {sorted(left)[:8]}")
