"""`save`: our parameters -> a Hugging Face folder `transformers` loads (sharded safetensors,
model.safetensors.index.json, config.json), written one shard at a time into a folder beside the
destination that replaces it only when complete (`hf.destination`). Each setting the exported
config.json cannot carry (`hf.round_trip.not_carried`) is said once, when the folder is written."""
from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from dropless.config import ModelConfig
from dropless.hf import config_map as cm
from dropless.hf.layout import Layout, leaves, mtp_shared_copies, T, Same
from dropless.hf.round_trip import NotCarriedWarning, exported_config, not_carried_words

DEFAULT_SHARD_BYTES = 4 * 2**30


def _get(tree: Any, path: tuple) -> Any:
    for k in path:
        tree = tree[k]
    return tree


def _entries(cfg: ModelConfig, params: dict, lay: Layout
             ) -> list[tuple[str, int, Callable[[], np.ndarray]]]:
    """(HF name, bytes, producer) for every tensor to write, in checkpoint order."""
    out = []
    for leaf in leaves(cfg, lay):
        arr = _get(params, leaf.path)
        where = "/".join(map(str, leaf.path))
        if not leaf.hf:
            if np.any(np.asarray(arr) != 0):
                raise cm.UnsupportedCheckpoint(
                    f"params {where} is non-zero but {lay.arch} has no routing bias; "
                    "train softmax models with model.moe.bias_update_speed=0")
            continue
        if leaf.stacked:
            per = arr.size // arr.shape[0] * arr.dtype.itemsize
            for e, name in enumerate(leaf.hf):
                out.append((name, per, lambda a=arr, e=e, c=leaf.conv: c.inv(np.asarray(a[e]))))
        else:
            out.append((leaf.hf[0], arr.size * arr.dtype.itemsize,
                        lambda a=arr, c=leaf.conv: c.inv(np.asarray(a))))
    for name, path in mtp_shared_copies(cfg).items():
        if path == ("lm_head", "w_DV") and cfg.tie_embeddings:
            path, conv = ("embed", "w_VD"), Same()
        else:
            conv = T() if path == ("lm_head", "w_DV") else Same()
        arr = _get(params, path)
        out.append((name, arr.size * arr.dtype.itemsize,
                    lambda a=arr, c=conv: c.inv(np.asarray(a))))
    return out


def save(cfg: ModelConfig, params: dict, path: str | Path, *,
         max_shard_bytes: int = DEFAULT_SHARD_BYTES, rope_interleave: bool = True,
         overwrite: bool = False, extra_files: tuple = (),
         kept_config: Mapping[str, Any] | None = None,
         fallback_config: Mapping[str, Any] | None = None,
         announce: Callable[[str], Any] | None = None) -> Path:
    """Write `params` of `cfg` as a Hugging Face folder at `path`. The architecture follows from
    cfg (MLA -> DeepSeek-V3, GQA + qk-norm -> Qwen3-MoE, GQA -> Mixtral). DeepSeek-V3 rope
    columns are written interleaved (`rope_interleave`, as the released weights are).
    `extra_files` (paths: a tokenizer.json and the files beside it, a generation_config.json)
    are copied in. config.json is `hf.round_trip.exported_config`: the model's keys, then
    `kept_config` (the source config.json's other keys, `hf.round_trip.kept_keys`), then a
    YaRN model's context, then `fallback_config`, then max_position_embeddings=4096. Each
    setting of cfg that config.json cannot carry (a training setting such as a loss weight the
    architecture has no key for: `hf.round_trip.not_carried`) is said in one line once the
    folder is written: to `announce` when given, else as a `NotCarriedWarning`.

    Never destroys (`hf.destination`): the folder is written beside `path` and moved into place
    when complete; a non-empty `path` is refused unless `overwrite` (then replaced in one step).
    Raises UnsupportedCheckpoint naming the field the architecture cannot express,
    DestinationError for a destination it may not write. Returns the folder."""
    from dropless.hf.destination import check_destination, staged
    arch = cm.architecture_for(cfg)
    lay = Layout(arch, rope_interleave=rope_interleave and arch == cm.DEEPSEEK)
    config = exported_config(cfg, kept_config, fallback=fallback_config,
                             rope_interleave=rope_interleave)
    notes = not_carried_words(cfg)
    from dropless.models.scan import to_canonical_layout
    entries = _entries(cfg, to_canonical_layout(params), lay)
    out = check_destination(path, overwrite=overwrite)
    with staged(out) as tmp:
        _write_shards(entries, tmp, max_shard_bytes)
        for f in extra_files:
            shutil.copyfile(f, tmp / Path(f).name)
        # config.json last: a folder left by a killed write holds none, so nothing loads it
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
    for line in notes:
        if announce is None:
            warnings.warn(line, NotCarriedWarning, stacklevel=2)
        else:
            announce(line)
    return Path(path)


def _write_shards(entries: list, out: Path, max_shard_bytes: int) -> None:
    """The safetensors shards (one shard's tensors in memory at a time) and their index."""
    from safetensors.numpy import save_file
    shards: list[list[int]] = [[]]
    size = 0
    for i, (_, nbytes, _) in enumerate(entries):
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += nbytes
    weight_map, total = {}, 0
    for s, idx in enumerate(shards):
        fname = f"model-{s + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for i in idx:
            name, nbytes, make = entries[i]
            tensors[name] = make()
            weight_map[name] = fname
            total += nbytes
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        del tensors
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def tensor_count(cfg: ModelConfig) -> int:
    """How many tensors `save` writes for cfg (for tests and progress output)."""
    arch = cm.architecture_for(cfg)
    lay = Layout(arch, rope_interleave=arch == cm.DEEPSEEK)
    return sum(len(l.hf) for l in leaves(cfg, lay)) + len(mtp_shared_copies(cfg))


__all__ = ["save", "tensor_count", "DEFAULT_SHARD_BYTES"]
