"""Damage placed in a checkpoint from its own structure, so a test gets the same kind of damage
on every run (never "a byte in the middle of the largest file", whose meaning depends on how
orbax packed that run's data files).

A step's arrays are stored by tensorstore in OCDBT data files (`state/**/d/*`); each array
chunk is one zstd frame (RFC 8878), written back to back from the start of a data file. This
module walks those frames (magic, frame header, block headers) and damages them two ways:

* `flip_values(step)`: changes one byte inside a block's content at a position verified (with
  the `zstandard` reference decoder) to decode to other bytes of the same length, fixing the
  frame's content checksum when it has one: the step reads, to other numbers; only the
  recorded hashes can tell (reason `hash-mismatch`).
* `break_framing(step)`: changes a frame's magic number: no decoder reads it (reason
  `unreadable`).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import xxhash
import zstandard

MAGIC = b"\x28\xb5\x2f\xfd"


@dataclasses.dataclass(frozen=True)
class Frame:
    """One zstd frame of a data file: bytes [start, end); `blocks`: (type, content start,
    content length) of each block (0 raw, 1 RLE, 2 compressed); `checksum`: the frame ends
    with the 4-byte xxh64 of its content."""
    path: Path
    start: int
    end: int
    blocks: tuple[tuple[int, int, int], ...]
    checksum: bool


def _frame_at(path: Path, data: bytes, at: int) -> Frame | None:
    if data[at:at + 4] != MAGIC:
        return None
    fhd = data[at + 4]
    fcs_flag, single, checksum, dict_flag = fhd >> 6, (fhd >> 5) & 1, (fhd >> 2) & 1, fhd & 3
    pos = at + 5 + (0 if single else 1) + (0, 1, 2, 4)[dict_flag]
    pos += (1 if single else 0, 2, 4, 8)[fcs_flag]
    blocks = []
    while True:
        if pos + 3 > len(data):
            return None
        header = int.from_bytes(data[pos:pos + 3], "little")
        last, kind, size = header & 1, (header >> 1) & 3, header >> 3
        length = 1 if kind == 1 else size
        if kind == 3 or pos + 3 + length > len(data):
            return None
        blocks.append((kind, pos + 3, length))
        pos += 3 + length
        if last:
            break
    end = pos + (4 if checksum else 0)
    return Frame(path, at, end, tuple(blocks), bool(checksum)) if end <= len(data) else None


def frames(step: Path, under: str = "state") -> list[Frame]:
    """Every zstd frame found walking each data file of step folder `step` (its `under`
    subfolder: `state` of a checkpoint step, `params` of a dropless directory) from its start
    (a file whose start is not a frame contributes none), largest data files first."""
    out = []
    files = sorted((p for p in (step / under).glob("**/d/*") if p.is_file()),
                   key=lambda p: (-p.stat().st_size, str(p)))
    for path in files:
        data, at = path.read_bytes(), 0
        while (f := _frame_at(path, data, at)) is not None:
            out.append(f)
            at = f.end
    return out


def _decode(frame_bytes: bytes) -> bytes | None:
    try:
        return zstandard.ZstdDecompressor().decompressobj().decompress(frame_bytes)
    except zstandard.ZstdError:
        return None


def _with_checksum(frame: Frame, raw: bytearray) -> bytearray:
    """`raw` (a changed frame) with its content checksum, if it has one, made to match."""
    if frame.checksum:
        unchecked = bytearray(raw[:-4])
        unchecked[4] &= ~(1 << 2)          # the same frame without the checksum flag
        content = _decode(bytes(unchecked))
        if content is not None:
            raw[-4:] = (xxhash.xxh64_intdigest(content) & 0xFFFFFFFF).to_bytes(4, "little")
    return raw


TRIED = 4096   # bytes of a block tried from each place a change may land


def _literals(raw: bytes, at: int) -> tuple[int, int, int]:
    """(type, header length, regenerated size) of the literals section starting at `at` of a
    compressed block (RFC 8878 3.1.1.3.1.1); type 0 is raw: the literals follow verbatim."""
    b0 = raw[at]
    kind, size_format = b0 & 3, (b0 >> 2) & 3
    if kind in (0, 1):
        if size_format in (0, 2):
            return kind, 1, b0 >> 3
        if size_format == 1:
            return kind, 2, (b0 >> 4) + (raw[at + 1] << 4)
        return kind, 3, (b0 >> 4) + (raw[at + 1] << 4) + (raw[at + 2] << 12)
    return kind, (3, 3, 4, 5)[size_format], 0


def _positions(raw: bytes, kind: int, start: int, length: int):
    """Where in a block (content at raw[start:start + length]) a flipped bit may decode to
    other bytes of the same length: a raw block's content, from its end; in a compressed block,
    its verbatim literals where they are raw, then the sequences' bit streams from the block's
    end, then the compressed literals' streams from their start. RLE blocks: nowhere."""
    if kind == 1:
        return
    end = start + length
    if kind == 2:
        lit_kind, head, size = _literals(raw, start)
        if lit_kind == 0:
            yield from range(start + head, min(start + head + size, start + head + TRIED))
    yield from range(end - 1, max(start, end - TRIED) - 1, -1)
    if kind == 2 and lit_kind >= 2:
        yield from range(start + head, min(end, start + head + TRIED))


def flip_values(step: Path, under: str = "state", content: bytes | None = None) -> Frame:
    """Change one byte of the largest array chunk (with `content`: of the chunk that decodes to
    exactly those bytes, e.g. a chosen array's `tobytes()`) so that it still decodes, to other
    bytes of the same length (verified with the reference decoder); returns the frame changed.
    Raises AssertionError when no frame of the step allows it."""
    for frame in sorted(frames(step, under), key=lambda f: f.start - f.end):
        data = bytearray(frame.path.read_bytes())
        raw = bytearray(data[frame.start:frame.end])
        before = _decode(bytes(raw))
        if not before or (content is not None and before != content):
            continue
        for kind, start, length in frame.blocks:
            for pos in _positions(raw, kind, start - frame.start, length):
                for bit in (0, 3, 6):
                    trial = bytearray(raw)
                    trial[pos] ^= 1 << bit
                    trial = _with_checksum(frame, trial)
                    after = _decode(bytes(trial))
                    if after is not None and len(after) == len(before) and after != before:
                        data[frame.start:frame.end] = trial
                        frame.path.write_bytes(bytes(data))
                        return frame
    raise AssertionError(f"no zstd frame in {step} could be changed to other values")


def break_framing(step: Path) -> Frame:
    """Break the magic number of the largest frame: its chunk no longer decodes (verified);
    returns the frame."""
    frame = max(frames(step), key=lambda f: f.end - f.start)
    data = bytearray(frame.path.read_bytes())
    data[frame.start] ^= 0xFF
    assert _decode(bytes(data[frame.start:frame.end])) is None
    frame.path.write_bytes(bytes(data))
    return frame


def flip_param(run: Path, step: int) -> str:
    """Change the values of the largest parameter array of checkpoint `step` of run directory
    `run` (its chunk found by decoding to the array's bytes, read from the intact step first);
    returns the array's path. A reader of the parameters alone (eval, generate, convert,
    init_from) reads that array, so only its hash can tell."""
    import jax
    import numpy as np

    from dropless import checkpoint as ckpt
    from dropless.checkpoint import integrity
    from dropless.model_dir import from_dict, read_dropless_config
    from dropless.models.decoder import init_params
    cfg = from_dict(read_dropless_config(run))
    like = jax.eval_shape(lambda k: init_params(k, cfg.model), jax.random.key(0))
    params = ckpt.read_params(run / "checkpoints", step, like)
    path, leaf = max(jax.tree_util.tree_leaves_with_path(params), key=lambda pl: pl[1].size)
    flip_values(run / "checkpoints" / str(step), content=np.asarray(leaf).tobytes())
    return integrity.path_str(path)
