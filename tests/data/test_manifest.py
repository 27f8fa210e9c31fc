"""The prepared-dataset manifest: written and read back equal, every malformed key refused naming
the file and key, and shards checked against it (missing, cut short, changed)."""
import dataclasses
import json

import numpy as np
import pytest

from dropless.data import manifest as mf


def _write_shard(folder, name, docs, dtype="uint16"):
    """A shard file pair for `docs` (lists of ids) and its Shard record."""
    toks = np.concatenate([np.asarray(d, dtype) for d in docs])
    ends = np.cumsum([len(d) for d in docs]).astype("<u8")
    toks.astype(np.dtype(dtype).newbyteorder("<")).tofile(folder / f"{name}.tokens")
    ends.tofile(folder / f"{name}.docs")
    return mf.Shard(tokens_file=f"{name}.tokens", docs_file=f"{name}.docs", tokens=int(toks.size),
                    documents=len(docs), sha256=mf.file_sha256(folder / f"{name}.tokens"),
                    docs_sha256=mf.file_sha256(folder / f"{name}.docs"))


def _manifest(folder):
    train = _write_shard(folder, "train-00000", [[1, 2, 3, 0], [4, 0]])
    ev = _write_shard(folder, "eval-00000", [[5, 6, 0]])
    return mf.Manifest(
        tokenizer=mf.TokenizerId(kind="byte", source="byte", sha256=None), vocab_size=256,
        dtype="uint16", bos_id=None, eos_id=0, add_bos=False, add_eos=True, eval_fraction=0.1,
        splits={"train": (train,), "eval": (ev,)},
        sources=(mf.Source(path="a.jsonl", bytes=10, sha256="0" * 64, weight=1.0, documents=3,
                           tokens=9, skipped=1),),
        created_by="dropless test")


def test_round_trip_and_open_shard(tmp_path):
    m = _manifest(tmp_path)
    mf.write_manifest(tmp_path, m)
    back = mf.read_manifest(tmp_path)
    assert back == m
    assert back == mf.read_manifest(tmp_path / "manifest.json")
    data = json.loads((tmp_path / "manifest.json").read_text())
    assert data["num_tokens"] == {"train": 6, "eval": 3}
    assert data["num_documents"] == {"train": 2, "eval": 1}
    toks, ends = mf.open_shard(tmp_path, back, back.splits["train"][0], verify_hash=True)
    np.testing.assert_array_equal(np.asarray(toks), [1, 2, 3, 0, 4, 0])
    np.testing.assert_array_equal(ends, [4, 6])
    assert not list(tmp_path.glob(".*.tmp")), "the temporary file was left beside"


def test_dtype_for_vocab():
    assert mf.dtype_for_vocab(256) == "uint16"
    assert mf.dtype_for_vocab(65536) == "uint16"
    assert mf.dtype_for_vocab(65537) == "uint32"
    with pytest.raises(ValueError, match="uint32"):
        mf.dtype_for_vocab(1 << 33)


def _edit(path, fn):
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


BAD = [
    ("format", lambda d: d.update(format="other"), "format"),
    ("version", lambda d: d.update(version=2), "version"),
    ("missing-key", lambda d: d.pop("dtype"), "'dtype' is missing"),
    ("dtype", lambda d: d.update(dtype="int8"), "dtype"),
    ("small-dtype", lambda d: d.update(dtype="uint16", vocab_size=70000), "dtype"),
    ("eos-outside", lambda d: d.update(eos_id=256), "eos_id"),
    ("bool", lambda d: d.update(add_eos="yes"), "add_eos"),
    ("add-bos-no-id", lambda d: d.update(add_bos=True), "add_bos"),
    ("kind", lambda d: d["tokenizer"].update(kind="sp"), "tokenizer.kind"),
    ("hf-no-hash", lambda d: d["tokenizer"].update(kind="hf"), "tokenizer.sha256"),
    ("shard-key", lambda d: d["splits"]["train"][0].pop("sha256"), "splits.train[0].sha256"),
    ("shard-path", lambda d: d["splits"]["eval"][0].update(tokens_file="../x"),
     "splits.eval[0].tokens_file"),
    ("sum", lambda d: d["num_tokens"].update(train=7), "num_tokens.train"),
    ("no-train", lambda d: d["splits"].update(train=[]), "splits.train"),
    ("extra-split", lambda d: d["splits"].update(test=[]), "splits.test"),
    ("weight", lambda d: d["sources"][0].update(weight=0), "sources[0].weight"),
    ("dup-file", lambda d: d["splits"]["eval"][0].update(
        tokens_file="train-00000.tokens"), "two shards"),
]


@pytest.mark.parametrize("name,edit,words", BAD, ids=[b[0] for b in BAD])
def test_malformed_manifest_is_refused_naming_file_and_key(tmp_path, name, edit, words):
    mf.write_manifest(tmp_path, _manifest(tmp_path))
    _edit(tmp_path / "manifest.json", edit)
    with pytest.raises(ValueError) as e:
        mf.read_manifest(tmp_path)
    assert str(tmp_path / "manifest.json") in str(e.value)
    assert words in str(e.value)


def test_missing_or_unparsable_manifest(tmp_path):
    with pytest.raises(ValueError, match="does not exist.*data prepare"):
        mf.read_manifest(tmp_path)
    (tmp_path / ".prepare").mkdir()
    with pytest.raises(ValueError, match="interrupted"):
        mf.read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        mf.read_manifest(tmp_path)


def test_write_refuses_an_invalid_manifest(tmp_path):
    m = _manifest(tmp_path)
    bad = dataclasses.replace(m, eos_id=None)
    with pytest.raises(ValueError, match="add_eos"):
        mf.write_manifest(tmp_path, bad)
    assert not (tmp_path / "manifest.json").exists()


def test_shard_missing_short_or_changed(tmp_path):
    m = _manifest(tmp_path)
    sh = m.splits["train"][0]
    tok = tmp_path / sh.tokens_file
    data = tok.read_bytes()
    tok.write_bytes(data[:-2])
    with pytest.raises(ValueError, match="train-00000.tokens: 10 bytes.*says 12"):
        mf.open_shard(tmp_path, m, sh)
    tok.write_bytes(data[:-2] + b"\x07\x00")       # same size, other bytes
    mf.open_shard(tmp_path, m, sh)                 # sizes only: accepted
    with pytest.raises(ValueError, match="train-00000.tokens: sha256 differs"):
        mf.open_shard(tmp_path, m, sh, verify_hash=True)
    tok.unlink()
    with pytest.raises(ValueError, match="train-00000.tokens: shard file is missing"):
        mf.open_shard(tmp_path, m, sh)


def test_bad_document_ends(tmp_path):
    m = _manifest(tmp_path)
    sh = m.splits["train"][0]
    np.array([4, 5], "<u8").tofile(tmp_path / sh.docs_file)
    with pytest.raises(ValueError, match="train-00000.docs: document ends"):
        mf.open_shard(tmp_path, m, sh)


def _files(folder) -> dict:
    """Every file under `folder` -> (bytes, mtime): what a reader must leave as it found it."""
    return {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.rglob("*"))
            if p.is_file()}


GOOD = '"created_by": "dropless test"'
# (id, the manifest.json text edited by hand, words the error holds); the text is edited as a
# user's editor would, since json.dumps cannot write a key twice or NaN where we want it
EDITED = [
    ("duplicate-key", lambda t: t.replace(GOOD, GOOD + ', "created_by": "someone"'),
     "key 'created_by' appears twice"),
    ("a-list", lambda t: "[" + t + "]", "expected a JSON object"),
    ("a-string", lambda t: json.dumps(t), "expected a JSON object"),
    ("null", lambda t: "null", "expected a JSON object"),
    ("count-as-string", lambda t: t.replace('"tokens": 6,', '"tokens": "6",', 1),
     'splits.train[0].tokens="6" must be an integer'),
    ("nan-fraction", lambda t: t.replace('"eval_fraction": 0.1', '"eval_fraction": NaN'),
     "eval_fraction=NaN must be a number"),
    ("infinite-weight", lambda t: t.replace('"weight": 1.0', '"weight": -Infinity'),
     "sources[0].weight=-Infinity must be a number"),
    ("a-5000-digit-count", lambda t: t.replace('"tokens": 6,', '"tokens": ' + "9" * 5000 + ",",
                                               1),
     "splits.train[0].tokens=<an integer of 16610 bits> must be an integer in [1, 2**63)"),
    ("deep-nesting", lambda t: "[" * 100_000 + "]" * 100_000, "nested deeper than a manifest"),
    ("nul-in-file-name", lambda t: t.replace('"train-00000.tokens"', '"train\\u0000.tokens"'),
     "splits.train[0].tokens_file"),
    ("surrogate-in-file-name", lambda t: t.replace('"train-00000.tokens"', '"\\ud800.tokens"'),
     "splits.train[0].tokens_file"),
]


@pytest.mark.parametrize("name,edit,words", EDITED, ids=[e[0] for e in EDITED])
def test_a_hand_edited_manifest_is_refused_in_one_line_and_nothing_changes(tmp_path, name, edit,
                                                                         words):
    """A key named twice was read as its last value (json.loads) and NaN passed every range
    check; a 5000-digit count died in int -> str and deep nesting in a RecursionError, neither
    naming the file. Each is now one line naming the file (and the key), and the folder is left
    byte for byte as it was."""
    mf.write_manifest(tmp_path, _manifest(tmp_path))
    path = tmp_path / "manifest.json"
    text = path.read_text()
    assert '"tokens": 6,' in text and '"eval_fraction": 0.1' in text and GOOD in text
    path.write_text(edit(text))
    before = _files(tmp_path)
    with pytest.raises(ValueError) as e:
        mf.read_manifest(tmp_path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: ") and words in msg and "\n" not in msg, msg
    assert _files(tmp_path) == before


def test_a_leading_byte_order_mark_is_not_content(tmp_path):
    """As every JSON file a user may edit is read (data.decoding): a Windows editor's BOM at
    the start is dropped, so the manifest reads as it did before the editor saved it."""
    m = _manifest(tmp_path)
    mf.write_manifest(tmp_path, m)
    path = tmp_path / "manifest.json"
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert mf.read_manifest(tmp_path) == m
