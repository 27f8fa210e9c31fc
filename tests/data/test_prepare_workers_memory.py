"""How many tokenizing workers `data prepare` starts when memory is short (`prepare_workers`): a
worker's peak is sized from the chunks its inputs make (`readers.chunk_text_bytes`, checked
against the chunks the readers really make), the count is what MEMORY_SHARE of the memory
available holds (never fewer than one), a count below the one asked is said in one line on
stderr, and the shards are the same bytes whatever the count. The memory available is read
from /proc/meminfo and the cgroup limits (v2 and v1), checked on fake trees."""
import gzip
import json
import os
import random
import string

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from dropless import cli
from dropless.data import prepare_workers as pw
from dropless.data import readers
from dropless.data.prepare import PrepareConfig, prepare
from tests._support.prepare_memory import worker_peak

MiB = 1 << 20
TEXTS = [f"doc {i} " + "word é " * (i % 37) for i in range(600)]   # 'é': 2 UTF-8 bytes


def _jsonl(texts) -> bytes:
    return "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("inputs")
    (d / "a.jsonl.gz").write_bytes(gzip.compress(_jsonl(TEXTS[:200])))
    (d / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(_jsonl(TEXTS[200:400])))
    table = pa.table({"n": list(range(200)), "text": TEXTS[400:]})
    pq.write_table(table, d / "c.parquet", row_group_size=70)
    with pa.OSFile(str(d / "d.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        for b in table.to_batches(max_chunksize=45):
            w.write_batch(b)
    with pa.OSFile(str(d / "e.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    (d / "f.jsonl").write_bytes(_jsonl(TEXTS[:50]))
    (d / "g.txt").write_text("some text\n" * 30)
    return d


@pytest.mark.parametrize("name", ["c.parquet", "d.arrow", "e.arrow", "f.jsonl", "g.txt"])
@pytest.mark.parametrize("records_per_chunk", [16, 1024])
def test_a_chunks_text_is_sized_as_the_readers_make_it(inputs, name, records_per_chunk):
    """The estimate covers the largest chunk read, and is near it where the records are alike
    (Parquet's plain encoding adds 4 bytes a row to the text's)."""
    (f,) = readers.input_files(str(inputs / name))
    largest = max(sum(len(t.encode()) for t in readers.chunk_texts(f, c, "text"))
                  for c in readers.text_chunks(f, "text", records_per_chunk=records_per_chunk))
    est = readers.chunk_text_bytes(f, "text", records_per_chunk)
    if f.kind in ("parquet", "arrow"):       # rows of varied length: the mean row times rows
        assert 0.5 * largest <= est <= 1.5 * largest + 8 * records_per_chunk, (est, largest)
    else:                                    # a text file's chunk is itself; JSONL: its lines
        assert largest <= est <= max(f.size, largest), (est, largest)


def test_a_compressed_jsonl_chunk_is_sized_by_its_byte_limit(inputs):
    for name in ("a.jsonl.gz", "b.jsonl.zst"):
        (f,) = readers.input_files(str(inputs / name))
        assert readers.chunk_text_bytes(f, "text") == readers.CHUNK_BYTES


def test_a_worker_is_sized_by_the_kind_of_its_largest_chunks(inputs, tmp_path):
    files = [f for n in ("f.jsonl", "g.txt") for f in readers.input_files(str(inputs / n))]
    each, file, text = pw.worker_memory(files, "text", 1024, "byte")
    by_file = {f.path.name: readers.chunk_text_bytes(f, "text") for f in files}
    costs = {"f.jsonl": (pw.ENCODE_PEAK["records", "byte"] + pw.QUEUED_PEAK) * by_file["f.jsonl"],
             "g.txt": (pw.ENCODE_PEAK["text", "byte"] + pw.QUEUED_PEAK) * by_file["g.txt"]}
    worst = max(costs, key=costs.get)
    assert (file.path.name, text, each) == (worst, by_file[worst],
                                             pw.WORKER_BYTES + costs[worst])
    tok = tmp_path / "tokenizer.json"
    tok.write_bytes(b" " * 1000)
    # f.jsonl's one chunk, under SLICE_BYTES, is one slice of Encodings
    assert worst == "f.jsonl" and text < pw.SLICE_BYTES
    assert pw.worker_memory(files, "text", 1024, str(tok))[0] == (
        pw.WORKER_BYTES + pw.TOKENIZER_PEAK * 1000 + text *
        (pw.ENCODE_PEAK["records", "tokenizer.json"] + pw.SLICE_PEAK + pw.QUEUED_PEAK))


MB = 10 ** 6


@pytest.mark.parametrize("chunk, tokenizer, text, records, slice_, piece", [
    ("records", "byte", 20 * MB, 1024, 0, 0),                   # no Encodings
    ("records", "tokenizer.json", 20 * MB, 1024, MiB, 0),        # 1,024 records of 20 KB
    ("records", "tokenizer.json", MB // 2, 1024, MB // 2, 0),    # the chunk is one slice
    ("records", "tokenizer.json", 1024 * 5 * MB, 1024, 0, MiB),  # a 5 MB record: in pieces
    ("records", "tokenizer.json", 8 * MB, 1, 0, MiB),            # one record a chunk
    ("records", "tokenizer.json", 4 * MiB, 8, 0, MiB // 2),      # records of half a slice
    ("text", "tokenizer.json", 16 * MB, 1024, 0, MiB),           # a text file: its pieces
    ("text", "tokenizer.json", MB // 4, 1024, 0, MB // 4),       # a small one: one piece
    ("text", "byte", 16 * MB, 1024, 0, 0),
])
def test_a_chunks_peak_is_its_bytes_and_its_largest_slice_or_piece(chunk, tokenizer, text,
                                                                   records, slice_, piece):
    got = pw.encode_peak(chunk, tokenizer, text, records)
    assert got == (pw.ENCODE_PEAK[chunk, tokenizer] * text + pw.SLICE_PEAK * slice_
                   + pw.PIECE_PEAK * piece)


def test_the_count_is_what_the_memory_available_holds(inputs):
    files = [f for n in ("a.jsonl.gz", "c.parquet") for f in readers.input_files(str(inputs / n))]
    each = pw.worker_memory(files, "text", 1024, "byte")[0]
    # a.jsonl.gz's chunks (4 MiB of text at most, its content size unknown) are the largest
    per_byte = pw.ENCODE_PEAK["records", "byte"] + pw.QUEUED_PEAK
    assert each == pw.WORKER_BYTES + per_byte * readers.CHUNK_BYTES
    for fit in (1, 2, 7, 64):
        room = int(fit * each / pw.MEMORY_SHARE) + 1
        got = pw.worker_count(64, files, 1024, available=room)
        assert got.count == fit and (got.note is None) == (fit == 64), (fit, got)
        assert pw.worker_count(fit, files, 1024, available=room) == pw.WorkerCount(count=fit)
    tiny = pw.worker_count(8, files, 1024, available=1)
    assert tiny.count == 1 and "starts 1 tokenizing worker, not the 8" in tiny.note
    assert pw.worker_count(0, files, 1024, available=1) == pw.WorkerCount(count=0)


def test_the_note_is_one_line_naming_asked_started_and_why(inputs):
    files = readers.input_files(str(inputs / "c.parquet"))
    each, _, text = pw.worker_memory(files, "text", 1024, "byte")
    room = int(3 * each / pw.MEMORY_SHARE) + 1      # + 1: room * MEMORY_SHARE may round down
    note = pw.worker_count(12, files, 1024, available=room).note
    assert note == (f"note: data prepare starts 3 tokenizing workers, not the 12 of --workers: "
                    f"each may take ~{round(each / MiB)} MiB at its peak (the byte tokenizer, "
                    f"chunks of ~{round(text / MiB)} MiB of text in {inputs / 'c.parquet'}) and "
                    f"{round(room / MiB)} MiB of memory is "
                    "available; the output is the same")


def test_an_arrow_batch_is_read_in_chunks_of_records_per_chunk(tmp_path):
    table = pa.table({"text": TEXTS[:100]})
    with pa.OSFile(str(tmp_path / "one.arrow"), "wb") as sink, \
            pa.ipc.new_stream(sink, table.schema) as w:
        w.write_batch(table.to_batches()[0])             # one batch of 100 rows
    (f,) = readers.input_files(str(tmp_path / "one.arrow"))
    chunks = list(readers.text_chunks(f, "text", start=3, records_per_chunk=16))
    assert [c.indices[0] for c in chunks] == list(range(3, 100, 16))
    assert [t for c in chunks for t in c.payload] == TEXTS[3:100]


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="Linux's /proc")
@pytest.mark.parametrize("tokenizer", ["byte", "tokenizer.json"])
def test_a_worker_encoding_a_chunk_stays_under_its_estimate(tmp_path, tokenizer):
    """Measured as the kernel counts it: a worker's VmHWM while it encodes one chunk (2.6 MB of
    text: more than one slice), less its VmRSS before, against `encode_peak`; the text is random
    characters, for which the tokenizer.json, the tests' 120-token BPE, makes ~0.99 tokens a
    byte: the densest case the estimate covers."""
    from tests._support.tokenizer_folders import reference_tokenizer
    rng = random.Random(0)
    chars = string.ascii_letters + string.digits + string.punctuation + " é\n"
    text = "".join(rng.choice(chars) for _ in range(2600))
    pq.write_table(pa.table({"text": [text[i % 50:] for i in range(1024)]}),
                   tmp_path / "c.parquet")
    (f,) = readers.input_files(str(tmp_path / "c.parquet"))
    chunk = next(readers.text_chunks(f, "text"))
    size = sum(len(t.encode()) for t in chunk.payload)
    if tokenizer == "byte":
        enc = pw.Encoder(tokenizer="byte", dtype="uint16", bos=None, eos=0)
    else:
        reference_tokenizer().save(str(tmp_path / "tokenizer.json"))
        enc = pw.Encoder(tokenizer=str(tmp_path / "tokenizer.json"), dtype="uint16", bos=1,
                         eos=2)
    lengths, used = worker_peak(enc, f, chunk)
    assert len(lengths) == 1024
    est = pw.encode_peak("records", tokenizer, size, 1024)
    assert 0.4 * est <= used <= est, (used, est, size)


def _sources(inputs):
    return tuple(str(inputs / n) for n in ("a.jsonl.gz", "b.jsonl.zst", "c.parquet", "e.arrow"))


def test_any_worker_count_writes_the_same_bytes(inputs, tmp_path, monkeypatch, capfd):
    def run(name, workers, available):
        monkeypatch.setattr(pw, "available_memory", lambda: available)
        cfg = PrepareConfig(sources=_sources(inputs), out=str(tmp_path / name), workers=workers,
                            eval_fraction=0.1, shard_tokens=2000, records_per_chunk=16)
        return prepare(cfg, created_by="t"), capfd.readouterr().err
    each = pw.worker_memory(readers.input_files(str(inputs / "a.jsonl.gz")), "text", 16,
                            "byte")[0]
    ref, err = run("w0", 0, None)
    assert "note:" not in err
    for name, workers, available, started in (("w3", 3, None, 3),
                                              ("capped", 3, int(2 * each / pw.MEMORY_SHARE), 2)):
        m, err = run(name, workers, available)
        notes = [ln for ln in err.splitlines() if ln.startswith("note:")]
        assert len(notes) == (workers != started), err
        if notes:
            assert notes[0].startswith(f"note: data prepare starts {started} tokenizing workers, "
                                       f"not the {workers} of --workers: each may take ~")
        assert m == ref
        assert sorted(os.listdir(tmp_path / name)) == sorted(os.listdir(tmp_path / "w0"))
        for p in (tmp_path / "w0").iterdir():
            assert (tmp_path / name / p.name).read_bytes() == p.read_bytes(), (name, p.name)


def test_the_cli_prints_the_note_on_stderr(inputs, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(pw, "available_memory", lambda: 1)
    rc = cli.main(["data", "prepare", str(inputs / "c.parquet"), str(tmp_path / "o"),
                   "--tokenizer", "byte", "--workers", "4"])
    out = capsys.readouterr()
    notes = [ln for ln in out.err.splitlines() if ln.startswith("note:")]
    assert rc == 0 and len(notes) == 1, out.err
    assert notes[0].startswith("note: data prepare starts 1 tokenizing worker, not the 4 of "
                               "--workers: each may take ~") and "c.parquet" in notes[0]
    assert "note:" not in out.out


# --- the memory available -----------------------------------------------------------------

def _tree(tmp_path, files: dict) -> tuple[str, str]:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return str(tmp_path / "proc"), str(tmp_path / "cg")


MEMINFO = "MemTotal:       64000000 kB\nMemAvailable:   20000000 kB\n"


def test_memory_available_is_meminfo_without_a_cgroup_limit(tmp_path):
    proc, cg = _tree(tmp_path, {"proc/meminfo": MEMINFO,
                                "proc/self/cgroup": "4:memory:/job\n1:cpu:/job\n",
                                "cg/memory/job/memory.limit_in_bytes": "9223372036854771712\n",
                                "cg/memory/job/memory.usage_in_bytes": "1000\n"})
    assert pw.available_memory(proc, cg) == 20000000 * 1024


def test_a_cgroup_v2_limit_binds_less_its_usage_and_not_its_cache(tmp_path):
    proc, cg = _tree(tmp_path, {"proc/meminfo": MEMINFO, "proc/self/cgroup": "odd line\n0::/a/b\n",
                                "cg/a/b/memory.max": "max\n",
                                "cg/a/memory.max": f"{8 << 30}\n",      # the parent's binds
                                "cg/a/memory.current": f"{3 << 30}\n",
                                "cg/a/memory.stat": f"anon 1\ninactive_file {1 << 30}\n"})
    assert pw.available_memory(proc, cg) == (8 << 30) - (2 << 30)


def test_a_cgroup_v1_limit_binds(tmp_path):
    proc, cg = _tree(tmp_path, {"proc/meminfo": MEMINFO, "proc/self/cgroup": "7:memory:/\n",
                                "cg/memory/memory.limit_in_bytes": f"{4 << 30}\n",
                                "cg/memory/memory.usage_in_bytes": f"{5 << 30}\n",
                                "cg/memory/memory.stat": "total_inactive_file 0\n"})
    assert pw.available_memory(proc, cg) == 0          # over its limit: nothing left


def test_without_meminfo_free_pages_count_or_nothing_bounds(tmp_path):
    got = pw.available_memory(str(tmp_path / "none"), str(tmp_path / "none"))
    assert got is None if "SC_AVPHYS_PAGES" not in os.sysconf_names else got > 0
