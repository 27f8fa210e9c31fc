"""A streamed text file's memory (`readers.streamed`, `prepare_workers.stream_document`): a
whole `data prepare` of one text file, in one fresh process (workers=0, so the reading, the
encoding and the shard writing all count), takes the same peak for a file several times larger,
under `stream_peak`; encoded as one string the files would take 13 (byte) and ~24 (a
tokenizer.json, in pieces) bytes a byte more. Measured as the kernel counts it, as
tests/data/test_prepare_workers_memory.py measures a worker."""
import json
import os

import pytest

from dropless.data import prepare_workers as pw
from tests._support.prepare_memory import mixed_text, prepare_peak
from tests._support.tokenizer_styles import build

MiB = 1 << 20
pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"),
                                reason="Linux's /proc")


def _peaks(tmp_path, tokenizer: str, sizes_mib) -> list[int]:
    out = []
    for n in sizes_mib:
        src = tmp_path / f"t{n}.txt"
        src.write_text(mixed_text(n * MiB, seed=n), newline="")
        out.append(prepare_peak(sources=(str(src),), out=str(tmp_path / f"o{n}"),
                                tokenizer=tokenizer, eval_fraction=0.0, workers=0))
    return out


def test_the_byte_tokenizer_holds_the_same_for_8_and_48_mib(tmp_path):
    small, large = _peaks(tmp_path, "byte", (8, 48))
    assert large <= pw.stream_peak("byte") and large - small < 8 * MiB, (small, large)
    assert large < 13 * 48 * MiB / 10      # a tenth of what a worker took for it whole


def test_a_tokenizer_json_holds_the_same_for_8_and_16_mib(tmp_path):
    tok = build("gpt2")
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    path = str(tmp_path / "tok" / "tokenizer.json")
    small, large = _peaks(tmp_path, path, (8, 16))
    assert large <= pw.stream_peak(path) and large - small < 16 * MiB, (small, large)
    # in pieces, as one chunk: a piece and 24 bytes a byte of the file
    assert large < pw.encode_peak("text", "tokenizer.json", 16 * MiB, 1) - 200 * MiB
