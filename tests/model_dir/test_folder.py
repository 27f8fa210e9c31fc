"""`dropless.model_dir`: every folder format read back as written; `hf:` specs good and bad; a
run's config.json, old (no preset) and new; what init_from implies."""
import json
from pathlib import Path

import numpy as np
import pytest

from dropless import model_dir
from dropless.config_file import build_config
from dropless.model_dir import from_dict, to_dict
from tests._support.paths import HF_FIXTURES

FIX = HF_FIXTURES
QWEN = FIX / "qwen3_moe"


@pytest.mark.parametrize("spec, folder, hf", [
    ("hf:some/dir", Path("some/dir"), True),
    ("hf:/abs/dir", Path("/abs/dir"), True),
    ("runs/r1", Path("runs/r1"), False),
    (Path("conv"), Path("conv"), False),
    ("hfdir", Path("hfdir"), False),          # no colon: a dropless directory named hf...
])
def test_parse_spec_good(spec, folder, hf):
    got = model_dir.parse_spec(spec)
    assert (got.folder, got.hf, got.text) == (folder, hf, str(spec))
    assert model_dir.is_hf(spec) == hf


@pytest.mark.parametrize("spec", ["", "hf:"])
def test_parse_spec_bad(spec):
    with pytest.raises(ValueError, match="is empty"):
        model_dir.parse_spec(spec)


def test_hf_spec_reads_the_folders_model_as_preset():
    from dropless.hf import read_config
    from dropless.presets import get_preset
    assert model_dir.hf_model_config(f"hf:{QWEN}") == read_config(QWEN)[0]
    assert get_preset(f"hf:{QWEN}") == read_config(QWEN)[0]


def test_names_architectures(tmp_path):
    assert model_dir.names_architectures(str(QWEN), what="x")       # an HF folder without hf:
    assert model_dir.names_architectures(f"hf:{tmp_path}", what="x")   # hf: says so
    assert not model_dir.names_architectures(str(tmp_path), what="x")  # no config.json
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"^dropless convert d: .*config.json is not valid JSON"):
        model_dir.names_architectures(str(tmp_path), what="dropless convert d")


def test_dropless_config_refusals(tmp_path):
    with pytest.raises(ValueError, match="no config.json in .* hf:DIR"):
        model_dir.read_dropless_config(tmp_path)
    (tmp_path / "config.json").write_text('{"architectures": ["X"]}')
    with pytest.raises(ValueError, match=f"looks like a Hugging Face folder; write "
                                         f"init_from='hf:{tmp_path}'"):
        model_dir.read_dropless_config(tmp_path)
    with pytest.raises(ValueError, match="write dropless eval hf:d$"):
        model_dir.read_dropless_config(tmp_path, what="dropless eval d",
                                       as_hf="dropless eval hf:d")
    (tmp_path / "config.json").write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError, match="is not valid JSON"):
        model_dir.read_dropless_config(tmp_path)


def test_run_config_new_and_old(tmp_path):
    cfg = build_config([("preset", "deepseek3-test"), ("steps", 9)])
    new = tmp_path / "new"
    new.mkdir()
    (new / "config.json").write_text(json.dumps(to_dict(cfg)))
    saved = model_dir.read_run_config(new)
    assert from_dict(saved) == cfg and model_dir.saved_preset(saved) == "deepseek3-test"
    assert model_dir.saved_run_config(new) == saved
    # an old run's config.json, written before it held the preset: tiny, as it was then
    old = tmp_path / "old"
    old.mkdir()
    tree = to_dict(build_config([("steps", 3)]))
    del tree["preset"]
    (old / "config.json").write_text(json.dumps(tree))
    assert model_dir.saved_preset(model_dir.read_run_config(old)) == "tiny"
    from dropless.cli import train as train_cli
    import argparse
    p = argparse.ArgumentParser()
    train_cli.add_arguments(p)
    resumed = train_cli.config_from_args(p.parse_args(["--resume", str(old)]))
    assert resumed.preset == "tiny" and resumed.steps == 3 and resumed.run_name == "old"
    assert model_dir.saved_run_config(tmp_path / "none") is None


def test_run_config_refusals(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        model_dir.read_run_config(tmp_path / "nope")
    with pytest.raises(ValueError, match="not a run directory"):
        model_dir.read_run_config(tmp_path)
    (tmp_path / "config.json").write_text("[")
    with pytest.raises(ValueError, match="not readable JSON"):
        model_dir.read_run_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(to_dict(build_config())))
    (tmp_path / "params").mkdir()
    with pytest.raises(ValueError, match="a model directory .* use init_from="):
        model_dir.read_run_config(tmp_path)


def test_folder_tokenizer(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer.json.*pass tokenizer=byte"):
        model_dir.folder_tokenizer(f"hf:{tmp_path}")
    assert model_dir.folder_tokenizer(str(tmp_path)) == "byte"   # nothing there says otherwise
    (tmp_path / "config.json").write_text(json.dumps({"model": {}, "tokenizer": ""}))
    assert model_dir.folder_tokenizer(str(tmp_path)) == ""       # converted without one
    (tmp_path / "tokenizer.json").write_text("{}")
    assert model_dir.folder_tokenizer(str(tmp_path)) == str(tmp_path / "tokenizer.json")
    assert model_dir.folder_tokenizer(f"hf:{tmp_path}") == str(tmp_path / "tokenizer.json")


def test_init_from_defaults(tmp_path):
    spec = f"hf:{QWEN}"
    assert model_dir.init_from_defaults(spec, preset_given=False, tokenizer_given=True) == \
        (spec, None, None)
    with pytest.raises(ValueError, match=r"^init_from='hf:.*no tokenizer.json"):
        model_dir.init_from_defaults(spec, preset_given=True, tokenizer_given=False)
    cfg = build_config([("preset", "deepseek3-test"), ("tokenizer", "")])
    (tmp_path / "config.json").write_text(json.dumps(to_dict(cfg)))
    preset, model, tok = model_dir.init_from_defaults(str(tmp_path), preset_given=False,
                                                      tokenizer_given=True)
    assert (preset, model, tok) == ("deepseek3-test", to_dict(cfg)["model"], None)
    with pytest.raises(ValueError, match="names no tokenizer"):
        model_dir.init_from_defaults(str(tmp_path), preset_given=True, tokenizer_given=False)


def test_dropless_directory_reads_back_what_was_written(tmp_path):
    """write_dropless -> load_dropless / load_model / init_from: the same model, parameters and
    tokenizer; and to an HF folder and back: the same parameters."""
    import jax
    from dropless import hf
    from dropless.model_dir.weights import (dropless_to_hf, hf_to_dropless, load_model,
                                            write_dropless)
    from dropless.model_dir import load_dropless
    cfg, params = hf.load(QWEN, dtype="float32")
    out = write_dropless(tmp_path / "dl", cfg, params)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "hashes.json", "params"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dl"]      # no lock or partial left
    tcfg, back = load_dropless(out)
    assert tcfg.model == cfg and tcfg.tokenizer == ""
    same = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))),
                        params, back)
    assert all(jax.tree.leaves(same))
    mcfg, cast = load_model(str(out), dtype="bfloat16")
    assert mcfg.weight_dtype == "bfloat16"
    assert str(cast["embed"]["w_VD"].dtype) == "bfloat16"
    assert build_config([("init_from", str(out)), ("tokenizer", "byte")]).model == cfg
    # HF -> dropless -> HF -> (read back) equals the source
    conv = hf_to_dropless(f"hf:{QWEN}", str(tmp_path / "conv"), dtype="float32")
    hf_out = dropless_to_hf(str(conv), str(tmp_path / "hf_out"))
    cfg2, params2 = load_model(f"hf:{hf_out}", dtype="float32")
    assert cfg2 == cfg
    same = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))),
                        params, params2)
    assert all(jax.tree.leaves(same))


def test_model_differences_names_each_field():
    from dropless.presets import get_preset
    from dropless.train.init_from import model_differences
    a = get_preset("deepseek3-test")
    assert model_differences(a, a) == []
    assert model_differences(a, a.replace(dtype="bfloat16")) == []
    # the attention kernel and its segment bound change no parameter
    assert model_differences(a, a.replace(attention_kernel="cudnn_thd",
                                          max_segments_per_seq=8)) == []
    b = a.replace(num_layers=4, moe=a.moe.replace(top_k=3))
    assert model_differences(a, b) == ["model.num_layers: 3 != 4", "model.moe.top_k: 2 != 3"]


def test_a_dropless_directory_is_verified_against_its_hashes(tmp_path):
    """hashes.json holds every array's xxh3-64 hash; an array whose bytes changed on disk is
    refused in one line naming the folder (placed from the zstd framing, see ckpt_damage); a
    folder written before hashes were recorded (none) still loads."""
    from dropless import hf
    from dropless.model_dir import load_dropless
    from dropless.model_dir.weights import HASHES, write_dropless
    from tests._support import ckpt_damage
    cfg, params = hf.load(QWEN, dtype="float32")
    out = write_dropless(tmp_path / "dl", cfg, params)
    hashes = json.loads((out / HASHES).read_text())
    assert hashes["hash"] == "xxh3_64" and len(hashes["hashes"]) == len(jax_leaves(params))
    ckpt_damage.flip_values(out, under="params")
    with pytest.raises(ValueError, match=r"dl/params is damaged: the bytes of .* differ from "
                                         r"the xxh3_64 hash.*dropless convert"):
        load_dropless(out, what="dropless eval dl")
    (out / HASHES).unlink()
    load_dropless(out)                        # no hashes: read as written, unchecked


def jax_leaves(tree):
    import jax
    return jax.tree.leaves(tree)


def test_a_dropless_directory_read_under_its_config_json(tmp_path):
    """params/ is read as config.json describes it: another parameter layout (scan_layers) is
    converted, bitwise; another shape or dtype is refused in one line naming the array and
    config.json, never called damage (the bytes are intact)."""
    import jax
    from dropless import hf
    from dropless.model_dir import load_dropless
    from dropless.model_dir.weights import write_dropless
    from dropless.models.scan import to_canonical_layout
    cfg, params = hf.load(QWEN, dtype="float32")
    out = write_dropless(tmp_path / "dl", cfg, params)
    written = json.loads((out / "config.json").read_text())

    def edited(**model):
        conf = json.loads(json.dumps(written))
        conf["model"].update(model)
        (out / "config.json").write_text(json.dumps(conf))
    edited(scan_layers=True)
    tcfg, back = load_dropless(out)
    assert tcfg.model.scan_layers
    same = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))),
                        params, to_canonical_layout(back))
    assert all(jax.tree.leaves(same))
    edited(d_ff=cfg.d_ff * 2)
    with pytest.raises(ValueError) as e:
        load_dropless(out, what="dropless eval dl")
    text = str(e.value)
    assert text.startswith(f"dropless eval dl: {out / 'params'} holds another model: ") and \
        f"({cfg.d_ff}, {cfg.d_model}) float32 in the checkpoint, ({cfg.d_ff * 2}, {cfg.d_model}) " \
        "float32 asked for" in text, text
    assert str(out / "config.json") in text and "damaged" not in text and "\n" not in text
