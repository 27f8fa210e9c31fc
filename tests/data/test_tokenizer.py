"""Tokenizers as users ship them: a real tokenizer.json built by the `tokenizers`
library, its special tokens from tokenizer_config.json / generation_config.json, checked against
transformers' own ids (committed in tokenizer_reference.json: 4.57.6, 5.24.0 and 5.25.0 agree) and
against `tokenizers` directly; HF folders never fall back to bytes; eval / generate /
init_from use the folder's tokenizer."""
import json
import math

import numpy as np
import pytest


from tests._support.tokenizer_folders import (DISAGREE, REFERENCE, VOCAB, build_folders, reference_tokenizer,
                                train_tokenizer, write_folder)
from dropless import cli, hf
from dropless.data import tokenizer as tl
from tests._support.paths import HF_FIXTURES

FIX = HF_FIXTURES
FIX_VOCAB = 256   # the fixture models' vocab_size
REF = json.loads(REFERENCE.read_text())


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return build_folders(tmp_path_factory.mktemp("tok"))


def _model_with(tmp_path, tok_folder, name="mixtral"):
    """The fixture model `name` (symlinked) with the tokenizer files of `tok_folder`."""
    d = tmp_path / f"{name}_tok"
    d.mkdir()
    for p in (FIX / name).iterdir():
        if p.name != "generation_config.json":
            (d / p.name).symlink_to(p)
    for p in tok_folder.iterdir():
        (d / p.name).write_bytes(p.read_bytes())
    return d


@pytest.mark.parametrize("name", sorted(REF["ids"]))
def test_encodings_equal_transformers_and_tokenizers(name, folders):
    tok = tl.HFTokenizer(folders[name] / "tokenizer.json")
    from tokenizers import Tokenizer
    raw = Tokenizer.from_file(str(folders[name] / "tokenizer.json"))
    limits = raw.truncation is not None   # the "truncating" folder: transformers turns them off
    raw.no_truncation()
    raw.no_padding()
    for text, want in zip(REF["texts"], REF["ids"][name]):
        got = tok.encode(text).tolist()
        assert got == want, (name, text)                     # transformers (REF["how"])
        assert got == raw.encode(text).ids                   # the tokenizers library itself
    if limits:   # the file's own settings would cut every text here and pad it to 12
        as_saved = Tokenizer.from_file(str(folders[name] / "tokenizer.json"))
        assert [len(as_saved.encode(t).ids) for t in REF["texts"]] == [12] * len(REF["texts"])


def test_special_tokens_follow_the_folder(folders):
    llama = tl.HFTokenizer(folders["llama"] / "tokenizer.json")
    assert (llama.bos_id, llama.eos_id, llama.stop_ids) == (1, 2, (2,))
    qwen = tl.HFTokenizer(folders["qwen"] / "tokenizer.json")
    # bos_token null in tokenizer_config.json wins over generation_config's bos_token_id;
    # generation stops at every eos_token_id of generation_config.json
    assert (qwen.bos_id, qwen.eos_id, qwen.stop_ids) == (None, 3, (3, 4))
    plain = tl.HFTokenizer(folders["plain"] / "tokenizer.json")
    assert (plain.bos_id, plain.eos_id) == (None, 2)
    assert llama.decode(llama.encode("one two")) == "one two"


def test_flags_that_disagree_with_the_tokenizer_json_are_refused(tmp_path):
    d = write_folder(tmp_path / "disagree", *DISAGREE)
    with pytest.raises(ValueError, match="add_bos_token=true but .* does not add"):
        tl.HFTokenizer(d / "tokenizer.json")


@pytest.mark.parametrize("tc, match", [
    ({"eos_token": "<nope>"}, "eos_token='<nope>' is not in the tokenizer's vocabulary"),
    ({"eos_token": 7}, "eos_token=7 is not a token string"),
    ({"eos_token": "</s>", "add_bos_token": "yes"}, "add_bos_token='yes' must be true or false"),
])
def test_bad_special_token_files_name_file_and_key(tmp_path, tc, match):
    d = write_folder(tmp_path / "bad", tc, None, None)
    with pytest.raises(ValueError, match=match):
        tl.HFTokenizer(d / "tokenizer.json")
    (d / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json: not valid JSON"):
        tl.HFTokenizer(d / "tokenizer.json")


def test_folder_tokenizer_refuses_missing_and_sentencepiece_only(tmp_path):
    from dropless.model_dir import hf_tokenizer
    with pytest.raises(ValueError, match="no tokenizer.json.*pass --tokenizer byte"):
        hf_tokenizer(tmp_path, override="--tokenizer byte")
    (tmp_path / "tokenizer.model").write_bytes(b"\x0a\x00")
    with pytest.raises(ValueError, match="only a SentencePiece tokenizer.model.*AutoTokenizer"):
        hf_tokenizer(tmp_path, override="tokenizer=byte")


def test_init_from_takes_the_folders_tokenizer_and_never_bytes(folders, tmp_path):
    from dropless.config_file import build_config
    with pytest.raises(ValueError, match="init_from=.*no tokenizer.json.*tokenizer=byte"):
        build_config([("init_from", f"hf:{FIX / 'qwen3_moe'}")])
    assert build_config([("init_from", f"hf:{FIX / 'qwen3_moe'}"),
                         ("tokenizer", "byte")]).tokenizer == "byte"
    d = _model_with(tmp_path, folders["llama"])
    assert build_config([("init_from", f"hf:{d}")]).tokenizer == str(d / "tokenizer.json")


def test_training_data_uses_bos_and_eos(folders, tmp_path):
    from dropless.data.corpus import load_corpus
    data = tmp_path / "d.jsonl"
    texts = ["one two three", "The quick brown fox."] * 6
    data.write_text("\n".join(json.dumps({"text": t}) for t in texts))
    c = load_corpus(str(data), tokenizer=str(folders["llama"] / "tokenizer.json"),
                    eval_fraction=0.3)
    from tokenizers import Tokenizer
    raw = Tokenizer.from_file(str(folders["llama"] / "tokenizer.json"))
    stream = np.concatenate([c.train_TOK, c.eval_TOK]).tolist()
    docs = [raw.encode(t).ids + [2] for t in texts]          # BOS ... EOS, as transformers
    assert sorted(map(tuple, _split(stream, 2))) == sorted(tuple(d) for d in docs)
    assert c.vocab_size == VOCAB


def _split(stream, eos):
    out, cur = [], []
    for t in stream:
        cur.append(t)
        if t == eos:
            out.append(cur)
            cur = []
    return out


def test_eval_uses_the_folders_tokenizer(folders, tmp_path, capsys):
    """eval on the Mixtral fixture with a real tokenizer: the loss equals a forward pass over the
    windows of the ids transformers' tokenizer gives (BOS first, EOS between documents)."""
    import jax
    from dropless.models.decoder import forward
    d = _model_with(tmp_path, folders["llama"])
    data = tmp_path / "held.txt"
    text = "The quick brown fox jumps over the lazy dog. One two three. " * 3
    data.write_text(text)
    assert cli.main(["eval", f"hf:{d}", "--data", str(data), "--seq-len", "8",
                     "--batch-size", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    from tokenizers import Tokenizer
    ids = Tokenizer.from_file(str(d / "tokenizer.json")).encode(text).ids
    assert ids[0] == 1 and ids[1:] == reference_tokenizer().encode(text).ids
    stream = np.asarray(ids + [2], np.int32)
    n = stream.size // 9
    win = stream[: n * 9].reshape(n, 9)
    cfg, params = hf.load(FIX / "mixtral")
    logits = np.asarray(jax.jit(lambda p, t: forward(p, t, cfg)[0])(params, win[:, :-1]),
                        np.float64)
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, win[:, 1:, None], -1)
    assert out["windows"] == n and out["loss"] == pytest.approx(nll.mean(), rel=1e-4)
    assert out["perplexity"] == pytest.approx(math.exp(out["loss"]))


def test_tokenizer_bigger_than_the_model_is_refused(tmp_path, capsys):
    big = train_tokenizer(byte_level=True)
    assert big.get_vocab_size() > FIX_VOCAB
    d = _model_with(tmp_path, write_folder(tmp_path / "big", {"eos_token": "</s>"}, None, None,
                                           tok=big))
    (tmp_path / "t.txt").write_text("hello there")
    for argv in (["eval", f"hf:{d}", "--data", str(tmp_path / "t.txt"), "--seq-len", "2"],
                 ["generate", f"hf:{d}", "--prompt", "hi"]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert "tokens, more than the model's vocab_size=256" in err and err.count("\n") == 1


def test_generate_stops_at_the_models_eos():
    from dropless.models.generate import generate
    cfg, params = hf.load(FIX / "qwen3_moe")
    prompt = np.asarray([5, 6, 7], np.int32)
    full = generate(cfg, params, prompt, max_new_tokens=4)
    first = int(full[3])
    stopped = generate(cfg, params, prompt, max_new_tokens=4, stop_ids=(first,))
    assert stopped.tolist() == full[:4].tolist()          # the stop token is kept, then done


def test_the_vocabulary_spans_the_largest_id_not_the_count_of_tokens(tmp_path):
    """`tokenizers` counts a vocabulary's entries; ids need not be dense (a WordLevel vocab
    with a gap, added tokens placed high). The vocabulary a model and a shard dtype must hold
    is the largest id + 1: counted, 70,000 would not fit the uint16 `data prepare` chose
    (an OverflowError) and a model of 4 ids would pass `check_fits`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from dropless.data.prepare import PrepareConfig, prepare
    raw = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "</s>": 2, "b": 70000},
                                     unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    assert raw.get_vocab_size(with_added_tokens=True) == 4
    d = write_folder(tmp_path / "gap", {"eos_token": "</s>"}, None, None, tok=raw)
    tok = tl.HFTokenizer(d / "tokenizer.json")
    assert tok.vocab_size == 70001
    with pytest.raises(ValueError, match="70001 tokens, more than the model's vocab_size=256"):
        tl.check_fits(tok, 256, what="m")
    (tmp_path / "t.jsonl").write_text('{"text": "a b a"}\n')
    m = prepare(PrepareConfig(sources=(str(tmp_path / "t.jsonl"),), out=str(tmp_path / "o"),
                              tokenizer=str(d / "tokenizer.json"), workers=0, eval_fraction=0),
                created_by="t")
    assert (m.vocab_size, m.dtype) == (70001, "uint32")
    ids = np.fromfile(tmp_path / "o" / m.splits["train"][0].tokens_file, "<u4")
    assert ids.tolist() == [1, 70000, 1, 2]
