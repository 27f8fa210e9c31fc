"""The placement table (parallel/sharding.py): every parameter of every model has an entry; the
dense FFN and the shared expert have their own; unknown paths are an error naming them; a whole
train state places parameters and optimizer moments alike; and on 8-device host meshes the
placement equals MaxText's rule written out by hand as the oracle (routed experts: E over
expert, D over fsdp; every other matrix ZeRO-3 over fsdp x expert on its FSDP dim, the shared
experts' and dense FFN's by name, the others' largest divisible dim).

Legend: D model dim, F hidden dim, E experts.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from dropless import MeshConfig
from dropless.config import ModelConfig
from dropless.models import decoder
from dropless.parallel import sharding
from dropless.parallel.mesh import logical_to_spec, make_mesh
from dropless.presets import PRESETS

EIGHT = [MeshConfig(fsdp=2, expert=4), MeshConfig(data=2, fsdp=2, expert=2), MeshConfig(fsdp=8)]


def _small(cfg: ModelConfig) -> ModelConfig:
    """A preset at toy sizes, keeping its kind: attention, q_lora, qk-norm, layer pattern,
    dense-first layers, shared experts, MTP."""
    kw = dict(vocab_size=64, d_model=32, num_layers=min(cfg.num_layers, 4), d_ff=48, num_heads=4)
    if cfg.attention == "mla":
        kw.update(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                  q_lora_rank=min(cfg.q_lora_rank, 16))
    else:
        kw.update(head_dim=8 if cfg.head_dim else 0, num_kv_heads=min(cfg.num_kv_heads or 4, 2))
    if cfg.layer_pattern:
        kw["layer_pattern"] = cfg.layer_pattern[:kw["num_layers"]]
    else:
        kw["first_k_dense"] = min(cfg.first_k_dense, 1)
    if cfg.moe is not None:
        kw["moe"] = cfg.moe.replace(d_model=32, d_ff=16, num_experts=8, top_k=2,
                                    n_groups=min(cfg.moe.n_groups, 2), topk_groups=1)
    return cfg.replace(**kw)


def _variants():
    """Tiny variants of every preset: dense-first MLA, q_lora_rank=0, MHA (GQA, qk-norm,
    layer pattern), MTP, shared experts, a dense model, fused expert weights; each unrolled and
    scanned."""
    out = {name: _small(f()) for name, f in PRESETS.items()}
    ds = out["deepseek3-test"]
    out["dense"] = ds.replace(moe=None, first_k_dense=0, mtp_depth=1)
    out["mla-no-q-lora"] = ds.replace(q_lora_rank=0)
    out["fused"] = ds.replace(moe=ds.moe.replace(prefuse_moe_weights=True))
    out["mha-mtp"] = out["qwen3-30b-a3b"].replace(mtp_depth=1)
    return {f"{name}/{'scan' if s else 'unrolled'}": c.replace(scan_layers=s)
            for name, c in out.items() for s in (False, True)}


VARIANTS = _variants()


def _shapes(cfg):
    return jax.eval_shape(lambda k: decoder.init_params(k, cfg), jax.random.key(0))


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_every_parameter_of_every_model_has_an_entry(name):
    mesh = make_mesh(MeshConfig(fsdp=2, expert=4))
    shapes = _shapes(VARIANTS[name])
    specs = sharding.param_specs(shapes, mesh)   # raises for a path the table does not know
    assert jax.tree.structure(specs, is_leaf=lambda x: isinstance(x, P)) == \
        jax.tree.structure(shapes)


def test_the_variants_cover_every_kind_of_parameter():
    seen = set()
    for cfg in VARIANTS.values():
        for keys, _ in jax.tree_util.tree_flatten_with_path(_shapes(cfg))[0]:
            seen.add(sharding.param_entry(sharding.param_path(keys)))
    unused = set(sharding.MODEL_AXES) - seen
    assert not unused, f"table entries no variant exercises: {sorted(unused)}"


def test_dense_ffn_and_shared_expert_have_their_own_rules():
    assert sharding.param_entry("layers/0/ffn/w_gate_DF") == "layers/*/ffn/w_gate_DF"
    assert sharding.param_entry("layers/1/moe/shared/w_gate_DF") == \
        "layers/*/moe/shared/w_gate_DF"
    assert sharding.param_entry("opt_state/0/mu/layers/1/moe/shared/w_gate_DF") == \
        "layers/*/moe/shared/w_gate_DF"
    assert sharding.param_entry("shared/w_gate_DF") == "shared/w_gate_DF"   # a bare MoE layer


def test_unknown_paths_are_an_error_naming_them():
    mesh = make_mesh(MeshConfig(fsdp=2, expert=4))
    with pytest.raises(ValueError, match="'layers/0/attn/w_new' has no entry in PARAM_AXES"):
        sharding.param_specs({"layers": [{"attn": {"w_new": jnp.ones((4, 4))}}]}, mesh)
    with pytest.raises(ValueError, match="'params/layers/0/attn/w_new' has no entry"):
        sharding.state_shardings({"params": {"layers": [{"attn": {"w_new": jnp.ones(4)}}]}},
                                 mesh)
    with pytest.raises(ValueError, match="'embed/w_VD' has 3 dims but PARAM_AXES"):
        sharding.param_specs({"embed": {"w_VD": jnp.ones((2, 2, 2))}}, mesh)


def test_an_axis_that_does_not_divide_is_dropped():
    mesh = make_mesh(MeshConfig(fsdp=2, expert=4))
    assert logical_to_spec(("expert", "embed", "mlp"), mesh, shape=(8, 6, 4)) == \
        P("expert", "fsdp", None)
    assert logical_to_spec(("expert", "embed", "mlp"), mesh, shape=(6, 5, 4)) == \
        P(None, None, None)
    # embed: fsdp, not expert (8 does not divide 4); vocab: not fsdp again (once), expert
    assert logical_to_spec(("embed", "vocab"), mesh, shape=(4, 4)) == P("fsdp", "expert")
    assert logical_to_spec(("embed", "mlp"), mesh, shape=(16, 4)) == P(("fsdp", "expert"), None)


def test_state_shardings_split_params_and_moments():
    from dropless.config_file import build_config
    from dropless.train import step
    cfg = build_config([("preset", "deepseek3-test"), ("mesh.data", 2), ("mesh.fsdp", 2),
                        ("mesh.expert", 2)])
    state = jax.eval_shape(lambda: step.init_state(cfg)[0])
    mesh = make_mesh(cfg.mesh)
    specs = jax.tree.map(lambda s: s.spec, sharding.state_shardings(state, mesh))
    assert sharding.state_shardings(state, None) is None
    mu = [v for k, v in jax.tree_util.tree_flatten_with_path(
        specs["opt_state"], is_leaf=lambda x: isinstance(x, P))[0]
        if "mu" in jax.tree_util.keystr(k) and "layers" in jax.tree_util.keystr(k)]
    moe = specs["params"]["layers"][1]["moe"]
    zero3 = ("fsdp", "expert")   # a non-expert weight's FSDP dim (MaxText's `embed` rule)
    assert moe["experts"]["w_gate_EDF"] == P("expert", "fsdp", None)
    assert moe["experts"]["w_down_EFD"] == P("expert", None, "fsdp")
    assert moe["shared"]["w_gate_DF"] == P(zero3, None)
    assert moe["shared"]["w_down_FD"] == P(None, zero3)
    assert moe["router"]["w_DE"] == P(None, None) and moe["router"]["bias_E"] == P(None)
    assert specs["params"]["layers"][0]["attn"]["wq_a_DQ"] == P(zero3, None)
    assert specs["params"]["embed"]["w_VD"] == P(zero3, None)
    assert P("expert", "fsdp", None) in mu and P(zero3, None) in mu   # moments mirror params
    assert specs["step"] == P() and specs["rng"] == P()
    placed = jax.device_put(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), state),
                            sharding.state_shardings(state, mesh))
    layers = placed["params"]["layers"]
    shard = layers[1]["moe"]["experts"]["w_gate_EDF"].addressable_shards[0]
    e, d, f = state["params"]["layers"][1]["moe"]["experts"]["w_gate_EDF"].shape
    assert shard.data.shape == (e // 2, d // 2, f)   # really split: experts over 2, D over 2
    shard = layers[1]["moe"]["shared"]["w_gate_DF"].addressable_shards[0]
    d, f = state["params"]["layers"][1]["moe"]["shared"]["w_gate_DF"].shape
    assert shard.data.shape == (d // 4, f)           # D over fsdp 2 x expert 2


# --- MaxText's placement written out by hand, as the oracle ---
_MOE_NAMES = {"w_DE": (None, "router"), "bias_E": ("router",),
              "w_gate_EDF": ("expert", "embed", "mlp"), "w_up_EDF": ("expert", "embed", "mlp"),
              "w_gate_up_ED2F": ("expert", "embed", "mlp"),
              "w_down_EFD": ("expert", "mlp", "embed"), "w_gate_DF": ("embed", "mlp"),
              "w_up_DF": ("embed", "mlp"), "w_down_FD": ("mlp", "embed")}


_BY_HAND = {"expert": ("expert",), "embed": ("fsdp", "expert"), "mlp": (), "router": ()}


def _expected_spec(name, shape, mesh):
    """A routed expert [E, ...]: E over expert, its model dim over fsdp (expert is taken);
    a shared expert or dense FFN matrix: its model dim over fsdp x expert; any other matrix:
    its largest dim that fsdp divides, over fsdp x expert (a mesh axis that does not divide
    the dim left out); vectors and the router whole."""
    axes = _MOE_NAMES.get(name)
    if axes is not None and len(axes) == len(shape):
        used, spec = set(), []
        for logical in axes:
            kept = tuple(a for a in _BY_HAND.get(logical, ()) if a not in used)
            used.update(kept)
            spec.append(kept)
        if all(n % int(np.prod([mesh.shape[a] for a in kept])) == 0
               for n, kept in zip(shape, spec)):
            return P(*[k or None for k in spec])
    fsdp = mesh.shape.get("fsdp", 1)
    dims = [i for i in range(len(shape)) if shape[i] % fsdp == 0]
    if len(shape) < 2 or not dims:
        return P()
    best = max(dims, key=lambda i: shape[i])
    kept = ("fsdp",) + (("expert",) if shape[best] % (fsdp * mesh.shape["expert"]) == 0
                        else ())
    return P(*[(kept if i == best else None) for i in range(len(shape))])


def _used_axes(spec, mesh):
    """Per dim, the mesh axes of size > 1 (P() and P(None, None) place alike)."""
    out = []
    for d in tuple(spec):
        names = () if d is None else (d if isinstance(d, tuple) else (d,))
        out.append(tuple(a for a in names if mesh.shape[a] > 1))
    while out and not out[-1]:
        out.pop()
    return out


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_placement_equals_maxtexts_on_8_devices(preset):
    """Every preset at its real shape (eval_shape), unrolled and scanned (the stacked layer
    dim unsharded), on three 8-device meshes."""
    for scan in (False, True):
        shapes = _shapes(PRESETS[preset]().replace(scan_layers=scan))
        for mc in EIGHT:
            mesh = make_mesh(mc)
            got = sharding.state_shardings({"params": shapes}, mesh)["params"]
            for (keys, leaf), new in zip(jax.tree_util.tree_flatten_with_path(shapes)[0],
                                         jax.tree.leaves(got)):
                name, shape = str(keys[-1].key), tuple(leaf.shape)
                stacked = keys[0].key == sharding.STACKED_GROUP
                want = (P(None, *_expected_spec(name, shape[1:], mesh)) if stacked
                        else _expected_spec(name, shape, mesh))
                assert _used_axes(new.spec, mesh) == _used_axes(want, mesh), \
                    (preset, scan, mc.shape, jax.tree_util.keystr(keys), new.spec, want)
