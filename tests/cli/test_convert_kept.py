"""`dropless convert` DIR -> HF with the side file of kept config.json keys (hf_kept_config.json,
model_dir.kept_config) damaged or edited: one line naming the file and what to do, exit 2,
nothing written; an edited key the model determines is written as the model has it, said on
stderr; a setting the architecture's config.json cannot carry is said on stderr."""
import json

import pytest

from dropless import cli
from dropless.model_dir.kept_config import KEPT_FILE
from tests._support.paths import HF_FIXTURES


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("conv") / "qwen"
    assert cli.main(["convert", str(HF_FIXTURES / "qwen3_moe"), str(out)]) == 0
    return out


@pytest.mark.parametrize("text,why", [("{not json", "is not valid JSON"),
                                      ('"a string"', "holds a string, not a JSON object")])
def test_a_damaged_side_file_is_one_line_and_exit_2(converted, tmp_path, capsys, text, why):
    path = converted / KEPT_FILE
    good = path.read_text()
    path.write_text(text)
    try:
        assert cli.main(["convert", str(converted), str(tmp_path / "out")]) == 2
    finally:
        path.write_text(good)
    err = capsys.readouterr().err
    assert err.startswith(f"dropless: error: dropless convert {converted}: {path} {why}"), err
    assert err.count("\n") == 1 and f"or delete {path} to export with the defaults" in err
    assert not list(tmp_path.iterdir())          # no DST, no staging folder, no lock


def test_an_edited_model_key_is_said_and_the_model_wins(converted, tmp_path, capsys):
    path = converted / KEPT_FILE
    good = path.read_text()
    path.write_text(json.dumps({**json.loads(good), "hidden_size": 4096}))
    try:
        assert cli.main(["convert", str(converted), str(tmp_path / "out")]) == 0
    finally:
        path.write_text(good)
    assert capsys.readouterr().err == (f"dropless: {path}: hidden_size=4096 is not the model's; "
                                       "writing the model's hidden_size=32\n")
    out = json.loads((tmp_path / "out" / "config.json").read_text())
    assert out["hidden_size"] == 32 and out["max_position_embeddings"] == 32768


def test_a_sequence_wise_loss_qwen3_cannot_carry_is_one_line(converted, tmp_path, capsys):
    path = converted / "config.json"
    good = path.read_text()
    conf = json.loads(good)
    conf["model"]["moe"]["seq_aux_coef"] = 0.0005
    path.write_text(json.dumps(conf))
    try:
        assert cli.main(["convert", str(converted), str(tmp_path / "out")]) == 0
    finally:
        path.write_text(good)
    assert capsys.readouterr().err == (
        f"dropless: dropless convert {converted}: moe.seq_aux_coef=0.0005 is not written: "
        "Qwen3MoeForCausalLM's config.json cannot carry it (a training setting; the exported "
        "model computes the same)\n")
    out = json.loads((tmp_path / "out" / "config.json").read_text())
    assert not {"seq_aux", "aux_loss_alpha"} & set(out)
    assert cli.main(["convert", str(converted), str(tmp_path / "out0")]) == 0
    assert capsys.readouterr().err == ""        # zero: nothing to say
