"""runtime/files.py: a file is replaced whole or not at all; a failing writer (a full disk)
leaves the old file and no temporary file behind."""
import errno

import pytest

from dropless.runtime import files


def test_write_replaces_whole(tmp_path):
    p = tmp_path / "a.json"
    files.write_text(p, "old")
    files.write_text(p, "new")
    assert p.read_text() == "new" and sorted(x.name for x in tmp_path.iterdir()) == ["a.json"]


def test_a_failing_writer_keeps_the_old_file(tmp_path):
    p = tmp_path / "loss.png"
    p.write_bytes(b"the old plot")
    with pytest.raises(OSError, match="No space"):
        with files.replacing(p) as tmp:
            tmp.write_bytes(b"half a pl")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert p.read_bytes() == b"the old plot"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["loss.png"]
