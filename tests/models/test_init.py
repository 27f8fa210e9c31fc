"""models/init.py: the scheme table, each scheme's std per leaf (hand-computed here), MaxText's
truncated draws against jax's own variance_scaling, legacy bitwise against the hashes written
at 4443fd4 (tools/make_legacy_init_fixture.py), and the config edge (validation, config.json
without the keys, Hugging Face's initializer_range, init_from)."""
from __future__ import annotations

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.config import INIT_FIELDS, INIT_SCHEMES, ModelConfig, MoEConfig
from dropless.models import init as init_lib
from dropless.models.decoder import init_params
from dropless.presets import get_preset
from tests._support.paths import FIXTURES
from tools.make_legacy_init_fixture import leaf_hashes

LEGACY = json.loads((FIXTURES / "init" / "legacy_sha256.json").read_text())


def _config(tree: dict, **changes) -> ModelConfig:
    m = dict(tree)
    moe = m.pop("moe")
    return ModelConfig(**m, moe=None if moe is None else MoEConfig(**moe)).replace(**changes)


@pytest.mark.xla_default_opt   # the fixture holds the bits XLA's default level draws
@pytest.mark.parametrize("case", sorted(LEGACY["cases"]))
def test_legacy_is_the_init_of_4443fd4_bit_for_bit(case):
    c = LEGACY["cases"][case]
    cfg = _config(c["config"], init="legacy")
    assert leaf_hashes(init_params(jax.random.key(c["seed"]), cfg)) == c["leaves"]


def test_the_fixture_was_written_at_4443fd4():
    assert LEGACY["commit"].startswith("4443fd4")


def test_the_table_has_every_scheme_and_kind():
    assert tuple(init_lib.SCHEMES) == INIT_SCHEMES
    for scheme, rules in init_lib.SCHEMES.items():
        assert tuple(rules) == init_lib.PARAM_KINDS, scheme
        for rule in rules.values():
            assert rule.dist in init_lib.DISTRIBUTIONS and rule.std in init_lib.STD_RULES


def _recorded_kinds(cfg: ModelConfig, monkeypatch) -> set[str]:
    """The kinds init_params draws with (shapes only: eval_shape)."""
    seen: set[str] = set()
    orig = init_lib.std_fraction

    def spy(cfg_, kind, shape, fan_in):
        seen.add(kind)
        return orig(cfg_, kind, shape, fan_in)
    monkeypatch.setattr(init_lib, "std_fraction", spy)
    jax.eval_shape(lambda k: init_params(k, cfg), jax.random.key(0))
    return seen


def test_every_weight_is_drawn_with_a_known_kind_and_every_kind_is_used(monkeypatch):
    mla = get_preset("deepseek3-test")            # q low-rank, MTP, shared expert, dense first
    mha = LEGACY["cases"]["mha-bf16-fused/seed3"]["config"]
    kinds = (_recorded_kinds(mla, monkeypatch)
             | _recorded_kinds(_config(mha, tie_embeddings=False), monkeypatch))
    assert kinds == set(init_lib.PARAM_KINDS)


def _std(x) -> float:
    return float(np.std(np.asarray(x, np.float64)))


@pytest.fixture(scope="module")
def tiny_by_scheme():
    cfg = get_preset("tiny")
    return cfg, {s: init_params(jax.random.key(0), cfg.replace(init=s)) for s in INIT_SCHEMES}


def test_each_scheme_gives_each_part_its_std(tiny_by_scheme):
    # tiny: D=128, V=256, E=8, expert F=128, MLA wo fan-in H*V = 4*32, dense F = 384
    cfg, p = tiny_by_scheme
    moe, dense = p["fan_in"]["layers"][1]["moe"], p["fan_in"]["layers"][0]["ffn"]
    want = {  # (leaf getter, {scheme: std})
        "embed": (lambda q: q["embed"]["w_VD"],
                  {"fan_in": 1.0, "normal": 0.02, "maxtext": 1.0, "legacy": 1.0}),
        "head": (lambda q: q["lm_head"]["w_DV"],
                 {"fan_in": 128 ** -0.5, "normal": 0.02, "maxtext": 128 ** -0.5, "legacy": 0.02}),
        "wo": (lambda q: q["layers"][1]["attn"]["wo_HVD"],
               {"fan_in": 128 ** -0.5, "normal": 0.02, "maxtext": 128 ** -0.5,
                "legacy": 128 ** -0.5}),
        "dense down": (lambda q: q["layers"][0]["ffn"]["w_down_FD"],
                       {"fan_in": 384 ** -0.5, "normal": 0.02, "maxtext": 384 ** -0.5}),
        # MaxText: the expert axis is an input axis, fan-in E * out = 8 * 128 for both
        "expert gate": (lambda q: q["layers"][1]["moe"]["experts"]["w_gate_EDF"],
                        {"fan_in": 128 ** -0.5, "normal": 0.02, "maxtext": (8 * 128) ** -0.5}),
        "expert down": (lambda q: q["layers"][1]["moe"]["experts"]["w_down_EFD"],
                        {"fan_in": 128 ** -0.5, "normal": 0.02, "maxtext": (8 * 128) ** -0.5}),
        "router": (lambda q: q["layers"][1]["moe"]["router"]["w_DE"],
                   {"fan_in": 128 ** -0.5, "normal": 0.02, "maxtext": 128 ** -0.5}),
    }
    assert moe["router"]["bias_E"].dtype == jnp.float32 and dense["w_up_DF"].shape == (128, 384)
    for part, (get, stds) in want.items():
        for scheme, s in stds.items():
            got = _std(get(p[scheme]))
            n = np.asarray(get(p[scheme])).size
            assert abs(got / s - 1) < 6 / math.sqrt(n) + 0.01, (part, scheme, got, s)
    for scheme in INIT_SCHEMES:   # norms one, router bias zero, whatever the scheme
        q = p[scheme]
        assert np.all(np.asarray(q["final_norm"]["w_D"]) == 1)
        assert np.all(np.asarray(q["layers"][1]["moe"]["router"]["bias_E"]) == 0)


def test_maxtext_truncates_at_two_std_and_attention_is_not_truncated(tiny_by_scheme):
    _, p = tiny_by_scheme
    q = p["maxtext"]
    head = np.asarray(q["lm_head"]["w_DV"])
    bound = 2 * 128 ** -0.5 / init_lib.TRUNCATED_STD
    assert np.abs(head).max() <= bound * (1 + 1e-6)
    wq = np.asarray(q["layers"][1]["attn"]["wq_DHK"])
    assert np.abs(wq).max() > 2.5 * 128 ** -0.5     # a normal's tail, not a truncated one


def test_maxtext_expert_draw_equals_jax_variance_scaling_with_the_expert_axis_in():
    cfg = get_preset("tiny").replace(init="maxtext")
    key = jax.random.key(7)
    draw = init_lib.initializer(cfg)
    for shape, fan_in, kind in (((8, 128, 64), 128, "expert"), ((8, 64, 128), 64, "expert_out")):
        ref = jax.nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal",
                                                   in_axis=0, out_axis=1)(key, shape)
        np.testing.assert_allclose(draw(key, kind, shape, fan_in, jnp.float32), ref,
                                   rtol=2e-6, atol=1e-9)
    ref = jax.nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")(key, (128, 8))
    np.testing.assert_allclose(draw(key, "router", (128, 8), 128, jnp.float32), ref, rtol=2e-6)


def test_overrides_and_residual_scaling():
    cfg = get_preset("tiny").replace(init="fan_in", head_init_std=0.5, embed_init_std=0.1,
                                     init_residual_scaling=True)
    p = init_params(jax.random.key(1), cfg)
    assert abs(_std(p["lm_head"]["w_DV"]) / 0.5 - 1) < 0.03
    assert abs(_std(p["embed"]["w_VD"]) / 0.1 - 1) < 0.03
    scale = math.sqrt(2 * cfg.num_layers)   # Megatron: 1/sqrt(2 L) on the residual outputs
    for get, std in ((lambda q: q["layers"][1]["attn"]["wo_HVD"], 128 ** -0.5 / scale),
                     (lambda q: q["layers"][0]["ffn"]["w_down_FD"], 384 ** -0.5 / scale),
                     (lambda q: q["layers"][1]["moe"]["experts"]["w_down_EFD"], 128 ** -0.5 / scale),
                     (lambda q: q["layers"][1]["moe"]["shared"]["w_down_FD"], 128 ** -0.5 / scale),
                     (lambda q: q["layers"][1]["attn"]["wq_DHK"], 128 ** -0.5)):   # not scaled
        assert abs(_std(get(p)) / std - 1) < 0.05
    assert init_lib.describe(cfg)["attn_out"] == "normal fan_in / sqrt(2*4)"
    assert init_lib.describe(cfg)["head"] == "normal 0.5 (head_init_std)"


def test_normal_uses_init_std():
    cfg = get_preset("tiny").replace(init="normal", init_std=0.006)
    assert init_lib.std(cfg, "expert", (8, 128, 128), 128) == 0.006
    assert init_lib.std(cfg, "embed", (256, 128), 128) == 0.006


@pytest.mark.parametrize("change, key", [
    (dict(init="xavier"), "ModelConfig.init='xavier'"),
    (dict(init_std=0.0), "ModelConfig.init_std=0.0"),
    (dict(head_init_std=-1.0), "ModelConfig.head_init_std=-1.0"),
    (dict(embed_init_std=float("nan")), "ModelConfig.embed_init_std=nan"),
])
def test_bad_values_name_the_field(change, key):
    with pytest.raises(ValueError) as e:
        get_preset("tiny").replace(**change)
    assert str(e.value).startswith(key)


def test_the_cli_refuses_a_bad_scheme_in_one_line(capsys):
    from dropless.cli.main import main
    assert main(["config", "show", "model.init=xavier"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "init" in err[0] and "fan_in" in err[0]


def test_config_show_and_config_json_carry_the_scheme_and_an_old_one_is_legacy():
    from dropless.config_file import build_config, show
    from dropless.model_dir import from_dict, to_dict
    cfg = build_config([("model.init", "maxtext"), ("model.head_init_std", 0.05)])
    assert "init: maxtext" in show(cfg) and "head_init_std: 0.05" in show(cfg)
    tree = to_dict(cfg)
    assert from_dict(tree) == cfg
    old = json.loads(json.dumps(tree))
    for k in INIT_FIELDS:        # a config.json written before init schemes
        old["model"].pop(k)
    back = from_dict(old).model
    assert back.init == "legacy" and back.head_init_std == 0.0


def test_a_hugging_face_config_gives_its_initializer_range_as_init_std():
    from dropless.hf.config_formats import DEEPSEEK
    from dropless.hf.config_map import hf_config, model_config
    from dropless.hf.layout import Layout
    tiny = get_preset("tiny")
    hf = hf_config(tiny, Layout(DEEPSEEK))     # an export writes the model's init_std
    assert hf["initializer_range"] == tiny.init_std and model_config(hf)[0].init_std == 0.02
    assert model_config({**hf, "initializer_range": 0.006})[0].init_std == 0.006
    del hf["initializer_range"]                # absent: transformers' default, 0.02
    assert model_config(hf)[0].init_std == 0.02
    hf = hf_config(tiny.replace(init_std=0.006), Layout(DEEPSEEK))
    assert hf["initializer_range"] == 0.006 and model_config(hf)[0].init_std == 0.006


def test_weights_of_another_scheme_start_a_run():
    from dropless.train.init_from import model_differences
    a = get_preset("tiny")
    b = a.replace(init="maxtext", init_std=0.01, head_init_std=0.1, embed_init_std=0.3,
                  init_residual_scaling=True)
    assert model_differences(a, b) == []
    assert {f.name for f in dataclasses.fields(a)} >= set(INIT_FIELDS)
