"""Reading a Hugging Face safetensors checkpoint one tensor at a time.

Tensors come from safetensors' lazy `safe_open(..., framework="numpy")` handles, so only the
tensor asked for is read from disk. numpy has no float8 type, so safetensors' numpy API cannot
return F8_E4M3 tensors: those are read from the file's documented layout (an 8-byte header
length, a JSON header of dtype/shape/byte offsets, then the data) through a memory map and
viewed as `ml_dtypes.float8_e4m3fn`. FP8 weights with a `<name>_scale_inv` companion (DeepSeek-V3:
one float32 scale per 128x128 block) are dequantized: w = fp8 * scale_inv[block].
"""
from __future__ import annotations

import contextlib
import json
import math
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

FP8_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
BLOCK = 128


class CheckpointReader:
    """name -> tensor over the safetensors files of one folder (with or without an index).

    Use as a context manager; `read(name)` returns a numpy array (FP8 dequantized to float32).
    Raises FileNotFoundError when the folder has no config.json or no safetensors files.
    """

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        if not (self.folder / "config.json").is_file():
            raise FileNotFoundError(f"{self.folder}: no config.json (not a Hugging Face folder)")
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.folder.glob("*.safetensors"))
            weight_map = None
        if not files:
            raise FileNotFoundError(f"{self.folder}: no *.safetensors files")
        self._stack = contextlib.ExitStack()
        self._headers: dict[str, dict] = {}
        self._where: dict[str, str] = {}
        for f in files:
            header = _header(self.folder / f)
            self._headers[f] = header
            for name in header:
                if name != "__metadata__":
                    self._where[name] = f
        if weight_map is not None:
            missing = sorted(set(weight_map) - set(self._where))
            if missing:
                raise FileNotFoundError(f"{index}: tensors {missing[:5]} are not in their files")
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
    n = _header_len(path)
    with open(path, "rb") as fh:
        fh.seek(8)
        return json.loads(fh.read(n))
