"""A text file in `data prepare` (`prepare_workers`): one document, encoded in pieces of about
SLICE_BYTES (`text_pieces`), whose shard tokens are the whole file's encoding by the
tokenizer.json (`Tokenizer.encode(text, add_special_tokens=False)`) between BOS and EOS; a
worker encoding the largest text file it is given whole (readers.TEXT_WHOLE_BYTES: a larger one
is streamed, tests/data/test_prepare_text_stream*.py) stays under its estimate (`encode_peak`);
a text that can be neither cut nor held is refused in one
line naming the file (exit 2), writing nothing."""
import json
import os

import numpy as np
import pytest

from dropless import cli
from dropless.data import manifest as mf
from dropless.data import prepare_workers as pw
from dropless.data import readers
from dropless.data.prepare import PrepareConfig, prepare
from tests._support.prepare_memory import mixed_text, worker_peak
from tests._support.tokenizer_styles import build

MiB = 1 << 20
FOLDERS = {   # style: (tokenizer_config.json, post-processor template adding BOS, or None)
    "prepend": ({"bos_token": "<s>", "eos_token": "</s>"}, "<s> $A"),
    "gpt2": ({"eos_token": "<|endoftext|>"}, None),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from tokenizers import processors
    root = tmp_path_factory.mktemp("tok")
    out = {}
    for style, (config, template) in FOLDERS.items():
        tok = build(style)
        if template:
            tok.post_processor = processors.TemplateProcessing(
                single=template, special_tokens=[("<s>", tok.token_to_id("<s>"))])
        (root / style).mkdir()
        tok.save(str(root / style / "tokenizer.json"))
        (root / style / "tokenizer_config.json").write_text(json.dumps(config))
        out[style] = root / style / "tokenizer.json"
    return out


@pytest.mark.parametrize("style", list(FOLDERS))
def test_a_text_file_of_several_slices_is_its_whole_encoding(folders, tmp_path, style):
    from tokenizers import Tokenizer
    text = mixed_text(3 * pw.SLICE_BYTES + 12345)
    (tmp_path / "book.txt").write_text(text, newline="")
    m = prepare(PrepareConfig(sources=(str(tmp_path / "book.txt"),), out=str(tmp_path / "out"),
                              tokenizer=str(folders[style]), eval_fraction=0.0, workers=1),
                created_by="t")
    tok = Tokenizer.from_file(str(folders[style]))
    ids = tok.encode(text, add_special_tokens=False).ids
    bos = [tok.token_to_id("<s>")] if m.add_bos else []
    want = bos + ids + [m.eos_id]
    assert m.add_bos == (style == "prepend") and len(ids) > 2 * pw.SLICE_BYTES // 4
    (shard,) = m.splits["train"]
    got = np.fromfile(tmp_path / "out" / shard.tokens_file, np.dtype(m.dtype).newbyteorder("<"))
    assert shard.documents == 1 and got.tolist() == want


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="Linux's /proc")
def test_a_worker_encoding_the_largest_whole_text_file_stays_under_its_estimate(folders,
                                                                               tmp_path):
    """As the kernel counts it (VmHWM less the idle VmRSS, as docs/data.md measures): a text
    file of TEXT_WHOLE_BYTES, at ~1.3 bytes a token with the gpt2 style, uint32 ids (the most
    the token terms take); encoded as one string it would take ~200-275 bytes a byte."""
    data = mixed_text(readers.TEXT_WHOLE_BYTES, seed=1).encode()[:readers.TEXT_WHOLE_BYTES]
    (tmp_path / "big.txt").write_bytes(data.decode("utf-8", "ignore").encode())
    (f,) = readers.input_files(str(tmp_path / "big.txt"))
    chunk = next(readers.text_chunks(f, "text"))
    size = readers.chunk_text_bytes(f, "text")
    enc = pw.Encoder(tokenizer=str(folders["gpt2"]), dtype="uint32", bos=None, eos=3)
    lengths, used = worker_peak(enc, f, chunk)
    assert len(lengths) == 1 and lengths[0] > size // 4
    est = pw.encode_peak("text", "tokenizer.json", size, 1024)
    assert not readers.streamed(f) and size > readers.TEXT_WHOLE_BYTES - 4
    assert 0.25 * est <= used <= est, (used, est, size)


def test_a_text_that_can_be_neither_cut_nor_held_is_refused_in_one_line(folders, tmp_path,
                                                                        monkeypatch, capsys):
    """A file of spaces has no cut a byte-level BPE passes; where the memory would not hold it
    whole (`piece_fits` says no), the run stops naming the file, exit 2, and writes nothing."""
    (tmp_path / "blank.txt").write_text("x" + " " * (pw.SLICE_BYTES + 50000) + "y")
    monkeypatch.setattr(pw, "piece_fits", lambda n: False)
    rc = cli.main(["data", "prepare", str(tmp_path / "blank.txt"), str(tmp_path / "o"),
                   "--tokenizer", str(folders["gpt2"]), "--workers", "0"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"dropless: error: {tmp_path / 'blank.txt'}: no place to cut this "
                             "text of 1 MiB where its tokens stay the same"), err
    assert "split it into smaller files" in err[0]
    assert not (tmp_path / "o").exists() or not (tmp_path / "o" / mf.MANIFEST).exists()


def test_piece_fits_asks_the_memory_available(monkeypatch):
    monkeypatch.setattr(pw, "available_memory", lambda: None)
    assert pw.piece_fits(1 << 40)                          # unknown: no bound
    monkeypatch.setattr(pw, "available_memory", lambda: 10 * pw.PIECE_PEAK * MiB)
    assert pw.piece_fits(8 * MiB) and not pw.piece_fits(9 * MiB)    # MEMORY_SHARE 0.8 of it
