"""The config.json form of a TrainConfig: what a run directory and a dropless directory hold.

`to_dict` writes nested plain data (`dataclasses.asdict`), `from_dict` reads it back validated,
and `upgrade` brings a config.json written in the flat mesh form (`fsdp_parallelism`,
`dcn_fsdp`, ... at the top, and the MoE layer's `devices_per_node`) to the current one, so an
old run resumes and an old converted model loads; a whole saved config without `packing`
(written before documents were packed with segment ids) gets packing="stream", how it trained,
and a model without `init` (written before init schemes) gets init="legacy", how it started.
Pure data: no JAX computation, no files.

Layer: `model_dir` (docs/architecture.md); reads `config` and `compat.maxtext`'s table of the
flat mesh keys.
"""
from __future__ import annotations

import dataclasses

from dropless.compat import maxtext
from dropless.config import MeshConfig, ModelConfig, MoEConfig, TrainConfig


def to_dict(cfg: TrainConfig) -> dict:
    """The config as nested plain data (YAML/JSON ready)."""
    return dataclasses.asdict(cfg)


def upgrade(tree: dict) -> dict:
    """A saved config (a run's or a converted model's config.json) in the current form: the
    flat mesh keys (`fsdp_parallelism`, `dcn_fsdp`, ...) put under `mesh`, the MoE layer's
    `devices_per_node` dropped (the mesh says it), and packing="stream" for a whole config
    (one with `seq_len`) saved before the `packing` key existed: such a run joined documents
    with EOS across windows, and resumes so; init="legacy" for a model saved before the `init`
    key existed (its weights were drawn so; the other init keys take their defaults, which
    legacy does not read). A current-form tree comes back equal; `tree` is
    not changed."""
    out = {k: v for k, v in tree.items() if k not in maxtext.FORMER_KEYS}
    if "seq_len" in out and "packing" not in out:
        out["packing"] = "stream"
    mesh = dict(out.get("mesh") or {})
    for old, new in maxtext.FORMER_KEYS.items():
        if old in tree:
            mesh.setdefault(new.split(".", 1)[1], tree[old])
    if mesh:
        out["mesh"] = mesh
    model = out.get("model")
    if isinstance(model, dict) and "init" not in model:
        model = out["model"] = {**model, "init": "legacy"}
    if isinstance(model, dict) and isinstance(model.get("moe"), dict) \
            and "devices_per_node" in model["moe"]:
        moe = {k: v for k, v in model["moe"].items() if k != "devices_per_node"}
        out["model"] = {**model, "moe": moe}
    return out


SECTIONS = {"": TrainConfig, "model.": ModelConfig, "model.moe.": MoEConfig, "mesh.": MeshConfig}


def unknown_keys(tree: dict) -> list[str]:
    """The dotted keys of a saved config (current form, see `upgrade`) that no config field
    names (written by another version of dropless, or by hand)."""
    bad = []
    for prefix, cls in SECTIONS.items():
        node = tree
        for part in prefix.strip(".").split(".") if prefix else ():
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            names = {f.name for f in dataclasses.fields(cls)}
            bad += [prefix + k for k in node if k not in names]
    return bad


def check_keys(tree: dict, where: str) -> None:
    """Refuse a saved config holding a key no field names, naming `where` (the file) and it."""
    bad = unknown_keys(upgrade(tree))
    if bad:
        raise ValueError(f"{where} holds {', '.join(map(repr, bad))}, which this version of "
                         "dropless does not know (written by another version, or edited?); "
                         "remove it, or use the version that wrote it")


def from_dict(tree: dict) -> TrainConfig:
    """Nested plain data (as `to_dict` writes, or the flat mesh form, see `upgrade`) -> a
    validated TrainConfig. Raises ValueError naming a key no field names."""
    check_keys(tree, "the config")
    tree = upgrade(tree)
    m = dict(tree["model"])
    moe = m.pop("moe", None)
    model = ModelConfig(**m, moe=None if moe is None else MoEConfig(**moe))
    rest = {k: v for k, v in tree.items() if k not in ("model", "mesh")}
    return TrainConfig(**rest, model=model, mesh=MeshConfig(**tree.get("mesh", {})))
