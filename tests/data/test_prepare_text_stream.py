"""A text file larger than a chunk in `data prepare` (`readers.streamed`): read in parts
(`readers.text_parts`), encoded as it is read in the main process (`stream_document`) and
appended to its shard in parts, it gives the same shards and manifest, byte for byte, as the
whole file given to a worker as one chunk (today's path for a smaller file), for six tokenizer
styles and the byte tokenizer: CJK, emoji and CRLF across the parts' ends, long whitespace
runs, a file with no newline, a byte-order mark, weights (copies read back from the shard),
the eval split and shard cuts around the documents. A run killed inside such a document
resumes to the same shards; bytes that are not UTF-8 deep in it stop the run in one line naming
the line (exit 2), leaving no dataset."""
import json
import random

import numpy as np
import pytest

from dropless import cli
from dropless.data import prepare_workers as pw
from dropless.data import readers
from dropless.data.prepare import PrepareConfig, prepare
from tests._support.tokenizer_styles import STYLE_CORPUS, STYLES, build


def _book(size: int, seed: int) -> str:
    """Corpus lines between runs of 700 spaces, newlines, CRLFs, tabs, emoji and CJK: parts of
    7,001 bytes end inside each of them somewhere, at least `size` characters."""
    rng = random.Random(seed)
    fills = [" " * 700, "\n" * 60, "\r\n" * 30, "\N{GRINNING FACE}" * 9, "日本語" * 30,
             "\t \n " * 50, ""]
    out, n = [], 0
    while n < size:
        out.append(rng.choice(STYLE_CORPUS) + rng.choice(fills))
        n += len(out[-1])
    return "".join(out)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Three streamed text files and a JSONL file between them."""
    d = tmp_path_factory.mktemp("corpus")
    (d / "book.txt").write_bytes(b"\xef\xbb\xbf" + _book(200_000, 0).encode())
    (d / "nonl.txt").write_text(_book(80_000, 1).replace("\n", " ").replace("\r", " "))
    # lines of 7 and 4 bytes: parts of 7,001 bytes end at every byte of them, between CR and
    # LF and inside an é too
    (d / "crlf.txt").write_text("abcde\r\n" * 20_000 + "é\r\n" * 10_000, newline="")
    (d / "recs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n"
                                          for t in STYLE_CORPUS[:40]))
    return d


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    from tokenizers import processors
    root = tmp_path_factory.mktemp("tok")
    out = {}
    for style in STYLES:
        tok = build(style)
        if style == "prepend":      # Llama-2 style: the post-processor puts BOS first
            tok.post_processor = processors.TemplateProcessing(
                single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
        (root / style).mkdir()
        tok.save(str(root / style / "tokenizer.json"))
        config = {"eos_token": "[SEP]"} if style == "bert" else {"eos_token": "</s>",
                                                                  "bos_token": "<s>"}
        (root / style / "tokenizer_config.json").write_text(json.dumps(config))
        out[style] = str(root / style / "tokenizer.json")
    out["byte"] = "byte"
    return out


def _files(out) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def _run(corpus, out, tokenizer, on_progress=None, workers=0):
    srcs = (f"{corpus / 'book.txt'}@2.5", str(corpus / "recs.jsonl"),
            f"{corpus / 'nonl.txt'}@2", str(corpus / "crlf.txt"))
    return prepare(PrepareConfig(sources=srcs, out=str(out), tokenizer=tokenizer,
                                 eval_fraction=0.4, shard_tokens=40_000, workers=workers,
                                 records_per_chunk=8),
                   created_by="t", on_progress=on_progress)


@pytest.fixture
def small(monkeypatch):
    """Slices of 16 KiB and parts of 7,001 bytes: each file is cut and read many times."""
    monkeypatch.setattr(pw, "SLICE_BYTES", 16 << 10)
    monkeypatch.setattr(readers, "TEXT_PART_BYTES", 7001)
    monkeypatch.setattr(readers, "TEXT_WHOLE_BYTES", 1 << 40)
    return monkeypatch


@pytest.mark.parametrize("style", ("byte",) + STYLES)
def test_streamed_text_files_give_the_shards_of_the_whole_file(corpus, tokenizers, small,
                                                               tmp_path, style):
    m = _run(corpus, tmp_path / "whole", tokenizers[style])
    small.setattr(readers, "TEXT_WHOLE_BYTES", 1000)
    streamed = []
    real = readers.text_parts
    small.setattr(readers, "text_parts", lambda f: streamed.append(f.path.name) or real(f))
    m2 = _run(corpus, tmp_path / "parts", tokenizers[style])
    assert streamed == ["book.txt", "nonl.txt", "crlf.txt"]
    assert _files(tmp_path / "parts") == _files(tmp_path / "whole")
    assert m2 == m and len(m.splits["train"]) >= 2 and m.num_documents["eval"] >= 1
    assert m.add_bos == (style == "prepend")


def test_workers_beside_a_streamed_file_write_the_same_bytes(corpus, tokenizers, tmp_path):
    """Two worker processes encode the JSONL's chunks while the main process streams the text
    files between them (at the real slice and part sizes): the shards of workers=0."""
    from unittest import mock
    _run(corpus, tmp_path / "whole", "byte")
    with mock.patch.object(readers, "TEXT_WHOLE_BYTES", 1000):
        m = _run(corpus, tmp_path / "two", "byte", workers=2)
    assert _files(tmp_path / "two") == _files(tmp_path / "whole")
    assert m.num_documents["train"] + m.num_documents["eval"] >= 40


def test_the_streamed_book_is_its_whole_encoding(corpus, tokenizers, small, tmp_path):
    """Against `Tokenizer.encode` on the whole text, not only against the chunk path."""
    from tokenizers import Tokenizer
    small.setattr(readers, "TEXT_WHOLE_BYTES", 1000)
    tok = Tokenizer.from_file(tokenizers["gpt2"])
    text = (corpus / "book.txt").read_bytes()[3:].decode()
    m = prepare(PrepareConfig(sources=(f"{corpus / 'book.txt'}@2",), out=str(tmp_path / "o"),
                              tokenizer=tokenizers["gpt2"], eval_fraction=0, workers=1),
                created_by="t")
    doc = tok.encode(text, add_special_tokens=False).ids + [m.eos_id]
    (shard,) = m.splits["train"]
    got = np.fromfile(tmp_path / "o" / shard.tokens_file, np.dtype(m.dtype).newbyteorder("<"))
    ends = np.fromfile(tmp_path / "o" / shard.docs_file, "<u8")
    assert got.tolist() == doc * 2 and ends.tolist() == [len(doc), 2 * len(doc)]


class Killed(Exception):
    pass


def test_a_run_killed_inside_a_streamed_document_resumes_to_the_same_shards(
        corpus, tokenizers, small, tmp_path):
    import dropless.data.prepare as prep
    small.setattr(readers, "TEXT_WHOLE_BYTES", 1000)
    small.setattr(prep, "WRITE_BUFFER", 4096)     # the open shard reaches its file soon
    _run(corpus, tmp_path / "once", tokenizers["gpt2"])
    small.setattr(prep.time, "monotonic", iter(range(0, 10 ** 9)).__next__)
    before = sum((corpus / n).stat().st_size for n in ("book.txt", "recs.jsonl", "nonl.txt"))
    seen, start = {}, []

    def stop(p):     # inside crlf.txt, 20,000 of its tokens in (its parts are read ahead)
        if p.bytes_done > before and not start:
            start.append(p.tokens)
        if start and p.tokens > start[0] + 20_000:
            assert p.bytes_done < p.bytes_total and p.shards >= 1
            seen.update((x.name, x.read_bytes()) for x in (tmp_path / "out").iterdir()
                        if x.name.endswith(".tmp"))
            raise Killed

    with pytest.raises(Killed):
        _run(corpus, tmp_path / "out", tokenizers["gpt2"], on_progress=stop)
    # a SIGKILL would leave the open shards' temporary files, part of crlf.txt's tokens in one
    assert seen and max(map(len, seen.values())) > 0
    for name, data in seen.items():
        (tmp_path / "out" / name).write_bytes(data)
    state = json.loads((tmp_path / "out" / ".prepare" / "state.json").read_text())
    assert state["shards"]["train"] and state["position"] >= [0, 1]
    _run(corpus, tmp_path / "out", tokenizers["gpt2"])
    assert _files(tmp_path / "out") == _files(tmp_path / "once")


def test_bytes_that_are_not_utf8_deep_in_a_streamed_file_stop_the_run_in_one_line(
        tmp_path, small, capsys):
    small.setattr(readers, "TEXT_WHOLE_BYTES", 1000)
    (tmp_path / "bad.txt").write_bytes(b"line\r\n" * 5000 + b"caf\xe9\n" + b"more\n" * 10)
    rc = cli.main(["data", "prepare", str(tmp_path / "bad.txt"), str(tmp_path / "o"),
                   "--tokenizer", "byte", "--workers", "0"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and err == [f"dropless: error: {tmp_path / 'bad.txt'} line 5001 is not "
                               "valid UTF-8 (invalid continuation byte); fix or remove that "
                               "text"], err
    assert not (tmp_path / "o").exists()
