"""Reading a Hugging Face safetensors checkpoint one tensor at a time.

Tensors come from safetensors' lazy `safe_open(..., framework="numpy")` handles, so only the
tensor asked for is read from disk. numpy has no float8 type, so safetensors' numpy API cannot
return F8_E4M3 tensors: those are read from the file's documented layout (an 8-byte header
length, a JSON header of dtype/shape/byte offsets, then the data) through a memory map and
viewed as `ml_dtypes.float8_e4m3fn`. FP8 weights with a `<name>_scale_inv` companion (DeepSeek-V3:
one float32 scale per 128x128 block) are dequantized: w = fp8 * scale_inv[block].

Nothing is trusted before it is checked, and every check happens before any tensor is read:
every file's header must parse (at most 100 MB, as safetensors allows) with each tensor named
once, of a known dtype, with a byte range that matches its dtype and shape; the ranges must tile
the data exactly (in bounds, no overlap, no gap, nothing after the last; a truncated download
fails here, naming the file and the tensor). An index must be JSON with a `weight_map` naming
shard files inside the folder (a plain relative path: no `..`, not absolute), whose every entry
is in the shard it names, and every tensor of those shards must be in it. `check(name, shape)`
compares a tensor's dtype and shape with what the model expects before it is read.
"""
from __future__ import annotations

import contextlib
import json
import math
import struct
from pathlib import Path, PurePosixPath

import ml_dtypes
import numpy as np

from dropless.hf.config_formats import BadCheckpoint, read_json

FP8_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64", *FP8_DTYPES)
ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2,
            "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
BLOCK = 128
MAX_HEADER_BYTES = 100_000_000   # safetensors' own limit (N_LEN check in safetensors/src/tensor.rs)
INDEX = "model.safetensors.index.json"


class CheckpointReader:
    """name -> tensor over the safetensors files of one folder: the shards its
    model.safetensors.index.json names, or else its model.safetensors (what transformers reads).

    Use as a context manager; `read(name)` returns a numpy array (FP8 dequantized to float32).
    Raises FileNotFoundError when the folder has no config.json or no safetensors files.
    """

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        if not (self.folder / "config.json").is_file():
            raise FileNotFoundError(f"{self.folder}: no config.json (not a Hugging Face folder)")
        index = self.folder / INDEX
        weight_map = _weight_map(index) if index.is_file() else None
        if weight_map is not None:
            files = sorted(set(weight_map.values()))
        else:   # as transformers: one model.safetensors; other files are not the model's
            files = ["model.safetensors"] if (self.folder / "model.safetensors").is_file() else []
        if not files:
            raise FileNotFoundError(f"{self.folder}: no model.safetensors or {INDEX}")
        self._stack = contextlib.ExitStack()
        self._headers: dict[str, dict] = {}
        self._where: dict[str, str] = {}
        for f in files:
            if not (self.folder / f).is_file():
                raise BadCheckpoint(f"{index}: names {f!r}, which is not in {self.folder}")
            header = _header(self.folder / f)
            self._headers[f] = header
            for name in header:
                if name == "__metadata__":
                    continue
                if name in self._where:
                    raise BadCheckpoint(f"{self.folder / f}: tensor {name!r} is also in "
                                        f"{self._where[name]}")
                self._where[name] = f
        if weight_map is not None:
            _cross_check(index, weight_map, self._where)
        self._handles: dict[str, object] = {}

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def info(self, name: str) -> dict:
        """{"dtype": "BF16"/"F32"/"F8_E4M3"/..., "shape": [...], "data_offsets": [a, b]}."""
        return self._headers[self._where[name]][name]

    def path(self, name: str) -> Path:
        """The file that holds tensor `name`."""
        return self.folder / self._where[name]

    def check(self, name: str, shape: tuple[int, ...], what: str) -> None:
        """Raise BadCheckpoint (naming file, tensor, what it holds and what was expected) unless
        `name` is a floating-point tensor of `shape` (FP8 with a float `_scale_inv` of one
        value per 128x128 block), before anything is read."""
        if name not in self._where:
            raise BadCheckpoint(f"{self.folder}: tensor {name!r} ({what}) is not in the "
                                "checkpoint, but config.json implies it")
        meta = self.info(name)
        where = f"{self.path(name)}: tensor {name!r}"
        if meta["dtype"] not in FLOAT_DTYPES:
            raise BadCheckpoint(f"{where} has dtype {meta['dtype']}, expected a float type "
                                f"({'/'.join(FLOAT_DTYPES)}) for {what}")
        if tuple(meta["shape"]) != tuple(shape):
            raise BadCheckpoint(f"{where} has shape {tuple(meta['shape'])}, expected "
                                f"{tuple(shape)} for {what} from config.json")
        if meta["dtype"] in FP8_DTYPES:
            scale = name + "_scale_inv"
            want = tuple(math.ceil(n / BLOCK) for n in shape)
            if len(shape) != 2 or scale not in self._where:
                raise BadCheckpoint(f"{where} is FP8 but has no {scale!r} (one float32 scale "
                                    f"per {BLOCK}x{BLOCK} block)")
            self.check(scale, want, f"the block scales of {name}")

    def _handle(self, file: str):
        """One open file at a time: an open safetensors handle maps its whole file, and mapped
        pages that were read count as resident memory until it closes."""
        if file not in self._handles:
            from safetensors import safe_open
            self._stack.close()
            self._handles = {file: self._stack.enter_context(
                safe_open(str(self.folder / file), framework="numpy"))}
        return self._handles[file]

    def read_raw(self, name: str) -> np.ndarray:
        """The stored tensor as is (FP8 as ml_dtypes float8)."""
        if name not in self._where:
            raise KeyError(f"{self.folder}: tensor {name!r} is not in the checkpoint")
        file = self._where[name]
        meta = self.info(name)
        if meta["dtype"] in FP8_DTYPES:
            start, end = meta["data_offsets"]
            n = _header_len(self.folder / file)
            mm = np.memmap(self.folder / file, np.uint8, mode="r", offset=8 + n + start,
                           shape=(end - start,))
            return np.array(mm).view(FP8_DTYPES[meta["dtype"]]).reshape(meta["shape"])
        return self._handle(file).get_slice(name)[:]

    def read(self, name: str) -> np.ndarray:
        """The tensor, FP8 weights dequantized with their 128x128 block `_scale_inv`."""
        x = self.read_raw(name)
        if x.dtype not in FP8_DTYPES.values():
            return x
        scale_name = name + "_scale_inv"
        if scale_name not in self._where:
            raise ValueError(f"{self.folder}: FP8 tensor {name!r} has no {scale_name!r}")
        return dequantize_blocks(x, self.read_raw(scale_name))


def dequantize_blocks(w_fp8: np.ndarray, scale_inv: np.ndarray) -> np.ndarray:
    """w [out, in] (float8) * scale_inv [ceil(out/128), ceil(in/128)] per block -> float32."""
    out, inn = w_fp8.shape
    want = (math.ceil(out / BLOCK), math.ceil(inn / BLOCK))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"weight_scale_inv shape {tuple(scale_inv.shape)} does not match "
                         f"weight {w_fp8.shape} in {BLOCK}x{BLOCK} blocks (want {want})")
    s = np.repeat(np.repeat(scale_inv.astype(np.float32), BLOCK, 0), BLOCK, 1)[:out, :inn]
    return w_fp8.astype(np.float32) * s


def _header_len(path: Path) -> int:
    with open(path, "rb") as fh:
        return struct.unpack("<Q", fh.read(8))[0]


def _header(path: Path) -> dict:
    """The parsed header of one safetensors file, every entry checked against the file size;
    BadCheckpoint naming the file (and tensor) otherwise."""
    size = path.stat().st_size
    if size < 8:
        raise BadCheckpoint(f"{path}: {size} bytes is too short for a safetensors file "
                            "(truncated?)")
    n = _header_len(path)
    if n > MAX_HEADER_BYTES:
        raise BadCheckpoint(f"{path}: header of {n} bytes is over safetensors' limit of "
                            f"{MAX_HEADER_BYTES} (not a safetensors file, or a damaged one)")
    if 8 + n > size:
        raise BadCheckpoint(f"{path}: header of {n} bytes does not fit in the file of {size} "
                            "bytes (truncated?)")
    with open(path, "rb") as fh:
        fh.seek(8)
        raw = fh.read(n)
    try:
        header = json.loads(raw, object_pairs_hook=_unique_keys)
    except _DuplicateKey as e:
        raise BadCheckpoint(f"{path}: header lists tensor {e.args[0]!r} twice (a damaged or "
                            "hand-edited file)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadCheckpoint(f"{path}: header is not valid JSON ({e}); not a safetensors file, "
                            "or a damaged one") from None
    if not isinstance(header, dict):
        raise BadCheckpoint(f"{path}: header is not a JSON object")
    data = size - 8 - n
    for name, meta in header.items():
        if name != "__metadata__":
            _check_entry(path, name, meta, data)
    _check_tiling(path, header, data)
    return header


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """json object hook: the object, or _DuplicateKey naming a key given twice (json keeps the
    last one silently; safetensors refuses the file)."""
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def _check_tiling(path: Path, header: dict, data_bytes: int) -> None:
    """The byte ranges, in order of their start, cover the data exactly: each starts where the
    one before it ends (no overlap, no gap) and the last ends at the end of the file."""
    ranges = sorted((tuple(m["data_offsets"]), name) for name, m in header.items()
                    if name != "__metadata__")
    end, prev = 0, None
    for (start, stop), name in ranges:
        if start < end:
            raise BadCheckpoint(f"{path}: tensor {name!r} (bytes {start}..{stop}) overlaps "
                                f"tensor {prev!r}, which ends at byte {end}")
        if start > end:
            raise BadCheckpoint(f"{path}: tensor {name!r} starts at byte {start} but the data "
                                f"before it ends at {end} (a gap; not a safetensors layout)")
        end, prev = stop, name
    if end != data_bytes:
        raise BadCheckpoint(f"{path}: the tensors end at byte {end} of the data but the file "
                            f"holds {data_bytes} ({data_bytes - end} bytes no tensor covers)")


def _check_entry(path: Path, name: str, meta, data_bytes: int) -> None:
    where = f"{path}: tensor {name!r}"
    if not isinstance(meta, dict) or not isinstance(meta.get("dtype"), str) \
            or meta["dtype"] not in ITEMSIZE:
        got = meta.get("dtype") if isinstance(meta, dict) else meta
        raise BadCheckpoint(f"{where} has dtype {_short(got)}, not one dropless reads "
                            f"({'/'.join(ITEMSIZE)})")
    shape, offsets = meta.get("shape"), meta.get("data_offsets")
    if not (isinstance(shape, list) and all(_is_size(d) for d in shape)
            and isinstance(offsets, list) and len(offsets) == 2
            and all(_is_size(o) for o in offsets) and offsets[0] <= offsets[1]):
        raise BadCheckpoint(f"{where} has shape {_short(shape)} / data_offsets "
                            f"{_short(offsets)}, which are not a list of sizes and a [start, end] "
                            "byte range")
    want = math.prod(shape) * ITEMSIZE[meta["dtype"]]
    if offsets[1] - offsets[0] != want:
        raise BadCheckpoint(f"{where}: {meta['dtype']} {tuple(shape)} needs {want} bytes, its "
                            f"data_offsets {offsets} hold {offsets[1] - offsets[0]}")
    if offsets[1] > data_bytes:
        raise BadCheckpoint(f"{where} ends at byte {offsets[1]} of the data but the file holds "
                            f"{data_bytes} (truncated?)")


def _is_size(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _short(x, limit: int = 120) -> str:
    r = repr(x)
    return r if len(r) <= limit else r[:limit - 3] + "..."


def _weight_map(index: Path) -> dict[str, str]:
    """The index's weight_map, checked to be {tensor name: file name}."""
    doc = read_json(index)
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                           for k, v in wm.items()):
        raise BadCheckpoint(f"{index}: weight_map={_short(wm)} must be an object of tensor name "
                            "-> safetensors file")
    for name, file in wm.items():
        if not _inside(file):
            raise BadCheckpoint(f"{index}: weight_map puts tensor {name!r} in {file!r}, which is "
                                "not a file of this folder (shard names are plain relative "
                                "paths, without '..')")
    return wm


def _inside(file: str) -> bool:
    """`file` names a path under the folder by its spelling alone: relative, no `..` part, not
    empty. (Symbolic links are followed as transformers does: the Hugging Face cache links
    every shard to a blob outside the snapshot folder.)"""
    p = PurePosixPath(file)
    return (file != "" and "\\" not in file and "\0" not in file and not p.is_absolute()
            and ".." not in p.parts and p.parts != ())


def _cross_check(index: Path, weight_map: dict[str, str], where: dict[str, str]) -> None:
    """Every entry of the index in the shard it names, every tensor of the shards listed."""
    for name, file in sorted(weight_map.items()):
        if name not in where:
            raise BadCheckpoint(f"{index}: weight_map puts tensor {name!r} in {file}, which does "
                                "not hold it")
        if where[name] != file:
            raise BadCheckpoint(f"{index}: weight_map puts tensor {name!r} in {file}, but it is "
                                f"in {where[name]}")
    extra = sorted(set(where) - set(weight_map))
    if extra:
        raise BadCheckpoint(f"{index}: tensor {extra[0]!r} (in {where[extra[0]]}) is missing "
                            f"from weight_map ({len(extra)} tensor(s) in the shards are not "
                            "listed; a partly written index?)")
