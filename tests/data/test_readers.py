"""Record readers: every format gives the same records as the library that wrote it reads back,
chunks resume at any index, sources expand in a stable order, and each bad record is named by
file and line or row."""
import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from dropless.data import readers

RECS = [{"text": f"doc {i} " * (i % 4), "n": i} for i in range(50)]


def _jsonl(recs, blank_at=(3,)) -> bytes:
    lines = [json.dumps(r) for r in recs]
    for i in blank_at:
        lines.insert(i, "  ")
    return ("\n".join(lines) + "\n").encode()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("fmt")
    (d / "a.jsonl").write_bytes(_jsonl(RECS))
    with gzip.open(d / "a.jsonl.gz", "wb") as f:
        f.write(_jsonl(RECS))
    # two zstd frames: read across them
    c = zstandard.ZstdCompressor()
    raw = _jsonl(RECS)
    (d / "a.jsonl.zst").write_bytes(c.compress(raw[:200]) + c.compress(raw[200:]))
    table = pa.Table.from_pylist(RECS)
    pq.write_table(table, d / "a.parquet", row_group_size=7)
    with pa.OSFile(str(d / "file.arrow"), "wb") as sink, pa.ipc.new_file(sink,
                                                                          table.schema) as w:
        for b in table.to_batches(max_chunksize=9):
            w.write_batch(b)
    # datasets.save_to_disk's layout: Arrow *stream* files named by state.json
    saved = d / "saved"
    saved.mkdir()
    for k, part in enumerate((table.slice(0, 20), table.slice(20))):
        with pa.OSFile(str(saved / f"data-0000{k}-of-00002.arrow"), "wb") as sink, \
                pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(part)
    (saved / "state.json").write_text(json.dumps({"_data_files": [
        {"filename": "data-00000-of-00002.arrow"}, {"filename": "data-00001-of-00002.arrow"}]}))
    (saved / "dataset_info.json").write_text("{}")
    return d


@pytest.mark.parametrize("name", ["a.jsonl", "a.jsonl.gz", "a.jsonl.zst", "a.parquet",
                                  "file.arrow", "saved"])
def test_every_format_gives_the_records(files, name):
    got = [(i, r) for f in readers.input_files(str(files / name)) for i, r in readers.records(f)]
    if name.startswith("a.jsonl"):   # line index; the blank line 3 is skipped
        want = [(i if i < 3 else i + 1, r) for i, r in enumerate(RECS)]
    elif name == "saved":            # rows per file
        want = [(i if i < 20 else i - 20, r) for i, r in enumerate(RECS)]
    else:
        want = list(enumerate(RECS))
    assert got == want


@pytest.mark.parametrize("name", ["a.jsonl.zst", "a.parquet", "file.arrow"])
@pytest.mark.parametrize("start", [0, 5, 13, 49, 60])
def test_text_chunks_from_any_start(files, name, start):
    (f,) = readers.input_files(str(files / name))
    all_recs = list(readers.records(f))
    got = [(i, t) for c in readers.text_chunks(f, "text", start=start, records_per_chunk=4)
           for i, t in zip(c.indices, readers.chunk_texts(f, c, "text"))]
    assert got == [(i, r["text"]) for i, r in all_recs if i >= start]


def test_directory_glob_names_and_weights(tmp_path, files):
    (tmp_path / "x" / "y").mkdir(parents=True)
    for p in ("x/b.jsonl", "x/y/a.txt", "x/a.parquet"):
        (tmp_path / p).write_bytes((files / ("a.parquet" if p.endswith("parquet")
                                             else "a.jsonl")).read_bytes())
    (tmp_path / "x" / "skip.bin").write_bytes(b"\0")
    got = readers.input_files(str(tmp_path / "x"))
    assert [f.name for f in got] == ["a.parquet", "b.jsonl", "y/a.txt"]
    assert [f.kind for f in got] == ["parquet", "jsonl", "text"]
    with pytest.raises(ValueError, match="skip.bin is not a format dropless reads"):
        readers.input_files(str(tmp_path / "x" / "**" / "*.*"))    # named: refused, not skipped
    (tmp_path / "x" / "skip.bin").unlink()
    g = readers.input_files(str(tmp_path / "x" / "**" / "*.*") + "@2.5")
    assert [f.name for f in g] == ["a.parquet", "b.jsonl", "y/a.txt"]   # below the glob root
    assert {f.weight for f in g} == {2.5}
    both = readers.input_files(str(tmp_path / "x" / "**"))      # the folders and their files
    assert [f.name for f in both] == ["a.parquet", "b.jsonl", "y/a.txt"]
    assert readers.identity(g[1], 4) == "b.jsonl:4" and readers.identity(g[2], 0) == "y/a.txt"
    (tmp_path / "odd@name.jsonl").write_bytes((files / "a.jsonl").read_bytes())
    assert readers.parse_source(str(tmp_path / "odd@name.jsonl")) == (
        str(tmp_path / "odd@name.jsonl"), 1.0)


def test_dataset_dict_reads_train_or_says_which_splits(tmp_path, files):
    import shutil
    shutil.copytree(files / "saved", tmp_path / "dd" / "train")
    (tmp_path / "dd" / "dataset_dict.json").write_text('{"splits": ["train"]}')
    assert len(readers.input_files(str(tmp_path / "dd"))) == 2
    (tmp_path / "dd" / "dataset_dict.json").write_text('{"splits": ["test"]}')
    with pytest.raises(ValueError, match="splits test and no 'train'"):
        readers.input_files(str(tmp_path / "dd"))


def _texts(path, field="text"):
    return [t for f in readers.input_files(str(path)) for c in readers.text_chunks(f, field)
            for t in readers.chunk_texts(f, c, field)]


BAD_LINES = [
    (b'{"text": "a"}\n{"body": "b"}\n', "x.jsonl line 2 has no 'text' field (its fields: body)"),
    (b'{"text": "a"}\n{"text": 3}\n', "x.jsonl line 2: 'text' must be a string, not an int"),
    (b'{"text": "a"}\n{"text": \n', "x.jsonl line 2, column"),
    (b'[1]\n', "x.jsonl line 1 is a list, not a JSON object"),
    (b'{"text": "a"}\n{"text": "\xff"}\n', "x.jsonl line 2, column 11: not valid UTF-8"),
    # deeper than Python's parser recurses: a RecursionError (exit 1, no file named) before
    (b'{"text": "a"}\n{"text": "b", "x": ' + b"[" * 100000 + b"]" * 100000 + b"}\n",
     "x.jsonl line 2 is nested deeper than"),
]


@pytest.mark.parametrize("data,words", BAD_LINES)
def test_bad_jsonl_records_are_named(tmp_path, data, words):
    (tmp_path / "x.jsonl").write_bytes(data)
    with pytest.raises(ValueError) as e:
        _texts(tmp_path / "x.jsonl")
    assert words in str(e.value)


def test_a_number_of_any_length_elsewhere_in_a_record_is_valid_json(tmp_path):
    """JSON numbers have no length limit; Python's int() refuses above 4,300 digits with a
    ValueError that named no file (and refused a valid record whose text was fine)."""
    (tmp_path / "x.jsonl").write_bytes(b'{"text": "a", "id": ' + b"7" * 5000 + b'}\n')
    assert _texts(tmp_path / "x.jsonl") == ["a"]
    (f,) = readers.input_files(str(tmp_path / "x.jsonl"))
    assert next(readers.records(f))[1]["id"] == (10 ** 5000 - 1) // 9 * 7


def test_a_folder_reads_the_files_under_its_links_to_folders(tmp_path):
    """A link to a folder is followed, as a glob's `**` follows it (pathlib's rglob did not:
    the files under it were skipped without a word); a link back to a folder above it (an
    endless tree) is refused naming it."""
    (tmp_path / "data" / "sub").mkdir(parents=True)
    (tmp_path / "other").mkdir()
    (tmp_path / "data" / "sub" / "x.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "other" / "y.jsonl").write_text('{"text": "y"}\n')
    (tmp_path / "data" / "linked").symlink_to(tmp_path / "other")
    files = readers.input_files(str(tmp_path / "data"))
    assert [f.name for f in files] == ["linked/y.jsonl", "sub/x.jsonl"]
    assert _texts(tmp_path / "data") == ["y", "x"]
    (tmp_path / "data" / "sub" / "loop").symlink_to(tmp_path / "data")
    with pytest.raises(ValueError, match=r"sub/loop is a link to .*data, a folder above it"):
        readers.input_files(str(tmp_path / "data"))


def test_bad_columns_are_named(tmp_path):
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "int.parquet")
    with pytest.raises(ValueError, match="int.parquet: column 'text' is int64, not a string"):
        _texts(tmp_path / "int.parquet")
    pq.write_table(pa.table({"body": ["a"]}), tmp_path / "other.parquet")
    with pytest.raises(ValueError, match="has no column 'text' .its columns: body."):
        _texts(tmp_path / "other.parquet")
    assert _texts(tmp_path / "other.parquet", "body") == ["a"]
    pq.write_table(pa.table({"text": ["a", None]}), tmp_path / "null.parquet")
    with pytest.raises(ValueError, match="null.parquet row 1: 'text' is null"):
        _texts(tmp_path / "null.parquet")
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match="junk.parquet: not a readable Parquet file"):
        _texts(tmp_path / "junk.parquet")
    (tmp_path / "cut.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
        b'{"text": "a"}\n' * 1000)[:30])
    with pytest.raises(ValueError, match="cut.jsonl.zst: cannot be decompressed"):
        _texts(tmp_path / "cut.jsonl.zst")


def test_bad_sources(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        readers.input_files(str(tmp_path / "none.jsonl"))
    with pytest.raises(ValueError, match="matches no file"):
        readers.input_files(str(tmp_path / "*.parquet"))
    (tmp_path / "e.jsonl").write_bytes(b"")
    with pytest.raises(ValueError, match=r"e.jsonl is empty \(0 bytes\)"):
        readers.input_files(str(tmp_path / "e.jsonl"))
    (tmp_path / "d.json").write_text("[]")
    with pytest.raises(ValueError, match="a .json file is not JSONL"):
        readers.input_files(str(tmp_path / "d.json"))
    with pytest.raises(ValueError, match="weight 'x' after '@' is not a number"):
        readers.parse_source("a.jsonl@x")
    with pytest.raises(ValueError, match="must be > 0"):
        readers.parse_source("a.jsonl@0")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no file dropless reads"):
        readers.input_files(str(tmp_path / "empty"))


def _unreadable(path, monkeypatch) -> None:
    """Make `path` unreadable to this process: its mode 000 where that stops this user; as
    root (which reads any file) the permission check says so for that one file instead."""
    import os
    path.chmod(0)
    if os.geteuid() != 0:
        return
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, *a, **kw: False if (
        os.path.abspath(p) == os.path.abspath(path) and mode & os.R_OK) else real(p, mode))


@pytest.mark.parametrize("command", ["prepare", "train", "train-folder", "train-bin"])
def test_a_file_that_cannot_be_read_is_refused_in_one_line_naming_it(command, tmp_path,
                                                                     monkeypatch, capsys):
    """`data prepare` and training's reader alike: exit 2, one line naming the file and what
    to do, before anything is read or written (no output folder, no run folder)."""
    import numpy as np

    from dropless.cli import main
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("def f(x):\n    return x\n" * 300)
    bad = tmp_path / "d" / ("b.bin" if command == "train-bin" else "b.txt")
    if command == "train-bin":
        np.arange(5000, dtype=np.uint16).tofile(bad)
    else:
        bad.write_text("def g(y):\n    return y\n" * 300)
    _unreadable(bad, monkeypatch)
    source = "d" if command in ("prepare", "train-folder") else f"d/{bad.name}"
    argv = (["data", "prepare", source, "out", "--tokenizer", "byte", "--workers", "0"]
            if command == "prepare" else
            ["train", f"data={source}", "steps=1", "run_dir=runs", "seq_len=32"])
    assert main(argv) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("dropless: error:"), err
    assert str(bad) in err[0] or f"d/{bad.name}" in err[0]
    assert "cannot be read (permission denied)" in err[0] and "read access" in err[0]
    assert not (tmp_path / "out").exists() and not (tmp_path / "runs").exists()
