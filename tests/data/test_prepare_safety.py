"""`data prepare` safety: one writer per output (two real processes), resumable from the first
token (a kill before and after the first shard), inputs identified by content (`cp -p` of other
bytes), a file reached twice refused (named twice, glob + name, a link)."""
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from dropless.data import manifest as mf
from dropless.data.prepare import PrepareConfig, prepare


class Killed(Exception):
    pass


def _src(tmp_path, n=200, name="a.jsonl"):
    p = tmp_path / name
    p.write_text("".join(f'{{"text": "document number {i} of the corpus"}}\n' for i in range(n)))
    return p


def _kill_after(src, out, shards: int) -> None:
    """Run prepare into `out` and kill it (an exception from its progress callback) once it has
    written `shards` shards and read a document; a fake clock reports progress at every
    document."""
    def stop(p):
        if p.shards >= shards and p.documents > 0:
            raise Killed
    import dropless.data.prepare as prep
    saved = prep.time.monotonic
    prep.time.monotonic = iter(range(0, 10 ** 6, 1)).__next__
    try:
        with pytest.raises(Killed):
            prepare(_cfg(src, out), created_by="t", on_progress=stop)
    finally:
        prep.time.monotonic = saved


def _cfg(src, out, **kw):
    return PrepareConfig(**{**dict(sources=(str(src),), out=str(out), eval_fraction=0.1,
                                   shard_tokens=2000, workers=0, records_per_chunk=8), **kw})


HOLDER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from dropless.data.prepare_lock import PrepareLock
    lock = PrepareLock(Path(sys.argv[1]) / ".prepare")
    print("locked", flush=True)
    sys.stdin.readline()
""")


def test_a_second_writer_is_refused_and_a_dead_holders_lock_is_taken_over(tmp_path):
    src, out = _src(tmp_path), tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ValueError, match=rf"another `data prepare` \(pid {holder.pid} on "):
            prepare(_cfg(src, out), created_by="t")
        assert (out / ".prepare" / "lock").exists(), "the refused run left the holder's lock"
    finally:
        holder.kill()            # SIGKILL: the kernel releases its flock
        holder.wait()
    m = prepare(_cfg(src, out), created_by="t")
    assert m == mf.read_manifest(out)
    whole = prepare(_cfg(src, tmp_path / "whole"), created_by="t")
    assert m.splits == whole.splits


def test_two_real_prepares_at_once_one_is_refused(tmp_path):
    src, out = _src(tmp_path, n=400), tmp_path / "out"
    run = textwrap.dedent(f"""
        import sys
        from dropless.data.prepare import PrepareConfig, prepare
        def hold(p):
            print("working", flush=True)
            sys.stdin.readline()
        prepare(PrepareConfig(sources=({str(src)!r},), out={str(out)!r}, workers=0,
                              records_per_chunk=8), created_by="t", on_progress=hold)
    """)
    first = subprocess.Popen([sys.executable, "-c", run], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "working"
        second = subprocess.run([sys.executable, "-c", run], stdin=subprocess.DEVNULL,
                                capture_output=True, text=True, timeout=300)
        assert second.returncode != 0
        assert f"another `data prepare` (pid {first.pid} on" in second.stderr
        first.stdin.write("\n" * 10000)
        first.stdin.close()
        assert first.wait(timeout=300) == 0
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    m = mf.read_manifest(out)
    for s in ("train", "eval"):
        for sh in m.splits[s]:
            assert mf.file_sha256(out / sh.tokens_file) == sh.sha256


@pytest.mark.parametrize("after_shards", [0, 1, 2])
def test_a_kill_at_any_point_resumes_to_the_same_dataset(tmp_path, after_shards):
    src, out = _src(tmp_path, n=300), tmp_path / "out"
    whole = prepare(_cfg(src, tmp_path / "whole"), created_by="t")
    assert len(whole.splits["train"]) > 2

    _kill_after(src, out, after_shards)
    assert (out / ".prepare" / "state.json").is_file()
    assert prepare(_cfg(src, out), created_by="t") == whole
    for p in (tmp_path / "whole").iterdir():
        assert (out / p.name).read_bytes() == p.read_bytes(), p.name


KILLED_RUN = textwrap.dedent("""
    import os, signal, sys
    from dropless.data.prepare import PrepareConfig, prepare
    def hold(p):
        print("working", flush=True)
        sys.stdin.readline()
    prepare(PrepareConfig(sources=(sys.argv[1],), out=sys.argv[2], workers=0,
                          eval_fraction=0.1, shard_tokens=10 ** 9, records_per_chunk=8),
            created_by="t", on_progress=hold)
""")


def test_sigkill_before_the_first_shard_resumes(tmp_path):
    src, out = _src(tmp_path), tmp_path / "out"
    p = subprocess.Popen([sys.executable, "-c", KILLED_RUN, str(src), str(out)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "working"
    p.kill()
    p.wait()
    cfg = _cfg(src, out, shard_tokens=10 ** 9)
    assert prepare(cfg, created_by="t") == prepare(
        _cfg(src, tmp_path / "whole", shard_tokens=10 ** 9), created_by="t")


def test_a_regenerated_input_of_the_same_size_and_time_is_refused(tmp_path):
    src, out = _src(tmp_path), tmp_path / "out"

    def stop(p):
        raise Killed
    with pytest.raises(Killed):
        prepare(_cfg(src, out), created_by="t", on_progress=stop)
    other = tmp_path / "other.jsonl"
    other.write_text(src.read_text().replace("number", "NUMBER"))
    assert other.stat().st_size == src.stat().st_size
    st = src.stat()
    shutil.copyfile(other, src)
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(ValueError, match="unfinished prepare.*input file changed"):
        prepare(_cfg(src, out), created_by="t")


def test_a_file_reached_twice_is_refused(tmp_path):
    src = _src(tmp_path)
    (tmp_path / "link.jsonl").symlink_to(src)
    for n, sources in enumerate([(str(src), str(src)),
                                 (str(src), str(tmp_path / "*.jsonl")),
                                 (str(src), str(tmp_path / "link.jsonl") + "@2")]):
        out = tmp_path / f"out{n}"
        with pytest.raises(ValueError, match=r"(a|link)\.jsonl \(source .* is also read by source"):
            prepare(PrepareConfig(sources=sources, out=str(out), workers=0), created_by="t")
        assert not out.exists()


@pytest.mark.parametrize("where", ["source", "in a folder", "by a glob"])
@pytest.mark.parametrize("link", ["dangling", "self"])
def test_a_link_to_nothing_is_an_error_never_a_skip(tmp_path, where, link):
    d = tmp_path / "d"
    d.mkdir()
    _src(d)
    bad = d / "b.jsonl"
    bad.symlink_to(tmp_path / "gone.jsonl" if link == "dangling" else bad)
    source = {"source": str(bad), "in a folder": str(d), "by a glob": str(d / "*.jsonl")}[where]
    with pytest.raises(ValueError, match=r"b\.jsonl.* is a link to nothing"):
        prepare(PrepareConfig(sources=(source,), out=str(tmp_path / "o"), workers=0),
                created_by="t")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("tokenizer", ["byte", "hf"])
@pytest.mark.parametrize("workers", [0, 1])
def test_a_record_that_cannot_be_encoded_is_named_and_the_rerun_works(
        tmp_path, tokenizer, workers):
    from tests._support.tokenizer_folders import FOLDERS, write_folder
    tok = "byte" if tokenizer == "byte" else str(
        write_folder(tmp_path / "tok", *FOLDERS["llama"]) / "tokenizer.json")
    src = _src(tmp_path, n=50)
    good = src.read_text()
    lines = good.splitlines(keepends=True)
    src.write_text("".join(lines[:30]) + '{"text": "bad \\ud800 here"}\n' + "".join(lines[30:]))
    cfg = _cfg(src, tmp_path / "o", tokenizer=tok, workers=workers, shard_tokens=50)
    with pytest.raises(ValueError, match=r"a\.jsonl line 31: .*lone surrogate"):
        prepare(cfg, created_by="t")
    src.write_text(good)
    fixed = prepare(cfg, created_by="t")
    whole = prepare(_cfg(src, tmp_path / "whole", tokenizer=tok, workers=workers,
                         shard_tokens=50), created_by="t")
    assert fixed.splits == whole.splits


def test_invalid_utf8_in_a_text_file_is_named_by_line(tmp_path):
    t = tmp_path / "a.txt"
    t.write_bytes(b"fine\nfine\nbad \xff here\n")
    with pytest.raises(ValueError, match=r"a\.txt line 3 is not valid UTF-8"):
        prepare(PrepareConfig(sources=(str(t),), out=str(tmp_path / "o"), workers=0,
                              eval_fraction=0), created_by="t")


def test_files_are_read_byte_exact(tmp_path):
    from dropless.data import readers
    t, j = tmp_path / "a.txt", tmp_path / "b.jsonl"
    t.write_bytes(b"one\r\ntwo\rthree\n")
    j.write_bytes(b'{"text": "one\\r\\ntwo"}\r\n')
    (ft,), (fj,) = readers.input_files(str(t)), readers.input_files(str(j))
    assert [c.payload for c in readers.text_chunks(ft, "text")] == [["one\r\ntwo\rthree\n"]]
    (chunk,) = readers.text_chunks(fj, "text")
    assert readers.chunk_texts(fj, chunk, "text") == ["one\r\ntwo"]
    m = prepare(PrepareConfig(sources=(str(t),), out=str(tmp_path / "o"), workers=0,
                              eval_fraction=0, add_eos=False), created_by="t")
    tokens = np.fromfile(tmp_path / "o" / m.splits["train"][0].tokens_file, dtype=m.dtype)
    assert bytes(tokens.astype(np.uint8).tolist()) == t.read_bytes()


def test_a_dictionary_encoded_string_column_is_read_as_strings(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from dropless.data import readers
    texts = ["red fox", "blue fox", "red fox", None and "x" or "green"]
    p = tmp_path / "c.parquet"
    pq.write_table(pa.table({"text": pa.array(texts).dictionary_encode()}), p)
    assert pa.types.is_dictionary(pq.read_schema(p).field("text").type)
    (f,) = readers.input_files(str(p))
    assert [t for c in readers.text_chunks(f, "text") for t in c.payload] == texts
    plain = tmp_path / "plain.parquet"
    pq.write_table(pa.table({"text": texts}), plain)
    a = prepare(PrepareConfig(sources=(str(p),), out=str(tmp_path / "o1"), workers=0,
                              eval_fraction=0), created_by="t")
    b = prepare(PrepareConfig(sources=(str(plain),), out=str(tmp_path / "o2"), workers=0,
                              eval_fraction=0), created_by="t")
    assert a.splits == b.splits


@pytest.mark.parametrize("change", ["grow", "truncate"])
def test_an_input_that_changes_while_read_is_refused_not_recorded(tmp_path, change):
    """The manifest records each input's sha256 and size from before the read: a file appended
    to (or cut) while it was read gave a dataset of other documents under that hash, reported
    as a success (or a misleading 'invalid JSON' at the cut). Refused naming the file; what
    the run wrote is removed (the same command on the new file starts afresh)."""
    src, out = _src(tmp_path, n=300), tmp_path / "out"
    original = src.read_bytes()

    def edit(p):
        if change == "grow":
            with open(src, "a") as f:
                f.write('{"text": "appended while prepare read the file"}\n' * 50)
        else:
            os.truncate(src, src.stat().st_size // 2 + 7)   # inside a line
    with pytest.raises(ValueError, match=r"a\.jsonl changed while `data prepare` read it"):
        prepare(_cfg(src, out), created_by="t", on_progress=edit)
    assert not out.exists()
    src.write_bytes(original)
    m = prepare(_cfg(src, out), created_by="t")
    assert m.sources[0].sha256 == mf.file_sha256(src)


@pytest.mark.parametrize("damage", ["truncate", "delete", "rewrite"])
def test_a_finished_shard_damaged_before_the_resume_is_refused(tmp_path, damage):
    """A resume kept the shards its state records without looking at them: one deleted, cut
    or rewritten since gave a manifest naming a missing or other shard, reported as a success."""
    src, out = _src(tmp_path, n=300), tmp_path / "out"

    _kill_after(src, out, 2)
    shard = out / "train-00000.tokens"
    if damage == "truncate":
        os.truncate(shard, 10)
    elif damage == "delete":
        shard.unlink()
    else:
        shard.write_bytes(bytes(reversed(shard.read_bytes())))
    with pytest.raises(ValueError, match=r"train-00000\.tokens.*since .* wrote it.*remove"):
        prepare(_cfg(src, out), created_by="t")
    assert not (out / mf.MANIFEST).exists()
