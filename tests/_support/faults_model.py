"""Fault rows: `dropless eval` / `generate` / `convert` arguments, model folders, tokenizers and
non-destructive writes. Every refusal is one line naming the argument and the command that was
run, before any compile; nothing on disk changes."""
import json
import shutil
from pathlib import Path

from tests._support.fault import Fault, Result, run_dropless
from tests._support.paths import HF_FIXTURES

FIX = HF_FIXTURES
MIX = f"hf:{FIX / 'mixtral'}"


def _text(case, artifacts=None):
    (case / "d.txt").write_text("hello world, hello there. " * 4)


def _empty_jsonl(case, artifacts=None):
    (case / "empty.jsonl").write_text("\n\n")


def _hf_copy(case, artifacts=None):
    shutil.copytree(FIX / "mixtral", case / "hf")


def _sentencepiece_only(case, artifacts=None):
    _hf_copy(case)
    (case / "hf" / "tokenizer.model").write_bytes(b"\x0a\x05\x0a\x01a\x15\x00\x00\x00\x00")
    _text(case)


def _nan_weights(case, artifacts=None):
    """The Mixtral fixture with a NaN embedding table (eval's loss is NaN)."""
    import numpy as np
    from safetensors.numpy import load_file, save_file
    _hf_copy(case)
    name = "model.embed_tokens.weight"
    shard = case / "hf" / json.loads((case / "hf" / "model.safetensors.index.json").read_text()
                                     )["weight_map"][name]
    tensors = load_file(str(shard))
    tensors[name] = np.full_like(tensors[name], np.nan)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    _text(case)


def _dropless(case, artifacts):
    artifacts.copy("model_dropless", case)
    _text(case)


def _dropless_and_hf(case, artifacts):
    _dropless(case, artifacts)
    _hf_copy(case)


def _link(case, artifacts=None):
    _hf_copy(case)
    (case / "link").symlink_to(case / "hf")


def build_dropless(dest: Path, env: dict) -> None:
    res = run_dropless(["convert", str(FIX / "mixtral"), str(dest / "dl")], env, dest, 300)
    assert res.rc == 0, res.err


def _json_out(check):
    def run(case: Path, res: Result):
        check(json.loads(res.out.strip().splitlines()[-1]))
    return run


def _nan_is_null(out):
    assert out["loss"] is None and out["perplexity"] is None and "nan" in out["why_null"]


def _no_init_from(case: Path, res: Result):
    assert "init_from" not in res.err, res.err


def _refused(id_, argv, **kw) -> Fault:
    """A row refused (exit 2) before the model's weights are read or anything is computed:
    in-process (see `fault.Fault`)."""
    return Fault(id_, argv, rc=2, in_process=True, **kw)


BUILDERS = {"model_dropless": build_dropless}
EVAL = ["eval", MIX, "--data", "d.txt", "--tokenizer", "byte"]
GEN = ["generate", MIX, "--prompt", "hi", "--tokenizer", "byte"]

ROWS = [
    _refused("model-eval-seq-len-0", EVAL + ["--seq-len", "0"], setup=_text,
             words=("dropless eval", "--seq-len=0", ">= 1")),
    _refused("model-eval-seq-len-negative", EVAL + ["--seq-len", "-3"], setup=_text,
             words=("--seq-len=-3",)),
    _refused("model-eval-batch-size-0", EVAL + ["--batch-size", "0"], setup=_text,
             words=("--batch-size=0",)),
    _refused("model-eval-empty-jsonl",
             ["eval", MIX, "--data", "empty.jsonl", "--tokenizer", "byte"], setup=_empty_jsonl,
             words=("--data", "empty.jsonl", "no text")),
    _refused("model-eval-missing-data", ["eval", MIX, "--data", "nope.txt"],
             words=("--data", "nope.txt", "does not exist")),
    _refused("model-eval-bad-dtype", EVAL + ["--dtype", "int8"], setup=_text,
             words=("--dtype", "int8")),
    _refused("model-generate-max-new-tokens-negative", GEN + ["--max-new-tokens", "-2"],
             words=("dropless generate", "--max-new-tokens=-2")),
    _refused("model-generate-temperature-nan", GEN + ["--temperature", "nan"],
             words=("--temperature=nan", "finite")),
    _refused("model-generate-temperature-negative", GEN + ["--temperature", "-1"],
             words=("--temperature=-1",)),
    _refused("model-eval-hf-folder-without-tokenizer", ["eval", MIX, "--data", "d.txt"],
             setup=_text, words=("no tokenizer.json", "--tokenizer byte")),
    _refused("model-generate-sentencepiece-only", ["generate", "hf:hf", "--prompt", "hi"],
             setup=_sentencepiece_only, unchanged=("hf",),
             words=("only a SentencePiece tokenizer.model", "save_pretrained",
                    "--tokenizer byte")),
    _refused("model-train-init-from-hf-without-tokenizer",
             ["train", f"init_from={MIX}", "steps=1"],
             words=("init_from=", "no tokenizer.json", "tokenizer=byte")),
    _refused("model-eval-hf-folder-without-prefix", ["eval", "hf", "--data", "d.txt"],
             setup=lambda c, a: (_hf_copy(c), _text(c)), check=_no_init_from,
             words=("dropless eval hf", "looks like a Hugging Face folder",
                    "dropless eval hf:hf")),
    _refused("model-eval-not-a-folder", ["eval", "nosuch", "--data", "d.txt"], setup=_text,
             words=("dropless eval nosuch", "no such folder")),
    _refused("model-convert-no-config", ["convert", "empty", "out"], check=_no_init_from,
             setup=lambda c, a: (c / "empty").mkdir(), words=("dropless convert empty",
                                                             "no config.json")),
    Fault("model-eval-nan-loss-is-null", ["eval", "hf:hf", "--data", "d.txt", "--seq-len", "8",
                                          "--batch-size", "1", "--tokenizer", "byte"],
          rc=0, setup=_nan_weights, words=("why_null",), check=_json_out(_nan_is_null)),
    Fault("model-eval-dtype-honoured-for-dropless-dir",
          ["eval", "dl", "--data", "d.txt", "--seq-len", "8", "--batch-size", "1",
           "--tokenizer", "byte", "--dtype", "bfloat16"], rc=0, setup=_dropless,
          words=('"dtype": "bfloat16"',)),
    _refused("model-convert-hf-onto-itself", ["convert", "hf", "hf"], setup=_hf_copy,
             unchanged=("hf",), words=("dropless convert hf hf", "is the source")),
    _refused("model-convert-dropless-onto-itself", ["convert", "dl", "./x/../dl", "--overwrite"],
             setup=_dropless, unchanged=("dl",), words=("is the source",)),
    _refused("model-convert-onto-symlink-of-source", ["convert", "hf", "link", "--overwrite"],
             setup=_link, unchanged=("hf",), words=("is the source",)),
    _refused("model-convert-non-empty-destination", ["convert", "dl", "hf"],
             setup=_dropless_and_hf, unchanged=("hf", "dl"), words=("not empty", "--overwrite")),
    _refused("model-convert-destination-holds-source", ["convert", "dl/../hf", ".", "--overwrite"],
             setup=_dropless_and_hf, unchanged=(".",), words=("holds the source",)),
    _refused("model-convert-shard-size-0", ["convert", "dl", "out", "--shard-size", "0"],
             setup=_dropless, unchanged=("dl",), words=("--shard-size=0",)),
]
