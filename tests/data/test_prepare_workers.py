"""`data.prepare_workers`: how many tokenizing processes a `data prepare` starts. A count past
MAX_WORKERS (a typo: 10**6 processes) is refused in one line naming --workers, before anything
is written; a count above the chunks the inputs can make starts no more processes than chunks,
and the output is the same bytes whatever the count."""
import gzip
import json

import pytest

from dropless import cli
from dropless.data import prepare as prepare_lib
from dropless.data import readers
from dropless.data.prepare import PrepareConfig, prepare
from dropless.data.prepare_workers import MAX_WORKERS, worker_count


@pytest.mark.parametrize("workers", [-1, MAX_WORKERS + 1, 10 ** 6])
def test_a_worker_count_out_of_range_is_refused(workers):
    with pytest.raises(ValueError, match=rf"--workers={workers} must be from 0 .* to "
                                         rf"{MAX_WORKERS}; the default, one per core"):
        PrepareConfig(sources=("d.jsonl",), out="o", workers=workers)
    PrepareConfig(sources=("d.jsonl",), out="o", workers=MAX_WORKERS)   # the cap itself is fine


@pytest.mark.parametrize("workers", ["1000000", "-2"])
def test_the_cli_refuses_it_in_one_line_writing_nothing(tmp_path, monkeypatch, capsys, workers):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d.jsonl").write_text('{"text": "a"}\n')
    rc = cli.main(["data", "prepare", "d.jsonl", "out", "--tokenizer", "byte",
                   "--workers", workers])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"dropless: error: --workers={workers}"
                                                           " must be from 0"), err
    assert not (tmp_path / "out").exists()


def _files(tmp_path, contents: dict) -> list[readers.InputFile]:
    for name, data in contents.items():
        (tmp_path / name).write_bytes(data)
    return [f for name in contents for f in readers.input_files(str(tmp_path / name))]


def test_worker_count_is_capped_by_the_chunks_the_inputs_can_make(tmp_path):
    small = _files(tmp_path, {"a.jsonl": b'{"text": "a"}\n' * 10, "b.txt": b"text"})

    def count(*args):
        return worker_count(*args, available=1 << 50).count    # memory for any count
    assert count(16, small, 1024) == 2            # one chunk each, at most
    # a.jsonl's 140 bytes hold at most 47 records ('{}' and a newline each): 3 chunks of 16
    assert count(16, small, 16) == 3 + 1
    assert count(1, small, 1) == 1 and count(0, small, 1) == 0
    packed = _files(tmp_path, {"c.jsonl.gz": gzip.compress(b'{"text": "a"}\n' * 10)})
    assert count(16, small + packed, 1024) == 16  # a compressed size bounds nothing


def test_many_workers_on_a_small_input_start_one_process(tmp_path, monkeypatch):
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n"
                                              for i in range(30)))
    started = []
    real = prepare_lib.start_pool
    monkeypatch.setattr(prepare_lib, "start_pool",
                        lambda n, enc: started.append(n) or real(n, enc))
    cfg = PrepareConfig(sources=(str(tmp_path / "d.jsonl"),), out=str(tmp_path / "many"),
                        workers=64, eval_fraction=0.2)
    many = prepare(cfg, created_by="t")
    assert started == [1]
    one = prepare(PrepareConfig(sources=cfg.sources, out=str(tmp_path / "zero"), workers=0,
                                eval_fraction=0.2), created_by="t")
    assert many == one
    for p in (tmp_path / "zero").iterdir():
        assert (tmp_path / "many" / p.name).read_bytes() == p.read_bytes(), p.name
