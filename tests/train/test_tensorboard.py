"""The TensorBoard event files: Events encoded byte for byte as the proto says (hand-worked, and
parsed by TensorBoard's own proto where it is installed), and a resumed session that replays
steps starts with a SessionLog START, so TensorBoard shows each step once, the replayed one's
value. The trainer's resumed run end to end is tests/train/test_loop.py."""
import pytest

from dropless.train import tensorboard as tb
from tests._support.run_metrics import tb_events, tb_scalars, tensorboard_scalars

WALL_1 = b"\x09" + bytes.fromhex("000000000000f03f")   # wall_time (field 1, fixed64) = 1.0


def test_a_scalar_event_hand_worked(tmp_path):
    assert tb.crc32c(b"123456789") == 0xE3069283          # the CRC-32C check value
    # Event{wall_time=1.0, step=3 (field 2, varint),
    #       summary (field 5) { value (1) { tag (1) "a", simple_value (2, fixed32) 2.0 } } }
    want = (WALL_1 + b"\x10\x03"
            + b"\x2a\x0a" + b"\x0a\x08" + b"\x0a\x01a" + b"\x15" + bytes.fromhex("00000040"))
    assert tb.encode_event(1.0, 3, scalars={"a": 2.0}) == want
    rec = tb.record(want)
    assert rec[:8] == len(want).to_bytes(8, "little") and rec[12:-4] == want
    w = tb.ScalarWriter(tmp_path)
    w.scalars(1, {"loss": 5.5, "mfu": None})
    assert [e["scalars"] for e in tb_events(w.path)][-1] == {"loss": 5.5}


def test_a_session_start_event_hand_worked():
    # Event{wall_time=1.0, step=5, session_log (field 7, length 2) { status (1, varint) START=1 }}
    # (field 6 is the deprecated log_message: tensorboard/compat/proto/event.proto)
    want = WALL_1 + b"\x10\x05" + b"\x3a\x02" + b"\x08\x01"
    assert tb.encode_event(1.0, 5, session_start=True) == want
    try:
        from tensorboard.compat.proto import event_pb2
    except ImportError:
        return
    ev = event_pb2.Event.FromString(want)
    assert ev.step == 5 and ev.session_log.status == event_pb2.SessionLog.START
    assert ev.SerializeToString() == want


def test_a_session_starts_at_its_first_step(tmp_path):
    w = tb.ScalarWriter(tmp_path, first_step=7)
    w.scalars(7, {"loss": 1.0})
    header, start, point = tb_events(w.path)
    assert header["file_version"] == "brain.Event:2" and header["session_status"] is None
    assert (start["step"], start["session_status"], start["scalars"]) == (7, 1, {})
    assert (point["step"], point["scalars"]) == (7, {"loss": 1.0})


def test_a_resumed_session_replaces_the_steps_it_replays(tmp_path):
    """Session 1 wrote steps 1-6; its last checkpoint was step 4, so session 2 starts at 5
    and writes 5-7 into its own file: read as TensorBoard reads the folder, each step once,
    5 and 6 from session 2 (the first START of a run does not purge: a new run writes one too,
    or the resume's START would be the run's first and be ignored)."""
    first = tb.ScalarWriter(tmp_path, first_step=1)
    for s in range(1, 7):
        first.scalars(s, {"loss": 10.0 + s})
    # an older time in its name (sessions seconds apart; this test may run within one)
    first.path.rename(first.path.with_name("events.out.tfevents.1.host"))
    second = tb.ScalarWriter(tmp_path, first_step=5)
    for s in range(5, 8):
        second.scalars(s, {"loss": 20.0 + s, "eval_loss": 30.0 + s})
    assert len(list((tmp_path / "tb").iterdir())) == 2
    want = {"loss": [(1, 11.0), (2, 12.0), (3, 13.0), (4, 14.0), (5, 25.0), (6, 26.0),
                     (7, 27.0)],
            "eval_loss": [(5, 35.0), (6, 36.0), (7, 37.0)]}
    assert tb_scalars(tmp_path) == want
    assert [s for s, _ in tb_scalars(tmp_path, purge=False)["loss"]].count(5) == 2
    seen = tensorboard_scalars(tmp_path)
    if seen is None:
        pytest.skip("tensorboard is not installed: checked with the decoder above only")
    assert seen == want
