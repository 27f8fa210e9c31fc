"""Two spellings of one key in one config file or command line (ours and MaxText's, or our
former flat mesh keys): refused in one line naming both unless they agree, in either order;
a later file or command line still overrides an earlier one in whatever spelling
(`config_file.resolve`, `one_spelling`)."""
import pytest

from dropless.cli import main
from dropless.config_file import build_config


@pytest.mark.parametrize("items,said", [
    ([("mesh.expert", 4), ("ici_expert_parallelism", 2)],
     "mesh.expert=4 and MaxText ici_expert_parallelism=2 (mesh.expert=2) both set mesh.expert"),
    ([("ici_expert_parallelism", 2), ("mesh.expert", 4)],
     "MaxText ici_expert_parallelism=2 (mesh.expert=2) and mesh.expert=4 both set mesh.expert"),
    ([("expert_parallelism", 4), ("ici_expert_parallelism", 2)],
     "expert_parallelism=4 (mesh.expert=4) and MaxText ici_expert_parallelism=2"),
    ([("mesh.fsdp", 2), ("fsdp_parallelism", 4)],
     "mesh.fsdp=2 and fsdp_parallelism=4 (mesh.fsdp=4) both set mesh.fsdp"),
    ([("mesh.dcn_expert", 2), ("ici_expert_parallelism", 4)],
     "mesh.dcn_expert=2 and MaxText ici_expert_parallelism=4 (mesh.dcn_expert=1)"),
    ([("seq_len", 32), ("max_target_length", 64)],
     "seq_len=32 and MaxText max_target_length=64 (seq_len=64) both set seq_len"),
    ([("dtype", "bfloat16"), ("model.dtype", "float32")],
     "MaxText dtype='bfloat16' (model.dtype='bfloat16') and model.dtype='float32'"),
    ([("init_weights_seed", 2), ("seed", 1)], "init_weights_seed=2 (seed=2) and seed=1"),
    ([("weight_decay", 0.1), ("adam_weight_decay", 0.0)],
     "weight_decay=0.1 and MaxText adam_weight_decay=0.0 (weight_decay=0.0)"),
    ([("model.moe.top_k", 4), ("num_experts_per_tok", 2)],
     "model.moe.top_k=4 and MaxText num_experts_per_tok=2 (model.moe.top_k=2)"),
    ([("preset", "tiny"), ("model_name", "deepseek3-test")],
     "preset='tiny' and MaxText model_name='deepseek3-test' (preset='deepseek3-test')"),
    ([("xla_flags", "--xla_gpu_enable_command_buffer="),
      ("xla_gpu_enable_command_buffer", "FUSION")],
     "both set xla_flags"),
])
def test_two_spellings_that_disagree_are_refused_naming_both(items, said):
    with pytest.raises(ValueError) as e:
        build_config(items)
    line = str(e.value)
    assert said in line and "\n" not in line
    assert "keep one of them, or give both the same value" in line


def test_two_spellings_that_agree_are_one_setting():
    cfg = build_config([("mesh.expert", 4), ("ici_expert_parallelism", 4),
                        ("max_target_length", 64), ("seq_len", 64),
                        ("dtype", "bfloat16"), ("model.dtype", "bfloat16"),
                        ("learning_rate", 1e-3), ("learning_rate", "1e-3")])
    assert (cfg.mesh.expert, cfg.seq_len, cfg.model.dtype) == (4, 64, "bfloat16")
    # MaxText's own flags among themselves keep their rules (here: the later one wins)
    cfg = build_config([("topk_routing_group", 4), ("n_routing_groups", -1)])
    assert (cfg.model.moe.n_groups, cfg.model.moe.topk_groups) == (1, 1)
    # one name given twice on a command line: the later wins
    assert build_config([("mesh.expert", 4), ("mesh.expert", 2)]).mesh.expert == 2


def test_in_one_yaml_file_either_order(tmp_path):
    p = tmp_path / "c.yml"
    for text in ("ici_expert_parallelism: 2\nmesh:\n  expert: 4\n",
                 "mesh:\n  expert: 4\nici_expert_parallelism: 2\n"):
        p.write_text(text)
        with pytest.raises(ValueError, match="both set mesh.expert in one config file"):
            build_config(yaml_path=str(p))


def test_a_later_file_or_command_line_overrides_in_any_spelling(tmp_path):
    p = tmp_path / "c.yml"
    p.write_text("ici_expert_parallelism: 2\nmax_target_length: 64\n")
    cfg = build_config([("mesh.expert", 4), ("seq_len", 32)], yaml_path=str(p))
    assert (cfg.mesh.expert, cfg.seq_len) == (4, 32)
    p.write_text("mesh:\n  expert: 4\n")
    assert build_config([("ici_expert_parallelism", 2)], yaml_path=str(p)).mesh.expert == 2


def test_xla_keys_add_to_xla_flags_in_either_order():
    for items in ([("xla_gpu_enable_latency_hiding_scheduler", True),
                   ("xla_flags", "--xla_gpu_enable_command_buffer=")],
                  [("xla_flags", "--xla_gpu_enable_command_buffer="),
                   ("xla_gpu_enable_latency_hiding_scheduler", True)]):
        flags = build_config(items).xla_flags.split()
        assert sorted(flags) == ["--xla_gpu_enable_command_buffer=",
                                 "--xla_gpu_enable_latency_hiding_scheduler=true"]


def test_the_cli_says_it_in_one_line(capsys):
    assert main(["config", "show", "mesh.expert=4", "ici_expert_parallelism=2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "mesh.expert=4 and MaxText ici_expert_parallelism=2" in err
    # the planner's --ep flag is our mesh.expert, on the same command line
    assert main(["plan", "--ep", "4", "ici_expert_parallelism=2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "both set mesh.expert" in err


def test_the_planners_config_file_is_one_source(tmp_path, capsys):
    p = tmp_path / "p.yml"
    p.write_text("ici_expert_parallelism: 2\n")   # the flag after the file wins
    assert main(["plan", "--config", str(p), "--ep", "4", "--json"]) == 0
    assert '"ep": 4' in capsys.readouterr().out
    p.write_text("ici_expert_parallelism: 2\nmesh:\n  expert: 4\n")
    assert main(["plan", "--config", str(p)]) == 2
    assert "both set mesh.expert" in capsys.readouterr().err
