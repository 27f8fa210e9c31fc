"""A run folder as `dropless report` reads it: metrics.jsonl with step records (loss falling by
0.1 a step from 5.0) and, optionally, the config.json that names the run's vocabulary; and a
run's TensorBoard scalars read back, by a decoder of its own and by TensorBoard where it is
installed."""
import json
from pathlib import Path


def step_record(step: int, **change) -> dict:
    """The record the training loop writes for `step`, with `change` applied."""
    return {"event": "step", "step": step, "loss": 5.0 - step / 10, "step_time_s": 0.5,
            "tokens_per_s": 4000.0, "tflops_per_device": 0.02, "dropped_tokens": 0, **change}


def write_run(run: Path, steps: int, vocab_size: int | None = None) -> Path:
    """Make the folder `run` holding metrics.jsonl with steps 1..`steps`, and a config.json with
    model.vocab_size when `vocab_size` is given; returns `run`."""
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps(step_record(s)) + "\n" for s in range(1, steps + 1)))
    if vocab_size is not None:
        (run / "config.json").write_text(json.dumps({"model": {"vocab_size": vocab_size}}))
    return run


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        b = buf[i]
        n |= (b & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if not b & 0x80:
            return n, i


def _fields(buf: bytes) -> list[tuple[int, object]]:
    """(field number, value) of a protobuf message: ints for varints, bytes for fixed64 /
    fixed32 / length-delimited fields."""
    out, i = [], 0
    while i < len(buf):
        key, i = _varint(buf, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            value, i = buf[i:i + size], i + size
        elif wire == 2:
            size, i = _varint(buf, i)
            value, i = buf[i:i + size], i + size
        else:
            raise ValueError(f"wire type {wire} in an Event")
        out.append((num, value))
    return out


def tb_events(path: Path) -> list[dict]:
    """The Events of one TFRecord event file, decoded independently of the writer: each
    record's two masked CRC-32Cs checked, then {"step", "file_version", "session_status",
    "scalars": {tag: value}} (Event fields 2, 3, 7 {status 1}, 5 {value 1 {tag 1,
    simple_value 2}})."""
    import struct
    from dropless.train.tensorboard import masked_crc
    data, i, events = path.read_bytes(), 0, []
    while i < len(data):
        head = data[i:i + 8]
        (size,) = struct.unpack("<Q", head)
        assert struct.unpack("<I", data[i + 8:i + 12])[0] == masked_crc(head)
        body = data[i + 12:i + 12 + size]
        assert struct.unpack("<I", data[i + 12 + size:i + 16 + size])[0] == masked_crc(body)
        i += 16 + size
        ev = {"step": 0, "file_version": None, "session_status": None, "scalars": {}}
        for num, value in _fields(body):
            if num == 2:
                ev["step"] = value
            elif num == 3:
                ev["file_version"] = value.decode()
            elif num == 7:
                ev["session_status"] = dict(_fields(value)).get(1, 0)
            elif num == 5:
                for _, v in _fields(value):
                    f = dict(_fields(v))
                    ev["scalars"][f[1].decode()] = struct.unpack("<f", f[2])[0]
        events.append(ev)
    return events


def tb_scalars(run_dir: Path, purge: bool = True) -> dict[str, list[tuple[int, float]]]:
    """Every scalar point of RUN_DIR/tb, tag -> [(step, value)] in the order read, as
    TensorBoard's event accumulator reads the folder: files in name order; with `purge`, a
    `session_log { status: START }` at step S after the run's first one drops the points of
    steps >= S read before it (plugin_event_accumulator._CheckForRestartAndMaybePurge)."""
    points: dict[str, list[tuple[int, float]]] = {}
    starts = 0
    for path in sorted((Path(run_dir) / "tb").iterdir()):
        for ev in tb_events(path):
            if ev["session_status"] == 1:
                starts += 1
                if purge and starts > 1:
                    points = {t: [p for p in ps if p[0] < ev["step"]]
                              for t, ps in points.items()}
            for tag, v in ev["scalars"].items():
                points.setdefault(tag, []).append((ev["step"], v))
    return points


def tensorboard_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]] | None:
    """RUN_DIR/tb's scalars as TensorBoard itself loads them (its plugin event accumulator,
    orphaned data purged), tag -> [(step, value)]; None where tensorboard is not installed."""
    try:
        from tensorboard.backend.event_processing import plugin_event_accumulator as pea
        from tensorboard.util import tensor_util
    except ImportError:
        return None
    acc = pea.EventAccumulator(str(Path(run_dir) / "tb"), size_guidance={pea.TENSORS: 0})
    acc.Reload()
    return {tag: [(e.step, float(tensor_util.make_ndarray(e.tensor_proto)))
                  for e in acc.Tensors(tag)] for tag in acc.Tags()["tensors"]}
