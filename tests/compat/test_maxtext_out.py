"""A config said in MaxText's flags (compat/maxtext_out.py) and read back through the MaxText edge
(compat/maxtext.py, by `config_file.build_config`) is the config it came from; every flag written
is one MaxText declares, with a value of the type MaxText parses it as; the committed
examples/deepseek3_1gpu_maxtext.yml is what the generator writes; what has no MaxText flag is
refused naming it.

The reference for MaxText's flags: AI-Hypercomputer/maxtext at e591f30,
src/maxtext/configs/base.yml, each name below with its default there and its line (MaxText
parses a value given for a name by the type of its default: pyconfig.py's
_yaml_types_to_parser); what its optimizer makes of them, its
src/maxtext/optimizers/optimizers.py get_optimizer there (optax.adamw with the mask its
adamw_mask patterns make: none by default, so every parameter is decayed).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from dropless.compat import maxtext, maxtext_out
from dropless.config_file import build_config
from dropless.presets import RUN_SETTINGS, get_preset

ROOT = Path(__file__).resolve().parents[2]

# name: (default in base.yml at e591f30, its line)
MAXTEXT_BASE = {
    "normalization_layer_epsilon": (1.0e-05, 27), "dtype": ("bfloat16", 114),
    "decoder_block": ("llama2", 170), "weight_dtype": ("float32", 174),
    "base_emb_dim": (2048, 176), "base_num_query_heads": (16, 177),
    "base_num_kv_heads": (16, 178), "base_mlp_dim": (7168, 179),
    "base_num_decoder_layers": (16, 181), "head_dim": (128, 182),
    "logits_via_embedding": (False, 190), "mtp_num_layers": (0, 203),
    "mtp_loss_scaling_factor": (0.1, 206), "num_experts": (1, 213),
    "num_experts_per_tok": (1, 214), "megablox": (True, 215), "sparse_matmul": (True, 216),
    "capacity_factor": (-1.0, 217), "base_moe_mlp_dim": (7168, 226),
    "load_balance_loss_weight": (0.0, 227), "use_tokamax_gmm": (False, 274),
    "norm_topk_prob": (False, 278), "first_num_dense_layers": (0, 289),
    "shared_experts": (0, 290), "routed_scaling_factor": (1.0, 291),
    "routed_score_func": ("", 292), "routed_bias": (False, 293),
    "routed_bias_update_rate": (0.0, 294), "n_routing_groups": (-1, 296),
    "topk_routing_group": (-1, 298), "remat_policy": ("full", 358), "scan_layers": (True, 387),
    "attention": ("autoselected", 392), "attention_type": ("global", 393),
    "q_lora_rank": (0, 448), "kv_lora_rank": (512, 449),
    "qk_nope_head_dim": (128, 450), "qk_rope_head_dim": (64, 451), "v_head_dim": (128, 452),
    "vocab_size": (32000, 712), "per_device_batch_size": (12.0, 731),
    "max_target_length": (2048, 880), "rope_max_timescale": (10000, 1016),
    "gradient_accumulation_steps": (1, 968), "num_vocab_tiling": (1, 705),
    # the run's length, learning-rate schedule and mesh
    "steps": (150001, 836), "learning_rate": (3.0e-5, 870), "lr_schedule_type": ("cosine", 871),
    "learning_rate_final_fraction": (0.1, 872), "warmup_steps_fraction": (0.1, 875),
    "learning_rate_schedule_steps": (-1, 876), "dcn_data_parallelism": (-1, 660),
    "dcn_fsdp_parallelism": (1, 661), "dcn_expert_parallelism": (1, 670),
    "ici_data_parallelism": (1, 673), "ici_fsdp_parallelism": (-1, 674),
    "ici_expert_parallelism": (1, 684),
    # the optimizer (adam_eps_root: 0.0, line 990, and adamw_mask: [], line 992, not written)
    "gradient_clipping_threshold": (1.0, 964), "adam_b1": (0.9, 987), "adam_b2": (0.95, 988),
    "adam_eps": (1.0e-8, 989), "adam_weight_decay": (0.1, 991),
}
ONE_GPU = ROOT / maxtext_out.ONE_GPU_FILE


def _preset_config(name: str):
    return build_config([("preset", name)])


def _check_types(pairs) -> None:
    for name, value in pairs:
        assert name in MAXTEXT_BASE, f"{name} is not a key of MaxText's base.yml"
        assert maxtext.is_known(name), f"{name} is not a name compat/maxtext.py translates"
        default = MAXTEXT_BASE[name][0]
        if isinstance(default, float):        # MaxText: float(value)
            assert isinstance(value, (int, float)) and not isinstance(value, bool), name
        else:                                 # an int, bool or str default takes its own type
            assert type(value) is type(default), (name, value)


def test_the_committed_yaml_is_what_the_generator_writes():
    cfg = _preset_config("deepseek3-1gpu")
    assert ONE_GPU.read_text() == maxtext_out.to_yaml(cfg, maxtext_out.ONE_GPU_HEADER), (
        f"{maxtext_out.ONE_GPU_FILE} is stale: regenerate it with {maxtext_out.ONE_GPU_COMMAND}")


def test_the_yaml_reads_back_as_the_preset_at_its_run_settings():
    notes: list[str] = []
    cfg = build_config(yaml_path=str(ONE_GPU), notes=notes)
    assert cfg.model == get_preset("deepseek3-1gpu")   # every field, the MoE config's too
    run = RUN_SETTINGS["deepseek3-1gpu"]
    assert (cfg.seq_len, cfg.per_device_batch_size, cfg.remat) == (
        run["seq_len"], run["per_device_batch_size"], run["remat"])
    assert notes == ["decoder_block=deepseek changes nothing: the architecture follows from the "
                     "preset and the model keys", maxtext.weight_decay_differs(0.1)]


def test_every_key_of_the_yaml_is_maxtexts_with_its_type():
    data = yaml.safe_load(ONE_GPU.read_text())
    _check_types(data.items())
    # the DeepSeek-V3 specifics as MaxText's deepseek3-671b.yml spells them
    assert (data["attention_type"], data["decoder_block"], data["routed_score_func"],
            data["routed_bias"]) == ("mla", "deepseek", "sigmoid", True)
    assert data["base_num_kv_heads"] == data["base_num_query_heads"]
    assert (data["dtype"], data["weight_dtype"]) == ("bfloat16", "float32")


@pytest.mark.parametrize("name", ["deepseek3-test", "deepseek3-671b", "mixtral-8x7b",
                                  "qwen3-30b-a3b", "small"])
def test_other_presets_round_trip(name):
    cfg = _preset_config(name)
    pairs = maxtext_out.items(cfg)
    _check_types(pairs)
    back = build_config([("preset", "tiny"), *pairs])
    # what has no MaxText flag is the base preset's: compare the rest
    no_flag = {"init", "init_std", "mla_norm_eps", "rope_type", "rope_factor",
               "rope_original_max_position", "rope_beta_fast", "rope_beta_slow", "rope_mscale",
               "rope_mscale_all_dim", "qk_norm", "layer_pattern", "num_kv_heads", "head_dim"}
    for f in dataclasses.fields(cfg.model):
        if f.name == "moe":
            assert dataclasses.replace(back.model.moe, seq_aux_coef=0, z_loss_coef=0) == \
                dataclasses.replace(cfg.model.moe, seq_aux_coef=0, z_loss_coef=0), name
        elif f.name not in no_flag:
            assert getattr(back.model, f.name) == getattr(cfg.model, f.name), (name, f.name)
    if cfg.model.attention == "mha":   # GQA's heads are said, as MaxText needs them
        assert back.model.num_kv_heads == (cfg.model.num_kv_heads or cfg.model.num_heads)


def test_cudnn_thd_is_transformer_engines_segments_with_their_bound():
    cfg = _preset_config("deepseek3-test")
    cfg = cfg.replace(model=cfg.model.replace(attention_kernel="cudnn_thd",
                                              max_segments_per_seq=16))
    pairs = dict(maxtext_out.items(cfg))
    assert (pairs["attention"], pairs["max_segments_per_seq"]) == ("cudnn_flash_te", 16)
    back = build_config([("preset", "tiny"), *pairs.items()])
    assert (back.model.attention_kernel, back.model.max_segments_per_seq) == ("cudnn", 16)
    assert "max_segments_per_seq" not in dict(maxtext_out.items(_preset_config("deepseek3-test")))


@pytest.mark.parametrize("over,match", [
    ({"model.moe.gmm_backend": "native"},
     r"model.moe.gmm_backend='native' has no MaxText flag"),
    ({"model.moe.dtype": "float32"},
     r"MaxText dtype sets model.dtype, model.moe.dtype alike; this config has "
     r"model.dtype='bfloat16', model.moe.dtype='float32'"),
    ({"model.rope_theta": 10000.5}, r"MaxText rope_max_timescale is an integer"),
])
def test_what_maxtext_cannot_say_is_refused_naming_it(over, match):
    cfg = build_config([("preset", "deepseek3-1gpu"), *over.items()])
    with pytest.raises(ValueError, match=match):
        maxtext_out.items(cfg)


@pytest.mark.parametrize("pairs,match", [
    ([("attention_type", "mla"), ("base_num_query_heads", 16), ("base_num_kv_heads", 8)],
     r"MaxText base_num_kv_heads=8 with attention_type=mla: MLA has one key/value head a "
     r"query head \(base_num_query_heads=16\)"),
    ([("routed_bias", False), ("routed_bias_update_rate", 0.001)],
     r"MaxText routed_bias=false with routed_bias_update_rate=0.001"),
])
def test_the_new_maxtext_rules_refuse_contradictions(pairs, match):
    with pytest.raises(ValueError, match=match):
        build_config(pairs)


def test_routed_bias_false_turns_the_bias_update_off():
    cfg = build_config([("preset", "deepseek3-1gpu"), ("routed_bias", False)])
    assert cfg.model.moe.bias_update_speed == 0.0
    assert build_config([("preset", "deepseek3-1gpu"), ("routed_bias", True)]).model == \
        get_preset("deepseek3-1gpu")


def test_what_the_flags_leave_out_is_listed_at_the_top_when_not_a_default():
    """A reader of the YAML sees every dropless setting it does not say: those with no MaxText
    flag and the run's settings it does not write, each away from its default (a default
    needs no flag), and nothing said below (the steps and the mesh are said)."""
    cfg = build_config([("preset", "deepseek3-1gpu"), ("steps", 1000), ("mesh.expert", 8),
                        ("model.init", "maxtext"), ("model.moe.z_loss_coef", 1e-3),
                        ("learning_rate", 3e-3), ("run_name", "r1")])
    gone = maxtext_out.left_out(cfg)
    assert gone == [("model.moe.seq_aux_coef", 1e-4), ("model.moe.z_loss_coef", 1e-3),
                    ("model.init", "maxtext"), ("run_name", "r1")]
    text = maxtext_out.to_yaml(cfg, "title")
    lines = text.splitlines()
    assert lines[0] == "# title" and lines[1].startswith("# Not said below:")
    for key, value in gone:
        assert f"#   {key}: {maxtext_out._yaml_value(value)}" in lines
    assert yaml.safe_load(text) == dict(maxtext_out.items(cfg))   # the block is comments only


def test_a_value_the_flags_say_differently_is_listed():
    cfg = _preset_config("deepseek3-test")
    cfg = cfg.replace(model=cfg.model.replace(attention_kernel="cudnn_thd"))
    # MaxText's cudnn_flash_te reads back as cudnn: the file does not say cudnn_thd
    assert ("model.attention_kernel", "cudnn_thd") in maxtext_out.left_out(cfg)


@pytest.mark.parametrize("name,gone", [
    ("mixtral-8x7b", []),
    ("qwen3-30b-a3b", [("model.qk_norm", True)]),
    ("deepseek3-671b", [("model.moe.seq_aux_coef", 1e-4), ("model.rope_type", "yarn"),
                        ("model.rope_factor", 40.0), ("model.rope_mscale_all_dim", 1.0)]),
])
def test_each_presets_left_out_settings(name, gone):
    cfg = _preset_config(name)
    assert maxtext_out.left_out(cfg) == gone
    first = maxtext_out.to_yaml(cfg, "t").splitlines()[1]
    assert first.startswith("# Not said below:" if gone else "# Every dropless setting")


def test_config_show_maxtext_writes_the_yaml_and_names_what_it_leaves_out(capsys, tmp_path):
    from dropless.cli import main
    assert main(["config", "show", "--preset", "deepseek3-1gpu", "--maxtext",
                 "steps=1000", "run_name=r1"]) == 0
    out, err = capsys.readouterr()
    gone, differs = err.splitlines()
    assert "model.moe.seq_aux_coef=0.0001, run_name=r1" in gone
    assert differs == f"dropless: note: {maxtext.weight_decay_differs(0.1)}"
    assert f"\n# {maxtext.weight_decay_differs(0.1)}\n" in out
    assert "\nsteps: 1000\n" in out and "#   run_name: \"r1\"" in out and "num_experts: 64" in out
    (tmp_path / "m.yml").write_text(out)   # reads back as the model it came from
    assert build_config(yaml_path=str(tmp_path / "m.yml")).model == get_preset("deepseek3-1gpu")
    assert main(["config", "show", "--maxtext", "model.moe.capacity_factor=1.0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "capacity_factor=1.0" in err


# the keys the run's length, schedule and mesh flags translate to, compared after a round trip
RUN_KEYS = ("steps", "learning_rate", "warmup_steps", "min_lr_ratio", "lr_decay_steps", "mesh")
MESHES = [{}, {"mesh.fsdp": 8}, {"mesh.data": 2, "mesh.expert": 4},
          {"mesh.data": 4, "mesh.dcn_data": 2, "mesh.fsdp": 2, "mesh.expert": 8,
           "mesh.dcn_expert": 2},
          {"mesh.fsdp": 16, "mesh.dcn_fsdp": 4, "mesh.expert": 2}]
SCHEDULES = [
    {},                                                        # the defaults: 400, warmup 20
    {"steps": 1000, "warmup_steps": 37, "learning_rate": 1e-4, "min_lr_ratio": 0.0},
    {"steps": 49, "warmup_steps": 1},                          # 1/49 x 49 rounds below 1
    {"steps": 1000, "warmup_steps": 0, "lr_decay_steps": 1000, "min_lr_ratio": 1.0},
    {"steps": 300, "warmup_steps": 300, "lr_decay_steps": 5000, "learning_rate": 2.5e-4},
    {"steps": 1000, "warmup_steps": 100, "lr_decay_steps": 600, "min_lr_ratio": 0.0},
]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("mesh", MESHES)
def test_the_steps_schedule_and_mesh_round_trip_through_the_yaml(mesh, schedule, tmp_path):
    """dropless config -> MaxText YAML -> dropless config: the same steps, learning rate,
    warmup, final ratio, decay horizon and mesh, each said by a flag MaxText declares (none
    of them left out)."""
    cfg = build_config([("preset", "deepseek3-test"), *mesh.items(), *schedule.items()])
    pairs = maxtext_out.items(cfg)
    _check_types(pairs)
    (tmp_path / "m.yml").write_text(maxtext_out.to_yaml(cfg, "round trip"))
    back = build_config(yaml_path=str(tmp_path / "m.yml"))
    assert {k: getattr(back, k) for k in RUN_KEYS} == {k: getattr(cfg, k) for k in RUN_KEYS}
    assert not {k for k, _ in maxtext_out.left_out(cfg)} & {*RUN_KEYS, "mesh.data",
                                                            "mesh.fsdp", "mesh.expert"}
    said = dict(pairs)
    # all six axes, so MaxText's own defaults (ici_fsdp and dcn_data -1: fill) never apply
    for axis in ("data", "fsdp", "expert"):
        dcn = getattr(cfg.mesh, f"dcn_{axis}")
        assert (said[f"ici_{axis}_parallelism"], said[f"dcn_{axis}_parallelism"]) == (
            getattr(cfg.mesh, axis) // dcn, dcn)
    # MaxText's warmup: int(learning_rate_schedule_steps (-1: steps) x warmup_steps_fraction)
    length = said.get("learning_rate_schedule_steps", said["steps"])
    assert int(length * said["warmup_steps_fraction"]) == cfg.warmup_steps


def test_the_warmup_fraction_gives_back_every_warmup_as_maxtext_truncates_it():
    for length in range(1, 260):
        for warmup in range(length + 1):
            fraction = maxtext_out.warmup_fraction(warmup, length)
            assert 0 <= fraction <= 1 and int(length * fraction) == warmup, (warmup, length)
    assert maxtext_out.warmup_fraction(21, 20) is None


@pytest.mark.parametrize("schedule,unsaid,absent", [
    # the cosine ends before the run: MaxText's rate is 0 after it, ours learning_rate x 0.1
    ({"steps": 1000, "lr_decay_steps": 500}, [("lr_decay_steps", 500)],
     "learning_rate_schedule_steps"),
    # a warmup longer than the run (the default 20 of 10 steps): no fraction in [0, 1] says it
    ({"steps": 10}, [("warmup_steps", 20)], "warmup_steps_fraction"),
])
def test_a_schedule_maxtexts_cannot_match_is_listed_not_written(schedule, unsaid, absent):
    cfg = build_config([("preset", "deepseek3-test"), *schedule.items()])
    assert absent not in dict(maxtext_out.items(cfg))
    assert set(unsaid) <= set(maxtext_out.left_out(cfg))


OPTIMIZERS = [
    {},                                                        # the defaults
    {"adam_b1": 0.8, "adam_b2": 0.999, "adam_eps": 1e-6, "weight_decay": 0.01, "grad_clip": 0.5},
    {"weight_decay": 0.0, "grad_clip": 0.0},                   # no decay, no clipping
]
OPTIMIZER_KEYS = ("adam_b1", "adam_b2", "adam_eps", "weight_decay", "grad_clip")


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_the_optimizer_round_trips_through_the_yaml(optimizer, tmp_path):
    """AdamW's betas, epsilon and decay and the clipping threshold are said by MaxText's flags
    (adam_b1, adam_b2, adam_eps, adam_weight_decay, gradient_clipping_threshold: 0 turns
    MaxText's clipping off as ours) and read back as they were, none left out."""
    cfg = build_config([("preset", "deepseek3-test"), *optimizer.items()])
    said = dict(maxtext_out.items(cfg))
    _check_types(said.items())
    assert [said[n] for n in ("adam_b1", "adam_b2", "adam_eps", "adam_weight_decay",
                              "gradient_clipping_threshold")] == \
        [getattr(cfg, k) for k in OPTIMIZER_KEYS]
    (tmp_path / "m.yml").write_text(maxtext_out.to_yaml(cfg, "round trip"))
    back = build_config(yaml_path=str(tmp_path / "m.yml"))
    assert {k: getattr(back, k) for k in OPTIMIZER_KEYS} == \
        {k: getattr(cfg, k) for k in OPTIMIZER_KEYS}
    assert not {k for k, _ in maxtext_out.left_out(cfg)} & set(OPTIMIZER_KEYS)


@pytest.mark.parametrize("decay", [0.1, 0.01, 0.0])
def test_a_weight_decay_maxtext_applies_to_every_parameter_is_said_in_one_line(decay):
    """MaxText's AdamW decays norm scales and the routing bias too (no adamw_mask); ours
    matrices only: with a decay above 0 the YAML says so in one comment line above the flags,
    and reads back with the same line as its one note about the decay."""
    cfg = build_config([("preset", "deepseek3-1gpu"), ("weight_decay", decay)])
    line = maxtext.weight_decay_differs(decay)
    assert maxtext_out.differences(cfg) == ([line] if decay else [])
    text = maxtext_out.to_yaml(cfg, "title")
    comments = [c for c in text.splitlines() if c.startswith("# ")]
    assert [c for c in comments if "adam_weight_decay" in c] == ([f"# {line}"] if decay else [])
    assert "\n" not in line and yaml.safe_load(text) == dict(maxtext_out.items(cfg))
    notes: list[str] = []
    build_config(list(yaml.safe_load(text).items()), notes=notes)
    assert [n for n in notes if "adam_weight_decay" in n] == ([line] if decay else [])


def test_reading_adam_weight_decay_notes_the_difference_once(tmp_path):
    """A MaxText config's adam_weight_decay is copied to weight_decay, with one note however
    often it is given at that value; our weight_decay adds none."""
    (tmp_path / "m.yml").write_text("adam_weight_decay: 0.1\n")
    notes: list[str] = []
    cfg = build_config([("adam_weight_decay", 0.1)], yaml_path=str(tmp_path / "m.yml"),
                       notes=notes)
    assert cfg.weight_decay == 0.1 and notes == [maxtext.weight_decay_differs(0.1)]
    assert "dropless decays matrices only" in notes[0] and "adamw_mask" in notes[0]
    for ours_or_none in ([("weight_decay", 0.1)], [("adam_weight_decay", 0)]):
        notes = []
        build_config(ours_or_none, notes=notes)
        assert notes == [], ours_or_none
