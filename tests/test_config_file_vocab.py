"""The vocabulary a run's data needs counts eval_data too: model.vocab_size, when no key sets it,
is raised to the larger of data's and eval_data's (a prepared dataset's manifest, else the
tokenizer's); a given one smaller than either manifest's is refused in one line naming both
(through the command line: the eval-data-prepared-vocab-above-model row of
tests/_support/faults_data.py). The reference: the manifests' vocab_size fields, read as JSON
here."""
from __future__ import annotations

import functools
import json

import numpy as np
import pytest

from dropless.config_file import build_config
from dropless.data import corpus
from tests._support.prepared_data import write_prepared
from tests._support.train_mini import TEXT

PRESET_VOCAB = build_config([]).model.vocab_size     # the tiny preset's (256: bytes)


def _prepared(out, vocab_size: int):
    """A byte-token prepared dataset whose manifest says `vocab_size` (every id is a byte)."""
    docs = [np.append(np.frombuffer(p.encode(), np.uint8), 0).astype(np.int64)
            for p in TEXT.split("\n\n") if p]
    write_prepared(out, {"train": [docs[:300]], "eval": [docs[300:]]}, vocab_size=vocab_size)
    return out


def _manifest_vocab(folder) -> int:
    return json.loads((folder / "manifest.json").read_text())["vocab_size"]


@pytest.fixture
def where(tmp_path, monkeypatch):
    """tmp_path as the working directory, holding `ds` (vocabulary 300), `ev` (1000) and a text
    file `t.txt`."""
    monkeypatch.chdir(tmp_path)
    _prepared(tmp_path / "ds", 300)
    _prepared(tmp_path / "ev", 1000)
    (tmp_path / "t.txt").write_text(TEXT)
    return tmp_path


@pytest.mark.parametrize("data, eval_data", [("ds", "ev"), ("ev", "ds"), ("t.txt", "ev"),
                                             ("ds", "t.txt"), ("ds", ""), ("t.txt", "t.txt")])
def test_the_larger_of_data_and_eval_data_sets_the_vocabulary(where, data, eval_data):
    manifests = [_manifest_vocab(where / s) for s in (data, eval_data) if s in ("ds", "ev")]
    want = max([PRESET_VOCAB, *manifests])                # text with bytes: the tokenizer's 256
    notes: list[str] = []
    cfg = build_config([("data", data), ("eval_data", eval_data)], notes=notes)
    assert cfg.model.vocab_size == want
    if want == PRESET_VOCAB:
        assert notes == []
    else:
        source = next(s for s in (data, eval_data) if s in ("ds", "ev")
                      and _manifest_vocab(where / s) == want)
        assert notes == [f"model.vocab_size={want} (from {source}/manifest.json; the preset's "
                         f"is {PRESET_VOCAB})"]


def test_a_given_vocab_size_is_kept_when_it_holds_both(where):
    cfg = build_config([("data", "ds"), ("eval_data", "ev"), ("model.vocab_size", 1000)])
    assert cfg.model.vocab_size == 1000                     # equal to the larger: fits
    cfg = build_config([("data", "ds"), ("eval_data", "ev"), ("model.vocab_size", 4096)])
    assert cfg.model.vocab_size == 4096


@pytest.mark.parametrize("given, key, source, need", [
    (500, "eval_data", "ev", 1000),      # fits data (300), not eval_data
    (299, "data", "ds", 300),            # the first that does not fit is named
])
def test_a_given_vocab_size_below_a_manifests_is_one_line_naming_both(where, given, key,
                                                                      source, need):
    want = (f"model.vocab_size={given} is smaller than the vocabulary of {key}='{source}' "
            f"(vocab_size={need} in {source}/manifest.json); raise model.vocab_size to at "
            f"least {need}, or leave it unset")
    with pytest.raises(ValueError) as e:
        build_config([("data", "ds"), ("eval_data", "ev"), ("model.vocab_size", given)])
    assert str(e.value) == want


def test_the_raised_vocabulary_reads_both_datasets(where):
    # what the trainer does with the config (train/loop.py): each dataset loaded against the
    # model's vocabulary; the preset's 256 would refuse eval_data's manifest
    cfg = build_config([("data", "ds"), ("eval_data", "ev")])
    load = functools.partial(corpus.load_corpus, tokenizer=cfg.tokenizer, seq_len=cfg.seq_len,
                             vocab_size=cfg.model.vocab_size)
    both = corpus.with_eval_split(load("ds"), load("ev"))
    assert both.eval_TOK.size == load("ev").eval_TOK.size > cfg.seq_len
    with pytest.raises(ValueError, match=r"vocab_size=1000 is larger than the model's"):
        corpus.load_corpus("ev", vocab_size=PRESET_VOCAB)


def test_init_froms_vocabulary_below_a_manifests_is_named_as_init_froms(where):
    from tests._support.paths import HF_FIXTURES
    model = f"hf:{HF_FIXTURES / 'mixtral'}"
    have = json.loads((HF_FIXTURES / "mixtral" / "config.json").read_text())["vocab_size"]
    assert build_config([("init_from", model), ("tokenizer", "byte"), ("data", "t.txt")]
                        ).model.vocab_size == have                 # the folder's, not raised
    with pytest.raises(ValueError) as e:
        build_config([("init_from", model), ("tokenizer", "byte"), ("data", "t.txt"),
                      ("eval_data", "ds")])
    assert str(e.value) == (f"model.vocab_size={have} (init_from) is smaller than the vocabulary "
                            "of eval_data='ds' (vocab_size=300 in ds/manifest.json); prepare the "
                            "data with that model's tokenizer")
