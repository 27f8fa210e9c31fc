"""Config: YAML + overrides, MaxText translation and its errors, TrainConfig validation."""
import pytest

from dropless.config_file import build_config, parse_override, show
from dropless.model_dir import from_dict, to_dict
from dropless.compat import maxtext
from dropless.presets import get_preset


def test_defaults_are_tiny():
    cfg = build_config()
    assert cfg.preset == "tiny" and cfg.model == get_preset("tiny")


def test_yaml_then_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("preset: deepseek3-test\nsteps: 7\nmodel:\n  moe:\n    top_k: 3\n")
    cfg = build_config([parse_override("steps=9"), parse_override("model.d_model=32")],
                       yaml_path=str(p))
    assert cfg.preset == "deepseek3-test" and cfg.steps == 9
    assert cfg.model.moe.top_k == 3
    assert cfg.model.d_model == 32 and cfg.model.moe.d_model == 32   # kept in step


def test_round_trip():
    cfg = build_config([("preset", "mixtral-8x7b"), ("learning_rate", 1)])
    assert from_dict(to_dict(cfg)) == cfg and cfg.learning_rate == 1.0
    assert "num_experts: 8" in show(cfg)


def test_maxtext_reference_recipe():
    cfg = build_config([("model_name", "deepseek3-671b"), ("sparse_matmul", True),
                        ("megablox", False), ("capacity_factor", 1.0),
                        ("ragged_buffer_factor", 2.0), ("per_device_batch_size", 6),
                        ("max_target_length", 4096), ("weight_dtype", "bfloat16"),
                        ("remat_policy", "minimal_offloaded"), ("n_routing_groups", -1),
                        ("ici_expert_parallelism", 8), ("ici_fsdp_parallelism", 2),
                        ("te_ep_overflow_check_every_n_steps", 10)])
    moe = cfg.model.moe
    assert moe.capacity_factor is None            # sparse_matmul never drops
    assert moe.gmm_backend == "auto" and moe.ragged_buffer_factor == 2.0  # never padded on CUDA
    assert moe.n_groups == 1 and moe.overflow_check_every_n_steps == 10
    assert (cfg.per_device_batch_size, cfg.seq_len, cfg.remat) == (6, 4096, "offload")
    assert cfg.model.weight_dtype == moe.weight_dtype == "bfloat16"
    assert (cfg.mesh.expert, cfg.mesh.fsdp, cfg.global_batch_size) == (8, 2, 96)


def test_maxtext_dense_path_capacity():
    cfg = build_config([("sparse_matmul", False), ("capacity_factor", 1.25)])
    assert cfg.model.moe.capacity_factor == 1.25
    cfg = build_config([("sparse_matmul", False), ("capacity_factor", -1)])
    assert cfg.model.moe.capacity_factor is None


def test_later_items_win_whatever_the_spelling(tmp_path):
    assert build_config([("max_target_length", 64), ("seq_len", 64)]).seq_len == 64
    p = tmp_path / "c.yaml"
    p.write_text("seq_len: 48\n")
    assert build_config([("max_target_length", 96)], yaml_path=str(p)).seq_len == 96
    p.write_text("max_target_length: 48\n")
    assert build_config([("seq_len", 96)], yaml_path=str(p)).seq_len == 96
    # within one list two spellings must agree: tests/test_config_file_spellings.py


@pytest.mark.parametrize("key,suggestion", [
    ("num_expert", "num_experts"), ("model.moe.topk", "model.moe.top_k"),
    ("per_device_batch", "per_device_batch_size"), ("learning_rat", "learning_rate")])
def test_unknown_key_suggests_closest(key, suggestion):
    with pytest.raises(ValueError, match=f"unknown config key '{key}'; did you mean "
                                         f"'{suggestion}'"):
        build_config([(key, 1)])


def test_unsupported_maxtext_values():
    with pytest.raises(ValueError, match="ici_tensor_parallelism=2 is not supported"):
        build_config([("ici_tensor_parallelism", 2)])
    with pytest.raises(ValueError, match="remat_policy='save_everything' is not supported"):
        build_config([("remat_policy", "save_everything")])
    with pytest.raises(ValueError, match="megablox='maybe' must be true or false"):
        maxtext.translate([("megablox", "maybe")])


def test_maxtext_gmm_flags_never_pick_the_padded_path():
    gmm = lambda items: build_config(items).model.moe.gmm_backend
    assert gmm([("megablox", True)]) == gmm([("megablox", False)]) == "auto"
    assert gmm([("use_tokamax_gmm", True), ("megablox", True)]) == "tokamax"
    assert gmm([("megablox", False), ("use_tokamax_gmm", True)]) == "tokamax"
    assert gmm([("use_tokamax_gmm", False)]) == "auto"


def test_validation_names_field_and_value():
    with pytest.raises(ValueError, match="TrainConfig.remat='some'"):
        build_config([("remat", "some")])
    with pytest.raises(ValueError, match="TrainConfig.mesh.expert=3 must divide "
                                         "model.moe.num_experts=8"):
        build_config([("expert_parallelism", 3)])   # the former flat key, translated
    with pytest.raises(ValueError, match="TrainConfig.mesh.expert=3 must divide"):
        build_config([("mesh.expert", 3)])
    with pytest.raises(ValueError, match="TrainConfig.xla_recipe='tpu'"):
        build_config([("xla_recipe", "tpu")])
    with pytest.raises(ValueError, match="MoEConfig.top_k=9 must be <= num_experts=8"):
        build_config([("num_experts_per_tok", 9)])
    with pytest.raises(ValueError, match="must look like key=value"):
        parse_override("steps")


def test_dense_model_has_no_moe_keys():
    with pytest.raises(ValueError, match="model.moe is not set"):
        build_config([("model.moe", None), ("model.moe.top_k", 2)])


def test_warmup_fraction_uses_steps_in_either_spelling():
    assert build_config([("steps", 1000), ("warmup_steps_fraction", 0.1)]).warmup_steps == 100


def test_maxtext_te_gmm_quantization():
    assert build_config([("te_gmm_quantization", "te_mxfp8")]).model.moe.gmm_quantization == \
        "mxfp8"
    assert build_config([("te_gmm_quantization", "")]).model.moe.gmm_quantization == "none"
    with pytest.raises(ValueError, match="te_gmm_quantization='te_fp8'"):
        build_config([("te_gmm_quantization", "te_fp8")])


def test_exponent_floats_without_a_dot_are_numbers(tmp_path):
    """YAML 1.1 reads `3e-4` as a string; float fields take it as the number it spells."""
    (tmp_path / "r.yml").write_text("learning_rate: 3e-4\nmodel.moe.z_loss_coef: 1E-3\n")
    cfg = build_config([("adam_eps", parse_override("adam_eps=1e-9")[1]),
                        parse_override("model.moe.routed_scaling_factor=2.5e0")],
                       yaml_path=str(tmp_path / "r.yml"))
    assert (cfg.learning_rate, cfg.adam_eps) == (3e-4, 1e-9)
    assert (cfg.model.moe.z_loss_coef, cfg.model.moe.routed_scaling_factor) == (1e-3, 2.5)
    with pytest.raises(ValueError, match=r"config key 'learning_rate': 'fast' is not a number"):
        build_config([parse_override("learning_rate=fast")])


@pytest.mark.parametrize("value,base,optional,ok", [
    (True, bool, False, True), (1, bool, False, False), ("maybe", bool, False, False),
    (3, int, False, True), (3.0, int, False, False), (True, int, False, False),
    (2, float, False, True), (float("nan"), float, False, False), ([0.1], float, False, False),
    (None, float, True, True), (None, float, False, False), ("x", str, False, True),
    (2024, str, False, False)])
def test_scalar_type_rules(value, base, optional, ok):
    from dropless.config import scalar_type_error
    assert (scalar_type_error(value, base, optional) is None) == ok


def test_library_configs_refuse_wrong_types():
    # the dataclasses check types themselves (a run's config.json, a library caller)
    tiny = get_preset("tiny")
    with pytest.raises(ValueError, match=r"TrainConfig.learning_rate=\[0.1\] must be a finite "
                                         "number, not a list"):
        build_config().replace(learning_rate=[0.1])
    with pytest.raises(ValueError, match="ModelConfig.tie_embeddings=2 must be true or false"):
        tiny.replace(tie_embeddings=2)


def test_strict_values_at_the_config_edge(tmp_path):
    with pytest.raises(ValueError, match="config key 'run_name': 2024 must be a string"):
        build_config([parse_override("run_name=2024")])
    assert build_config([parse_override("run_name='2024'")]).run_name == "2024"
    # YAML's own booleans are booleans; strings are converted only where the field says so
    assert build_config([parse_override("async_checkpoints=no")]).async_checkpoints is False
    assert build_config([("check_nan", "True")]).check_nan is True
    assert build_config([parse_override("model.moe.capacity_factor=none")]).model.moe \
        .capacity_factor is None
    with pytest.raises(ValueError, match="config key 'model.moe.top_k': 2.0 must be an int"):
        build_config([("model.moe.top_k", 2.0)])


def test_yaml_duplicate_keys_refused_merge_keys_allowed(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model:\n  d_model: 64\nsteps: 3\nmodel:\n  d_model: 32\n")
    with pytest.raises(ValueError, match=r"c.yaml:4:1: invalid YAML \(key 'model' appears "
                                         r"twice in one mapping \(first on line 1\)\)"):
        build_config(yaml_path=str(p))
    # a YAML merge (<<) is not a duplicate: the mapping's own key overrides the merged one
    p.write_text("base: &b {steps: 3, seq_len: 64}\n")
    from dropless.config_file import load_yaml, parse_yaml
    assert load_yaml(str(p)) == {"base": {"steps": 3, "seq_len": 64}}
    assert parse_yaml("a: &b {x: 1}\nc:\n  <<: *b\n  x: 2\n")["c"] == {"x": 2}


@pytest.mark.parametrize("argv,found", [
    (["train", "steps=2", "--preset", "tiny", "run_name=z"], ("--preset", "steps=2")),
    (["train", "--preset", "tiny", "steps=2"], None),
    (["train", "steps=2", "--preset", "tiny"], None),           # argparse takes this one
    (["plan", "lr=-1", "--gpus=8", "a=1"], ("--gpus", "lr=-1")),
    (["train", "x=1", "-5", "y=2"], None)])                    # a negative number is no option
def test_misplaced_option(argv, found):
    from dropless.cli import misplaced_option
    assert misplaced_option(argv) == found


def _old_form(cfg) -> dict:
    """`cfg` as a config.json written before the mesh became `mesh: MeshConfig`: flat
    parallelism keys, and the node size under model.moe."""
    tree = to_dict(cfg)
    mesh = tree.pop("mesh")
    tree.update({f"{a}_parallelism": mesh[a] for a in ("data", "fsdp", "expert")})
    tree.update({f"dcn_{a}": mesh[f"dcn_{a}"] for a in ("data", "fsdp", "expert")})
    tree["model"]["moe"]["devices_per_node"] = cfg.mesh.devices_per_node if \
        cfg.mesh.num_nodes > 1 else 8
    return tree


def test_config_show_and_config_json_write_the_mesh_form():
    from dropless.config_file import show
    cfg = build_config([("ici_fsdp_parallelism", 2), ("ici_expert_parallelism", 2),
                        ("dcn_expert_parallelism", 2)])
    assert to_dict(cfg)["mesh"] == {"data": 1, "fsdp": 2, "expert": 4, "dcn_data": 1,
                                    "dcn_fsdp": 1, "dcn_expert": 2}
    text = show(cfg)
    assert "mesh:\n  data: 1\n  fsdp: 2\n  expert: 4\n" in text
    assert "_parallelism" not in text and "devices_per_node" not in text
    # the same mesh in our dotted keys and in the former flat keys
    assert build_config([("mesh.fsdp", 2), ("mesh.expert", 4), ("mesh.dcn_expert", 2)]) == cfg
    assert build_config([("fsdp_parallelism", 2), ("expert_parallelism", 4),
                         ("dcn_expert", 2)]) == cfg


@pytest.mark.parametrize("items", [[], [("mesh.fsdp", 2), ("mesh.expert", 4),
                                         ("mesh.dcn_expert", 2)]])
def test_a_config_json_of_the_former_form_still_loads(tmp_path, items):
    import argparse
    import json

    from dropless.cli.train import config_from_args
    from dropless.model_dir import upgrade
    cfg = build_config(items + [("steps", 7)])
    old = _old_form(cfg)
    assert from_dict(old) == cfg and upgrade(to_dict(cfg)) == to_dict(cfg)
    run = tmp_path / "runs" / "old"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(old))
    args = argparse.Namespace(overrides=[], preset=None, config=None, profile_steps=None,
                              resume=str(run))
    resumed = config_from_args(args)   # a resume of a run saved in the former form
    assert resumed == cfg.replace(run_dir=str(run.parent), run_name="old")


def test_the_former_node_size_key_is_a_one_line_error_naming_the_mesh_keys(capsys):
    from dropless.cli import main
    with pytest.raises(ValueError, match="'model.moe.devices_per_node' \\(4\\) is gone: .*"
                                         "mesh.dcn_expert"):
        build_config([("model.moe.devices_per_node", 4)])
    assert main(["config", "show", "model.moe.devices_per_node=4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "mesh.dcn_data, mesh.dcn_fsdp, mesh.dcn_expert" in err


def test_resume_items_rebuild_the_runs_config_where_it_is_now(tmp_path):
    """The saved config.json, in the current form, with run_dir / run_name naming the folder
    the run is in now; later items (the user's overrides) win."""
    import json

    from dropless.config_file import resume_items
    cfg = build_config([("preset", "deepseek3-test"), ("steps", 9), ("mesh.fsdp", 2),
                        ("run_dir", "/elsewhere"), ("run_name", "was")])
    run = tmp_path / "runs" / "moved"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(to_dict(cfg)))
    items = resume_items(run)
    assert items[0] == ("preset", "deepseek3-test")
    assert build_config(items) == cfg.replace(run_dir=str(run.parent), run_name="moved")
    assert build_config(items + [("steps", 12)]).steps == 12
    with pytest.raises(ValueError, match="is not a run directory"):
        resume_items(tmp_path)
