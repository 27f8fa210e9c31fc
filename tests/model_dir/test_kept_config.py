"""The config.json keys a dropless directory keeps for the way back (model_dir.kept_config):
HF -> dropless -> HF on the fixture checkpoints of each architecture gives back the source's
context length, token ids, initializer_range and keys dropless has never heard of; a folder
converted before they were kept still exports, with the documented fallbacks; a damaged side file
is refused naming it, with nothing written; an edited one does not override the model; and a
training run exports what the model it started from kept, else its own seq_len and tokenizer."""
import json
from pathlib import Path

import pytest

from dropless import hf
from dropless.model_dir import kept_config as kc
from dropless.model_dir.weights import dropless_to_hf, hf_to_dropless
from tests._support.paths import HF_FIXTURES
from tests._support.tokenizer_folders import FOLDERS, write_folder

UNKNOWN = {"a_key_of_a_later_release": {"nested": [1, 2.5, None]}}


def source(tmp: Path, name: str, **changes) -> Path:
    """The fixture checkpoint `name` (weights linked) with `changes` made to its config.json."""
    d = tmp / f"src_{name}"
    d.mkdir()
    for p in (HF_FIXTURES / name).iterdir():
        if p.name != "config.json":
            (d / p.name).symlink_to(p)
    conf = json.loads((HF_FIXTURES / name / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**conf, **changes}))
    return d


def there_and_back(tmp: Path, src: Path, announce=None) -> tuple[Path, dict]:
    conv = hf_to_dropless(str(src), str(tmp / "conv"))
    out = dropless_to_hf(str(conv), str(tmp / "back"), announce=announce)
    return conv, json.loads((out / "config.json").read_text())


# (fixture, its context length as given here): Mixtral- and Qwen3-MoE-shaped, and a
# DeepSeek-V3 with YaRN whose context is not original x factor (16 x 4)
CASES = [("mixtral", 32768), ("qwen3_moe", 40960), ("deepseek_v3_yarn", 100)]


@pytest.mark.parametrize("name,context", CASES)
def test_convert_there_and_back_keeps_the_source_config(tmp_path, name, context):
    changes = {"max_position_embeddings": context, "bos_token_id": 11, "eos_token_id": [12, 13],
               "pad_token_id": 0, "initializer_range": 0.0125, "use_cache": False, **UNKNOWN}
    src = source(tmp_path, name, **changes)
    said = []
    conv, back = there_and_back(tmp_path, src, said.append)
    kept = json.loads((conv / kc.KEPT_FILE).read_text())
    assert "initializer_range" not in kept and "transformers_version" not in kept
    for key, value in changes.items():
        assert back[key] == value, key
    assert "transformers_version" not in back and said == []
    assert hf.read_config(tmp_path / "back")[0] == hf.read_config(src)[0]


def test_a_folder_converted_before_the_keys_were_kept_still_exports(tmp_path):
    """No side file: max_position_embeddings 4096, the token ids of the folder's
    generation_config.json, initializer_range the model's; one line says what to do."""
    conv = hf_to_dropless(str(HF_FIXTURES / "mixtral"), str(tmp_path / "conv"))
    (conv / kc.KEPT_FILE).unlink()
    said = []
    out = dropless_to_hf(str(conv), str(tmp_path / "back"), announce=said.append)
    back = json.loads((out / "config.json").read_text())
    assert (back["max_position_embeddings"], back["bos_token_id"], back["eos_token_id"],
            back["initializer_range"]) == (4096, 1, 2, 0.02)
    assert "use_cache" not in back
    assert len(said) == 1 and f"{conv / kc.KEPT_FILE} is absent" in said[0]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Path:
    return hf_to_dropless(str(HF_FIXTURES / "qwen3_moe"), str(tmp_path_factory.mktemp("q") / "dl"))


@pytest.mark.parametrize("text,why", [(b'{"max_position_embeddings": 40', "is not valid JSON"),
                                      (b"\xff\xfe", "is not valid JSON"),
                                      (b"[1, 2]", "holds an array, not a JSON object"),
                                      (b"null", "holds null, not a JSON object")])
def test_a_damaged_side_file_is_refused_naming_it(qwen, tmp_path, text, why):
    path = qwen / kc.KEPT_FILE
    good = path.read_bytes()
    path.write_bytes(text)
    try:
        with pytest.raises(ValueError) as e:
            dropless_to_hf(str(qwen), str(tmp_path / "back"))
    finally:
        path.write_bytes(good)
    msg = str(e.value)
    assert msg.startswith(f"dropless convert {qwen}: {path} {why}"), msg
    assert "convert the Hugging Face folder again, or delete" in msg and "\n" not in msg
    assert not list(tmp_path.iterdir())   # nothing half-written: no DST, staging or lock


def test_the_model_wins_over_an_edited_side_file(tmp_path):
    conv = hf_to_dropless(str(HF_FIXTURES / "mixtral"), str(tmp_path / "conv"))
    path = conv / kc.KEPT_FILE
    path.write_text(json.dumps({**json.loads(path.read_text()), "vocab_size": 7,
                                "num_local_experts": 99}))
    said = []
    out = dropless_to_hf(str(conv), str(tmp_path / "back"), announce=said.append)
    back = json.loads((out / "config.json").read_text())
    assert (back["vocab_size"], back["num_local_experts"]) == (256, 4)
    assert said == [f"{path}: vocab_size=7 is not the model's; writing the model's vocab_size=256",
                    f"{path}: num_local_experts=99 is not the model's; writing the model's "
                    "num_local_experts=4"]


# -- a training run (its config.json as saved; no params/ folder): the files alone, no weights

def run_dir(d: Path, **saved) -> tuple[Path, dict]:
    d.mkdir(parents=True)
    saved = {"seq_len": 512, "init_from": "", "tokenizer": "byte", "model": {}, **saved}
    (d / "config.json").write_text(json.dumps(saved))
    return d, saved


def test_a_run_from_scratch_exports_its_seq_len_and_tokenizer_ids(tmp_path):
    run, saved = run_dir(tmp_path / "run")
    assert kc.origin_keys(run, saved) == (None, None)
    assert kc.fallback_keys(run, saved, None, tokenizer="byte") == {"max_position_embeddings": 512}
    tok = write_folder(tmp_path / "tok", *FOLDERS["template"]) / "tokenizer.json"   # <s>=1 </s>=2
    assert kc.fallback_keys(run, saved, None, tokenizer=str(tok)) == {
        "max_position_embeddings": 512, "bos_token_id": 1, "eos_token_id": 2}
    # a generation_config.json in the folder comes first; kept ids first of all
    (run / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 8]}))
    assert kc.fallback_keys(run, saved, {"bos_token_id": 5}, tokenizer=str(tok)) == {
        "max_position_embeddings": 512, "eos_token_id": [7, 8]}


def test_a_convert_output_never_takes_the_default_seq_len(tmp_path):
    """write_dropless records TrainConfig's default seq_len (128): no training, no context."""
    d, saved = run_dir(tmp_path / "conv", seq_len=128)
    (d / "params").mkdir()
    assert kc.fallback_keys(d, saved, None, tokenizer="byte") == {}


def test_a_run_exports_the_keys_of_the_model_it_started_from(tmp_path):
    """init_from is followed through runs to an HF folder or a convert output; the kept
    context wins over the run's seq_len."""
    hf_src = source(tmp_path, "mixtral", max_position_embeddings=32768, **UNKNOWN)
    a, saved_a = run_dir(tmp_path / "a", init_from=f"hf:{hf_src}")
    b, saved_b = run_dir(tmp_path / "b", init_from=str(a))
    for run, saved in ((a, saved_a), (b, saved_b)):
        kept, where = kc.origin_keys(run, saved)
        assert where == hf_src / "config.json"
        assert kept["max_position_embeddings"] == 32768 and kept[
            "a_key_of_a_later_release"] == UNKNOWN["a_key_of_a_later_release"]
        assert "max_position_embeddings" not in kc.fallback_keys(run, saved, kept,
                                                                 tokenizer="byte")
    conv, _ = run_dir(tmp_path / "conv")
    (conv / "params").mkdir()
    (conv / kc.KEPT_FILE).write_text(json.dumps({"max_position_embeddings": 777}))
    c, saved_c = run_dir(tmp_path / "c", init_from=str(conv))
    assert kc.origin_keys(c, saved_c) == ({"max_position_embeddings": 777}, conv / kc.KEPT_FILE)


def test_a_start_that_is_gone_is_said_and_the_run_falls_back(tmp_path):
    run, saved = run_dir(tmp_path / "run", init_from=str(tmp_path / "gone"))
    said = []
    assert kc.origin_keys(run, saved, what="dropless convert run",
                          announce=said.append) == (None, None)
    assert len(said) == 1 and said[0].startswith(
        f"dropless convert run: the model started from {tmp_path / 'gone'}, which cannot be "
        "read now (")
    # runs that started from each other end the walk
    a, saved_a = run_dir(tmp_path / "a", init_from=str(tmp_path / "b"))
    run_dir(tmp_path / "b", init_from=str(a))
    assert kc.origin_keys(a, saved_a) == (None, None)
