"""`dropless convert` DIR -> HF of a model whose settings the architecture's config.json cannot
carry (dropless.hf.round_trip.not_carried): one stderr line per setting, each once, and no
Python warning beside it; `model_dir.dropless_to_hf` called without `announce` gives one
hf.NotCarriedWarning per setting instead."""
import json
import warnings

import pytest

from dropless import cli, hf
from dropless.model_dir import dropless_to_hf
from tests._support.paths import HF_FIXTURES

TRAINING = "a training setting; the exported model computes the same"
DROPLESS = "the exported model is dropless: it routes every token"
# fixture -> (architecture, [(section of the dropless config.json, field, value, why)])
CASES = {
    "mixtral": ("MixtralForCausalLM", [("moe", "seq_aux_coef", 0.001, TRAINING),
                                       ("moe", "z_loss_coef", 0.002, TRAINING),
                                       ("moe", "capacity_factor", 1.5, DROPLESS)]),
    "qwen3_moe": ("Qwen3MoeForCausalLM", [("moe", "seq_aux_coef", 0.0005, TRAINING),
                                          ("moe", "z_loss_coef", 0.001, TRAINING),
                                          ("moe", "bias_update_speed", 0.001, TRAINING)]),
    "deepseek_v3_yarn": ("DeepseekV3ForCausalLM", [("moe", "load_balance_coef", 0.01, TRAINING),
                                                   ("moe", "z_loss_coef", 0.001, TRAINING),
                                                   ("moe", "bias_update_speed", 0.0, TRAINING),
                                                   ("model", "mtp_loss_coef", 0.1, TRAINING)]),
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """name -> a dropless directory converted from the HF fixture `name`, with the settings of
    CASES[name] written into its config.json."""
    out = {}
    for name, (_, settings) in CASES.items():
        folder = tmp_path_factory.mktemp("conv") / name
        assert cli.main(["convert", str(HF_FIXTURES / name), str(folder)]) == 0
        conf = json.loads((folder / "config.json").read_text())
        for section, field, value, _ in settings:
            (conf["model"]["moe"] if section == "moe" else conf["model"])[field] = value
        (folder / "config.json").write_text(json.dumps(conf))
        out[name] = folder
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_convert_says_each_setting_once(converted, tmp_path, capsys, name):
    capsys.readouterr()
    src = converted[name]
    arch, settings = CASES[name]
    with warnings.catch_warnings():
        warnings.simplefilter("error", hf.NotCarriedWarning)   # said on stderr, not warned
        assert cli.main(["convert", str(src), str(tmp_path / "out")]) == 0
    captured = capsys.readouterr()
    dotted = {"moe": "moe.", "model": ""}
    assert captured.err.splitlines() == [
        f"dropless: dropless convert {src}: {dotted[section]}{field}={value!r} is not written: "
        f"{arch}'s config.json cannot carry it ({why})"
        for section, field, value, why in settings]
    assert captured.out.startswith("wrote Hugging Face folder")
    out = json.loads((tmp_path / "out" / "config.json").read_text())
    assert not {"z_loss_coef", "capacity_factor", "mtp_loss_coef"} & set(out)


def test_dropless_to_hf_without_announce_warns_once_per_setting(converted, tmp_path):
    src = converted["qwen3_moe"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dropless_to_hf(str(src), str(tmp_path / "out"))
    notes = [str(w.message) for w in caught if issubclass(w.category, hf.NotCarriedWarning)]
    assert [n.split("=")[0] for n in notes] == ["moe.seq_aux_coef", "moe.z_loss_coef",
                                                "moe.bias_update_speed"]
    assert notes[0] == ("moe.seq_aux_coef=0.0005 is not written: Qwen3MoeForCausalLM's "
                        f"config.json cannot carry it ({TRAINING})")
