"""One way to name a tokenizer and a dataset everywhere: `hf:DIR`, a folder, a folder/ and a
tokenizer.json path are read by `model_dir.resolve_tokenizer` alike, for `data prepare`, `train`,
`eval` and `generate` (each form gives the same manifest, corpus, loss and text as the
tokenizer.json path itself); a name that holds no tokenizer is one line, exit 2, naming it. A
prepared dataset sets model.vocab_size when none is given (one given too small is refused);
raw Parquet / Arrow / save_to_disk data given to train or eval is refused with the one
`data prepare` command; `eval --data` reads a prepared folder's eval split."""
import json

import numpy as np
import pytest

from dropless import cli
from dropless.config_file import build_config
from dropless.data import corpus as data_lib
from dropless.data import manifest as mf
from dropless.model_dir import resolve_tokenizer

from tests._support.paths import HF_FIXTURES
from tests._support.tokenizer_folders import FOLDERS, train_tokenizer, write_folder

FORMS = ("hf:{d}", "{d}", "{d}/", "{d}/tokenizer.json")
DOCS = [f"The quick brown fox {i} jumps over the lazy dog number {i * 7}." for i in range(300)]


@pytest.fixture
def where(tmp_path, monkeypatch):
    """tok/ (a 120-token folder), big/ (a byte-level folder of more than 256 tokens), d.jsonl."""
    monkeypatch.chdir(tmp_path)
    write_folder(tmp_path / "tok", *FOLDERS["llama"])
    write_folder(tmp_path / "big", {"eos_token": "</s>"}, None, None,
                 tok=train_tokenizer(byte_level=True))
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS))
    return tmp_path


def _one_line(capsys, *words) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, (w, err)
    return err


def _prepare(src: str, out: str, tok: str) -> int:
    return cli.main(["data", "prepare", src, out, "--tokenizer", tok, "--workers", "0",
                     "--eval-fraction", "0.2"])


def test_every_form_resolves_to_the_tokenizer_json(where):
    for form in FORMS:
        assert resolve_tokenizer(form.format(d="tok")) in ("tok/tokenizer.json",
                                                          "tok//tokenizer.json")
    assert resolve_tokenizer("byte") == "byte"


BAD = [("nowhere", "does not exist"), ("hf:nowhere", "no tokenizer.json"),
       ("empty", "no tokenizer.json"), ("empty/tokenizer.json", "does not exist"),
       ("dir.json", "is a folder")]


@pytest.mark.parametrize("form, why", BAD)
def test_a_name_without_a_tokenizer_is_one_line_for_every_command(where, capsys, form, why):
    (where / "empty").mkdir()
    (where / "dir.json").mkdir()
    model = f"hf:{HF_FIXTURES / 'mixtral'}"
    (where / "t.txt").write_text("hello there")
    for argv in (["data", "prepare", "d.jsonl", "out", "--tokenizer", form],
                 ["train", "steps=1", "data=d.jsonl", f"tokenizer={form}", "run_dir=runs"],
                 ["eval", model, "--data", "t.txt", "--tokenizer", form],
                 ["generate", model, "--prompt", "hi", "--tokenizer", form]):
        assert cli.main(argv) == 2, argv
        _one_line(capsys, f"tokenizer={form!r}", why)
    assert not (where / "out").exists() and not (where / "runs").exists()


def test_data_prepare_and_train_read_every_form_alike(where):
    assert _prepare("d.jsonl", "ref", "tok/tokenizer.json") == 0
    ref = mf.read_manifest(where / "ref")
    want = data_lib.load_corpus("ref", tokenizer="tok/tokenizer.json", vocab_size=256)
    for i, form in enumerate(FORMS):
        name = form.format(d="tok")
        assert _prepare("d.jsonl", f"out{i}", name) == 0
        m = mf.read_manifest(where / f"out{i}")
        assert m.tokenizer.sha256 == ref.tokenizer.sha256 == mf.file_sha256(where / "tok" /
                                                                           "tokenizer.json")
        assert [s.sha256 for s in m.splits["train"]] == [s.sha256 for s in ref.splits["train"]]
        for data in ("ref", "d.jsonl"):      # a prepared folder, and text the trainer encodes
            cfg = build_config([("data", data), ("tokenizer", name)])
            got = data_lib.load_corpus(cfg.data, tokenizer=cfg.tokenizer,
                                       vocab_size=cfg.model.vocab_size)
            if data == "ref":
                assert np.array_equal(got.train_TOK[:got.train_TOK.size],
                                      want.train_TOK[:want.train_TOK.size])
            else:
                assert got.vocab_size == ref.vocab_size


def _model_with(tmp_path, tok_folder):
    """The mixtral fixture model (vocab 256) with the tokenizer files of `tok_folder`."""
    d = tmp_path / "model"
    d.mkdir()
    for p in (HF_FIXTURES / "mixtral").iterdir():
        if p.name != "generation_config.json":
            (d / p.name).symlink_to(p)
    for p in tok_folder.iterdir():
        (d / p.name).write_bytes(p.read_bytes())
    return d


def test_eval_and_generate_read_every_form_alike(where, capsys):
    model = f"hf:{_model_with(where, where / 'tok')}"
    (where / "t.txt").write_text(" ".join(DOCS[:20]))
    outs = set()
    for form in FORMS + ("byte",):
        name = form.format(d="tok")
        assert cli.main(["eval", model, "--data", "t.txt", "--seq-len", "8",
                         "--max-batches", "1", "--tokenizer", name]) == 0
        ev = json.loads(capsys.readouterr().out)
        assert cli.main(["generate", model, "--prompt", "The quick", "--max-new-tokens", "3",
                         "--tokenizer", name]) == 0
        outs.add((ev["tokenizer"], ev["loss"], capsys.readouterr().out))
    assert len(outs) == 2, outs          # the four forms alike, bytes otherwise
    assert any(o[0] == "byte" for o in outs)


def test_a_prepared_dataset_sets_the_vocabulary(where, capsys):
    assert _prepare("d.jsonl", "out", "hf:big") == 0
    vocab = mf.read_manifest(where / "out").vocab_size
    assert vocab > 256                                  # more than the tiny preset's
    notes: list[str] = []
    assert build_config([("data", "out"), ("tokenizer", "big/tokenizer.json")],
                        notes=notes).model.vocab_size == vocab
    assert "model.vocab_size" in notes[0] and "manifest.json" in notes[0]
    given = build_config([("data", "out"), ("tokenizer", "hf:big"),
                          ("model.vocab_size", vocab + 10)])
    assert given.model.vocab_size == vocab + 10       # a given one that fits is kept
    assert build_config([("data", "d.jsonl"), ("tokenizer", "big")]).model.vocab_size == vocab
    # README: dropless train data=out tokenizer=qwen3/tokenizer.json, as written
    assert cli.main(["train", "data=out", "tokenizer=big/tokenizer.json", "steps=1",
                     "run_dir=runs", "run_name=r", "eval_every=1", "time_kernels=false",
                     "seq_len=32"]) == 0
    capsys.readouterr()
    assert cli.main(["train", "data=out", "tokenizer=big", "model.vocab_size=256", "steps=1",
                     "run_dir=runs", "run_name=small"]) == 2
    _one_line(capsys, "manifest.json", f"vocab_size={vocab}", "model.vocab_size=256")
    assert not (where / "runs" / "small").exists()


def _parquet(path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": DOCS}), path)


def _arrow(path):
    import pyarrow as pa
    table = pa.table({"text": DOCS})
    with pa.ipc.new_stream(path, table.schema) as w:
        w.write_table(table)


def _saved(folder):
    folder.mkdir()
    _arrow(folder / "data-00000-of-00001.arrow")
    (folder / "state.json").write_text(json.dumps(
        {"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))


RAW = [("x.parquet", _parquet, "Parquet"), ("x.arrow", _arrow, "Arrow"),
       ("saved", _saved, "save_to_disk"),
       ("pq", lambda d: (d.mkdir(), _parquet(d / "a.parquet")), "Parquet / Arrow"),
       ("mixed", lambda d: (d.mkdir(), _parquet(d / "a.parquet"),
                            (d / "b.txt").write_text(" ".join(DOCS))), "Parquet / Arrow")]


@pytest.mark.parametrize("name, make, form", RAW, ids=[r[0] for r in RAW])
def test_raw_columnar_data_is_refused_with_the_prepare_command(where, capsys, name, make, form):
    make(where / name)
    model = f"hf:{_model_with(where, where / 'tok')}"
    out = name.split(".")[0] + "-prepared"
    for argv, use in ((["train", f"data={name}", "tokenizer=hf:tok", "steps=1",
                        "run_dir=runs"], f"data={out}"),
                      (["eval", model, "--data", name, "--tokenizer", "hf:tok"],
                       f"--data {out}")):
        assert cli.main(argv) == 2
        err = _one_line(capsys, form, f"dropless data prepare {name} {out} --tokenizer hf:tok",
                        use)
        cmd = err.split(": ", 1)[1].split("dropless data prepare ", 1)[1].split(",")[0]
    assert not (where / "runs").exists()
    src, dst, _, tok = cmd.split()    # the command given works, and then so does training
    assert _prepare(src, dst, tok) == 0
    assert data_lib.load_corpus(dst, tokenizer="tok/tokenizer.json", vocab_size=256)


def test_eval_reads_a_prepared_folders_eval_split(where, capsys):
    from dropless import hf
    from dropless.data.tokenizer import make_tokenizer
    from dropless.models.evaluate import evaluate
    assert _prepare("d.jsonl", "out", "hf:tok") == 0
    capsys.readouterr()
    model = _model_with(where, where / "tok")
    assert cli.main(["eval", f"hf:{model}", "--data", "out", "--seq-len", "16"]) == 0
    got = json.loads(capsys.readouterr().out)
    m = mf.read_manifest(where / "out")
    toks = np.concatenate([mf.open_shard(where / "out", m, s)[0] for s in m.splits["eval"]])
    cfg, params = hf.load(model)
    want = evaluate(cfg, params, toks.astype(np.int32), seq_len=16, batch_size=8, max_batches=0)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
    assert got["tokenizer"] == make_tokenizer(str(model / "tokenizer.json")).name
    # a dataset prepared with another tokenizer is refused naming both
    assert _prepare("d.jsonl", "bytes", "byte") == 0
    capsys.readouterr()
    assert cli.main(["eval", f"hf:{model}", "--data", "bytes"]) == 2
    _one_line(capsys, "manifest.json", "byte tokenizer")
