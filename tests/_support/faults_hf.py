"""Fault rows: broken Hugging Face checkpoints, each through
`dropless convert BAD OUT`: exit 2, one line naming the file and the key or tensor, the source
folder unchanged and nothing written. In-process (refused from config.json and the safetensors
headers), except the two refused while weights are read, after `hf.load` has made a random key
(a JAX computation)."""
import json
import shutil
from pathlib import Path

import numpy as np

from tests._support.fault import Fault
from tests._support.paths import HF_FIXTURES

FIX = HF_FIXTURES


def _copy(name: str, case: Path) -> Path:
    d = case / "bad"
    shutil.copytree(FIX / name, d, ignore=shutil.ignore_patterns("grads.safetensors",
                                                                 "reference.npz"))
    return d


def _config(name: str, edit):
    def setup(case, _artifacts):
        d = _copy(name, case)
        c = json.loads((d / "config.json").read_text())
        edit(c)
        (d / "config.json").write_text(json.dumps(c, indent=2))
    return setup


def _file(name: str, edit):
    def setup(case, _artifacts):
        edit(_copy(name, case))
    return setup


def _truncate(rel: str, keep: int | None = None, cut: int | None = None):
    def edit(d: Path):
        p = d / rel
        data = p.read_bytes()
        p.write_bytes(data[:keep] if keep is not None else data[:-cut])
    return edit


def _int32_weight(d: Path):
    from safetensors.numpy import load_file, save_file
    p = d / "model.safetensors"
    t = load_file(str(p))
    w = t["model.layers.0.self_attn.q_proj.weight"]
    t["model.layers.0.self_attn.q_proj.weight"] = (w * 1e9).astype(np.int32)
    save_file(t, str(p), metadata={"format": "pt"})


def _drop_tensor(d: Path):
    from safetensors.numpy import load_file, save_file
    p = d / "model.safetensors"
    t = load_file(str(p))
    del t["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(t, str(p), metadata={"format": "pt"})


def _index(edit):
    def run(d: Path):
        p = d / "model.safetensors.index.json"
        doc = json.loads(p.read_text())
        edit(doc)
        p.write_text(json.dumps(doc))
    return run


def _header_text(rel: str, edit):
    """Rewrite the JSON header of safetensors file `rel` as `edit(header text) -> text`, the data
    bytes after it kept as they are (a header that lies about the data it describes)."""
    def run(d: Path):
        p = d / rel
        raw = p.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        text = edit(raw[8:8 + n].decode()).encode()
        text += b" " * (-len(text) % 8)
        p.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])
    return run


def _header(rel: str, edit):
    """As `_header_text`, `edit(header dict)` changing the parsed header in place."""
    def as_text(text: str) -> str:
        h = json.loads(text)
        edit(h)
        return json.dumps(h)
    return _header_text(rel, as_text)


def _overlap(h: dict) -> None:
    """Two tensors of one size: the second's byte range becomes the first's."""
    by_size: dict = {}
    for name, m in sorted(h.items()):
        if name != "__metadata__":
            by_size.setdefault(m["data_offsets"][1] - m["data_offsets"][0], []).append(name)
    a, b = next(v for v in by_size.values() if len(v) >= 2)[:2]
    h[b]["data_offsets"] = list(h[a]["data_offsets"])


def _twice(text: str) -> str:
    """The first tensor's entry written a second time at the end of the header."""
    h = json.loads(text)
    name = next(k for k in h if k != "__metadata__")
    return text.rstrip()[:-1] + f", {json.dumps(name)}: {json.dumps(h[name])}}}"


def _dtype(value):
    def edit(h: dict) -> None:
        h[Q_PROJ]["dtype"] = value
    return edit


def _append(rel: str, data: bytes):
    def run(d: Path):
        with open(d / rel, "ab") as fh:
            fh.write(data)
    return run


def _outside_shard(d: Path):
    """The index names `../outside/<shard>`, a copy of a real shard beside the folder (what a
    reader that joins paths blindly would read)."""
    outside = d.parent / "outside"
    outside.mkdir()
    shard = "model-00001-of-00006.safetensors"
    shutil.copy(d / shard, outside / shard)
    _index(lambda i: i["weight_map"].update(
        {k: f"../outside/{shard}" for k, v in i["weight_map"].items() if v == shard}))(d)


def _write(rel: str, text: str):
    return lambda d: (d / rel).write_text(text)


def _drop(key):
    return lambda c: c.pop(key)


def _row(id_, setup, words, src="bad", unchanged=("bad", "out"), in_process=True):
    """A refused `convert`; in-process unless the refusal comes after a JAX computation (see
    `fault.Fault`)."""
    return Fault(id_, ["convert", src, "out"], rc=2, words=words, setup=setup,
                 unchanged=unchanged, in_process=in_process)


Q_PROJ = "model.layers.0.self_attn.q_proj.weight"
ROWS = [
    _row("hf-truncated-shard", _file("mixtral", _truncate("model-00006-of-00006.safetensors",
                                                          cut=100)),
         ("model-00006-of-00006.safetensors", "tensor", "truncated")),
    _row("hf-truncated-header", _file("qwen3_moe", _truncate("model.safetensors", keep=60)),
         ("model.safetensors", "header", "truncated")),
    _row("hf-int32-weight", _file("qwen3_moe", _int32_weight),
         ("model.safetensors", Q_PROJ, "I32", "expected a float"), in_process=False),
    _row("hf-missing-tensor", _file("tf5/qwen3_moe", _drop_tensor),
         ("model.layers.1.mlp.experts.3.up_proj.weight", "not in the checkpoint"),
         in_process=False),
    _row("hf-rope-scaling-string", _config("deepseek_v3_yarn",
                                           lambda c: c.update(rope_scaling="yarn")),
         ("config.json", "rope_scaling='yarn'")),
    _row("hf-yarn-without-factor", _config("deepseek_v3_yarn",
                                           lambda c: c["rope_scaling"].pop("factor")),
         ("config.json", "rope_scaling.factor is missing")),
    _row("hf-no-hidden-size", _config("mixtral", _drop("hidden_size")),
         ("config.json", "hidden_size is missing")),
    _row("hf-topk-null", _config("qwen3_moe", lambda c: c.update(num_experts_per_tok=None)),
         ("config.json", "num_experts_per_tok=None")),
    _row("hf-index-without-weight-map", _file("mixtral", _index(lambda i: i.pop("weight_map"))),
         ("model.safetensors.index.json", "weight_map")),
    _row("hf-config-not-json", _file("mixtral", _write("config.json", '{"architectures": [')),
         ("config.json", "not valid JSON"), src="hf:bad"),
    _row("hf-index-not-json", _file("mixtral", _write("model.safetensors.index.json", "{oops")),
         ("model.safetensors.index.json", "not valid JSON")),
    _row("hf-model-type-contradicts", _config("mixtral",
                                              lambda c: c.update(model_type="qwen3_moe")),
         ("config.json", "model_type='qwen3_moe'", "architectures")),
    _row("hf-tensor-not-in-weight-map", _file("mixtral", _index(
        lambda i: i["weight_map"].pop("model.norm.weight"))),
         ("model.safetensors.index.json", "model.norm.weight", "missing from weight_map")),
    _row("hf-tf5-rope-theta-contradicts", _config("tf5/mixtral",
                                                  lambda c: c.update(rope_theta=10000.0)),
         ("config.json", "rope_theta=10000.0", "rope_parameters.rope_theta=1000000.0")),
    # the index names only files inside the folder
    _row("hf-index-shard-outside", _file("mixtral", _outside_shard),
         ("model.safetensors.index.json", "../outside/", "not a file of this folder"),
         unchanged=("bad", "out", "outside")),
    _row("hf-index-shard-absolute", _file("mixtral", _index(lambda i: i["weight_map"].update(
        {"model.norm.weight": "/etc/passwd"}))),
         ("model.safetensors.index.json", "'/etc/passwd'", "not a file of this folder")),
    _row("hf-index-shard-is-a-folder", _file("mixtral", _index(lambda i: i["weight_map"].update(
        {"model.norm.weight": "."}))),
         ("model.safetensors.index.json", "'.'", "not a file of this folder")),
    # the safetensors header, every entry and the layout of all of them, before any read
    _row("hf-header-overlapping-tensors", _file("qwen3_moe", _header("model.safetensors",
                                                                      _overlap)),
         ("model.safetensors", "overlaps")),
    _row("hf-header-tensor-twice", _file("qwen3_moe", _header_text("model.safetensors", _twice)),
         ("model.safetensors", "twice")),
    _row("hf-header-unknown-dtype", _file("qwen3_moe", _header("model.safetensors",
                                                                _dtype("F8_E8M0"))),
         ("model.safetensors", Q_PROJ, "'F8_E8M0'", "F32")),
    _row("hf-header-dtype-not-a-string", _file("qwen3_moe", _header("model.safetensors",
                                                                     _dtype(["F32"]))),
         ("model.safetensors", Q_PROJ, "['F32']")),
    _row("hf-header-offsets-negative", _file("qwen3_moe", _header(
        "model.safetensors", lambda h: h[Q_PROJ].update(data_offsets=[-4, 0]))),
         ("model.safetensors", Q_PROJ, "data_offsets")),
    _row("hf-header-bytes-after-last-tensor", _file("qwen3_moe", _append("model.safetensors",
                                                                          b"\0" * 64)),
         ("model.safetensors", "64 bytes no tensor covers")),
    _row("hf-header-length-huge", _file("qwen3_moe", lambda d: (d / "model.safetensors").write_bytes(
        (2**40).to_bytes(8, "little") + b"{}")),
         ("model.safetensors", "header of 1099511627776 bytes", "limit")),
]
