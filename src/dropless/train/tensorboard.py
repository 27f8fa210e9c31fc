"""A minimal TensorBoard event-file writer for scalars, with no TensorFlow dependency.

File format (TFRecord): each record is
  uint64 length | uint32 masked_crc32c(length bytes) | data | uint32 masked_crc32c(data),
and each data is a serialized `tensorflow.Event` protobuf (tensorboard/compat/proto/event.proto):
  Event { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5;
          SessionLog session_log = 7; }
  Summary { repeated Value value = 1; }   Value { string tag = 1; float simple_value = 2; }
  SessionLog { SessionStatus status = 1; }   SessionStatus { UNSPECIFIED = 0; START = 1; ... }

A run resumed from checkpoint step S replays the steps after S that its earlier session had
already written. Every session's file therefore starts (after its file-version header) with a
`session_log { status: START }` event at its first step, S + 1: TensorBoard's event accumulator
then discards the points of steps >= S + 1 it read before (`_CheckForRestartAndMaybePurge`;
it takes a run's first START as the start, not a restart, which is why a new run writes one
too), so each step shows once, with the values of the session that produced the checkpoints.
TensorBoard's Rust data server needs no marker: a time series that goes back in step drops
the points after it.
"""
from __future__ import annotations

import socket
import struct
import time
from pathlib import Path


def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), as TFRecord uses."""
    c = 0xFFFFFFFF
    for b in data:
        c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    out = bytearray()
    n &= (1 << 64) - 1
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _bytes_field(num: int, payload: bytes) -> bytes:
    return _varint(num << 3 | 2) + _varint(len(payload)) + payload


SESSION_START = 1   # SessionLog.SessionStatus.START


def encode_event(wall_time: float, step: int, *, scalars: dict[str, float] | None = None,
                 file_version: str | None = None, session_start: bool = False) -> bytes:
    """A serialized Event with the given scalars (or the file-version header event, or with
    `session_start` a `session_log { status: START }` event)."""
    out = _varint(1 << 3 | 1) + struct.pack("<d", wall_time) + _varint(2 << 3 | 0) + _varint(step)
    if file_version is not None:
        out += _bytes_field(3, file_version.encode())
    if session_start:
        out += _bytes_field(7, _varint(1 << 3 | 0) + _varint(SESSION_START))
    if scalars:
        values = b"".join(_bytes_field(1, _bytes_field(1, tag.encode()) + _varint(2 << 3 | 5)
                                       + struct.pack("<f", float(v)))
                          for tag, v in scalars.items())
        out += _bytes_field(5, values)
    return out


def record(data: bytes) -> bytes:
    """One TFRecord framing `data`."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc(length)) + data + struct.pack("<I",
                                                                              masked_crc(data))


class ScalarWriter:
    """Appends scalar summaries to RUN_DIR/tb/events.out.tfevents.<time>.<host>, after the
    file-version header and a session START at `first_step` (the first step this session
    writes: a resume's replayed steps replace the earlier session's, see the module
    docstring)."""

    def __init__(self, run_dir: str | Path, first_step: int = 1):
        d = Path(run_dir) / "tb"
        d.mkdir(parents=True, exist_ok=True)
        self.path = d / f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}"
        now = time.time()
        with open(self.path, "ab") as fh:
            fh.write(record(encode_event(now, 0, file_version="brain.Event:2"))
                     + record(encode_event(now, first_step, session_start=True)))

    def scalars(self, step: int, values: dict[str, float | None]) -> None:
        clean = {k: float(v) for k, v in values.items() if v is not None}
        with open(self.path, "ab") as fh:
            fh.write(record(encode_event(time.time(), step, scalars=clean)))
