"""`dropless convert`, `eval`, `generate` and `train init_from=` on the committed fixtures."""
import json
import math

import numpy as np
import pytest

from dropless import cli, hf
from dropless.hf.reader import CheckpointReader
from dropless.model_dir import load_model
from tests._support.paths import HF_FIXTURES

FIX = HF_FIXTURES
TEXT = ("The quick brown fox jumps over the lazy dog. A stitch in time saves nine. "
        "All that glitters is not gold. Where there is smoke there is fire. ")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("conv") / "mixtral"
    assert cli.main(["convert", str(FIX / "mixtral"), str(out)]) == 0
    return out


def test_convert_round_trip_is_bitwise(converted, tmp_path):
    assert (converted / "config.json").is_file() and (converted / "params").is_dir()
    back = tmp_path / "back"
    assert cli.main(["convert", str(converted), str(back)]) == 0
    with CheckpointReader(FIX / "mixtral") as a, CheckpointReader(back) as b:
        assert sorted(a.names()) == sorted(b.names())
        for n in a.names():
            np.testing.assert_array_equal(a.read(n), b.read(n), err_msg=n)
    # config.json: every key back as it was, but transformers_version (dropless wrote this one)
    # and `dtype`, which comes back in its 4.x spelling, torch_dtype
    src = json.loads((FIX / "mixtral" / "config.json").read_text())
    out = json.loads((back / "config.json").read_text())
    assert {k: v for k, v in src.items() if k not in ("transformers_version", "dtype")} == \
        {k: v for k, v in out.items() if k not in ("rope_scaling", "attention_bias",
                                                   "torch_dtype")}
    assert out["torch_dtype"] == src["dtype"] and out["max_position_embeddings"] == 131072


def test_convert_error_is_one_line(tmp_path, capsys):
    src = tmp_path / "gpt2"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    from safetensors.numpy import save_file
    save_file({"x": np.zeros(2, np.float32)}, str(src / "model.safetensors"))
    assert cli.main(["convert", str(src), str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))
    err = capsys.readouterr().err
    conf = src / "config.json"
    assert err.startswith(f"dropless: error: {conf}: architectures=['GPT2LMHeadModel']")


def _jit_forward(params, tokens, cfg):
    import jax
    from dropless.models.decoder import forward
    cfg = cfg.replace(moe=cfg.moe.replace(gmm_backend="reference"))   # compiles faster
    return np.asarray(jax.jit(lambda p, t: forward(p, t, cfg)[0])(params, tokens), np.float64)


def test_eval_matches_forward(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"text": TEXT * 2}) for _ in range(2)) + "\n")
    assert cli.main(["eval", f"hf:{FIX / 'mixtral'}", "--data", str(data), "--seq-len", "16",
                     "--batch-size", "5", "--tokenizer", "byte"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["perplexity"] == pytest.approx(math.exp(out["loss"]))
    # by hand: the same windows (the last batch is padded) through forward + log-softmax
    cfg, params = hf.load(FIX / "mixtral")
    toks = np.frombuffer((TEXT * 2).encode(), np.uint8).astype(np.int32)
    stream = np.concatenate([toks, [0], toks, [0]])
    n = stream.size // 17
    assert n % 5   # a partial last batch
    win = stream[: n * 17].reshape(n, 17)
    logits = _jit_forward(params, win[:, :-1], cfg)
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, win[:, 1:, None], -1)
    assert out["windows"] == n and out["tokens"] == n * 16
    assert out["loss"] == pytest.approx(nll.mean(), rel=1e-4)


def test_eval_of_data_shorter_than_one_window_names_the_file(tmp_path, capsys):
    """Refused in one line naming --data and its token count (2 bytes and the end-of-document
    id), before the model is read."""
    data = tmp_path / "short.txt"
    data.write_text("hi")
    assert cli.main(["eval", f"hf:{FIX / 'mixtral'}", "--data", str(data), "--seq-len", "16",
                     "--tokenizer", "byte"]) == 2
    err = capsys.readouterr().err
    assert err == (f"dropless: error: dropless eval: --data={str(data)!r}: the data has 3 tokens, "
                   "fewer than seq_len + 1 = 17; lower --seq-len\n"), err


@pytest.mark.parametrize("direction", ["hf", "dropless"])
def test_a_dtype_no_model_holds_is_refused_not_run_as_another(converted, tmp_path, capsys,
                                                              direction):
    """--dtype float64 would run (and be written) as float32 while the config said float64:
    refused in one line, nothing written; numpy's spellings of the others are named as such."""
    src = str(FIX / "mixtral") if direction == "hf" else str(converted)
    out = tmp_path / "out"
    assert cli.main(["convert", src, str(out), "--dtype", "float64"]) == 2
    assert capsys.readouterr().err == (
        f"dropless: error: dropless convert {src}: --dtype='float64' is not a model dtype (one "
        "of float32, bfloat16, float16; float64 runs as float32 in JAX)\n")
    assert not out.exists() and not list(tmp_path.iterdir())
    assert cli.main(["convert", src, str(out), "--dtype", "half"]) == 0
    cfg, params = hf.load(out) if direction == "dropless" else load_model(str(out))
    assert (cfg.dtype, cfg.weight_dtype, str(params["embed"]["w_VD"].dtype)) == ("float16",) * 3


def test_generate_greedy_and_sampled(capsys):
    from dropless.models.generate import generate
    cfg, params = hf.load(FIX / "qwen3_moe")
    prompt = np.frombuffer(b"abcd", np.uint8).astype(np.int32)
    ids = generate(cfg, params, prompt, max_new_tokens=3)
    assert (ids[:4] == prompt).all() and ids.size == 7
    # each greedy token is the argmax given what came before (causal: one forward suffices)
    logits = _jit_forward(params, ids[None, :6], cfg)[0]
    assert list(ids[4:]) == [int(np.argmax(logits[t - 1])) for t in range(4, 7)]
    a = generate(cfg, params, prompt, max_new_tokens=3, temperature=1.0, seed=1)
    b = generate(cfg, params, prompt, max_new_tokens=3, temperature=1.0, seed=1)
    assert (a == b).all() and (a[:4] == prompt).all()
    with pytest.raises(ValueError, match="temperature=-1"):
        generate(cfg, params, prompt, max_new_tokens=1, temperature=-1)
    assert cli.main(["generate", f"hf:{FIX / 'qwen3_moe'}", "--prompt", "abcd",
                     "--max-new-tokens", "3", "--tokenizer", "byte"]) == 0   # same compilation
    assert capsys.readouterr().out.startswith("abcd")


def test_init_from_sets_model_and_tokenizer(converted, tmp_path):
    from dropless.config_file import build_config
    cfg = build_config([("init_from", f"hf:{FIX / 'qwen3_moe'}"), ("tokenizer", "byte")])
    assert cfg.model == hf.read_config(FIX / "qwen3_moe")[0] and cfg.tokenizer == "byte"
    hfdir = tmp_path / "withtok"
    hfdir.mkdir()
    for p in (FIX / "mixtral").iterdir():
        (hfdir / p.name).symlink_to(p)
    (hfdir / "tokenizer.json").write_text("{}")
    cfg = build_config([("init_from", f"hf:{hfdir}"), ("model.moe.gmm_backend", "reference")])
    assert cfg.tokenizer == str(hfdir / "tokenizer.json")
    assert cfg.model.moe.gmm_backend == "reference"     # the user's overrides still apply
    cfg = build_config([("init_from", str(converted)), ("tokenizer", "byte")])
    assert cfg.model == hf.read_config(FIX / "mixtral")[0]


def test_init_from_refuses_a_different_model(converted, tmp_path):
    from dropless.config_file import build_config
    from dropless.train.init_from import initial_params
    cfg = build_config([("init_from", str(converted)), ("model.moe.top_k", 1),
                        ("tokenizer", "byte")])
    with pytest.raises(ValueError, match="model.moe.top_k: 1 != 2"):
        initial_params(cfg)


def test_fine_tune_from_converted_checkpoint_lowers_heldout_loss(converted, tmp_path, capsys):
    """Fine-tune (a copy of) the converted Mixtral fixture on text; the held-out loss (different
    sentences of the same kind) falls, measured with the converted and the trained weights. The
    run exports the source's config.json keys after the folder it started from is gone."""
    import shutil
    from dropless.config_file import build_config
    from dropless.model_dir.kept_config import KEPT_FILE
    from dropless.models.evaluate import evaluate
    from dropless.model_dir.weights import load_model
    from dropless.model_dir import load_dropless
    from dropless.train.loop import train
    data = tmp_path / "train.txt"
    data.write_text(TEXT * 40)
    held = np.frombuffer(("Where there is a will there is a way. The early bird catches the "
                          "worm. A stitch in time saves nine. ").encode() * 3, np.uint8)
    start = tmp_path / "start"
    shutil.copytree(converted, start)
    cfg = build_config([("init_from", str(start)), ("tokenizer", "byte"),
                        ("data", str(data)), ("steps", 12),
                        ("per_device_batch_size", 8), ("seq_len", 32), ("warmup_steps", 2),
                        ("learning_rate", 3e-3), ("eval_every", 100), ("checkpoint_every", 0),
                        ("time_kernels", False), ("async_checkpoints", False),
                        ("run_dir", str(tmp_path)), ("run_name", "ft"),
                        ("model.moe.gmm_backend", "reference")])
    mcfg, p0 = load_model(str(converted))
    mcfg = mcfg.replace(moe=mcfg.moe.replace(gmm_backend="reference"))
    before = evaluate(mcfg, p0, held, seq_len=32, batch_size=4)["loss"]
    result = train(cfg, echo=lambda s: None)
    _, p1 = load_dropless(result.run_dir)
    after = evaluate(mcfg, p1, held, seq_len=32, batch_size=4)["loss"]
    assert after < before - 0.5, (before, after)
    # the run keeps the config keys of the model it started from (init_from) and goes back to
    # Hugging Face with them, not its own seq_len=32 as the context, once that folder is gone
    assert (result.run_dir / KEPT_FILE).read_bytes() == (converted / KEPT_FILE).read_bytes()
    shutil.rmtree(start)
    capsys.readouterr()
    assert cli.main(["convert", str(result.run_dir), str(tmp_path / "ft_hf")]) == 0
    assert capsys.readouterr().err == ""
    back = json.loads((tmp_path / "ft_hf" / "config.json").read_text())
    assert (back["max_position_embeddings"], back["bos_token_id"], back["eos_token_id"],
            back["router_jitter_noise"]) == (131072, 1, 2, 0.0)
