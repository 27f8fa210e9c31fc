"""The published DeepSeek-V3 GB300 recipe: every key accepted with its meaning, in a YAML file,
on the command line and by `dropless plan --config`; config errors are one line naming the key
and value; `dropless config keys` lists each key once."""
from pathlib import Path

import pytest

from dropless.cli import main
from dropless.compat import maxtext
from dropless.config_file import build_config, known_keys, parse_override
from dropless.runtime import xla_flags as xf
from tests._support.paths import EXAMPLES

GB300 = str(EXAMPLES / "deepseek3_671b_gb300.yml")
CPU8 = str(EXAMPLES / "deepseek3_cpu8.yml")


def test_recipe_means_what_it_says():
    notes: list[str] = []
    cfg = build_config(yaml_path=GB300, notes=notes)
    moe = cfg.model.moe
    assert cfg.preset == "deepseek3-671b" and (cfg.seq_len, cfg.per_device_batch_size) == (4096, 6)
    assert moe.dispatcher == "auto" and moe.gmm_quantization == "mxfp8"       # te_moe_block
    assert moe.capacity_factor is None                                        # still dropless
    assert (moe.ragged_buffer_factor, moe.overflow_check_every_n_steps) == (2.0, 20)
    assert cfg.distributed is True                                            # gpu_multiprocess
    # FSDP 16 = ICI 8 x DCN 2, EP 8: 128 devices in 2 nodes (NVLink domains) of 64
    assert (cfg.mesh.fsdp, cfg.mesh.dcn_fsdp, cfg.mesh.expert) == (16, 2, 8)
    assert cfg.num_devices == 128 and cfg.mesh.devices_per_node == 64
    flags = xf.parse_flags(cfg.xla_flags)
    assert flags["xla_gpu_all_gather_combine_threshold_bytes"] == \
        "--xla_gpu_all_gather_combine_threshold_bytes=6442450944"
    assert flags["xla_gpu_enable_command_buffer"] == "--xla_gpu_enable_command_buffer="
    assert flags["xla_gpu_experimental_enable_nccl_symmetric_buffers"].endswith("=false")
    assert xf.parse_environment(cfg.environment) == {
        "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.88", "CUDA_DEVICE_MAX_CONNECTIONS": "16",
        "XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE": "false", "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB": "180"}
    assert any(n.startswith("capacity_factor=1.0 changes nothing") for n in notes)


def test_recipe_keys_on_the_command_line_equal_the_file():
    lines = [ln for ln in Path(GB300).read_text().splitlines() if ln and not ln.startswith("#")]
    items = [parse_override(ln.replace(": ", "=", 1)) for ln in lines]
    assert build_config(items) == build_config(yaml_path=GB300)


@pytest.mark.parametrize("path", [GB300, CPU8])
def test_examples_load_in_config_show_and_plan(path, capsys):
    assert main(["config", "show", "--config", path]) == 0
    out = capsys.readouterr().out
    assert "distributed: true" in out and "# note: capacity_factor=1.0 changes nothing" in out
    assert main(["plan", "--config", path, "--hardware", "gb300"]) == 0
    out = capsys.readouterr().out
    assert "fsdp 16 x ep 8 (64 GPUs per node" in out if path == GB300 else "ep 4" in out


def test_later_flag_and_variable_win():
    cfg = build_config([("xla_gpu_enable_command_buffer", ""), ("CUDA_DEVICE_MAX_CONNECTIONS", 1),
                        ("xla_gpu_enable_command_buffer", "FUSION"),
                        ("CUDA_DEVICE_MAX_CONNECTIONS", 16)])
    assert cfg.xla_flags == "--xla_gpu_enable_command_buffer=FUSION"
    assert cfg.environment == "CUDA_DEVICE_MAX_CONNECTIONS=16"


def test_mesh_keys_are_order_free():
    a = build_config([("dcn_expert_parallelism", 2), ("ici_expert_parallelism", 4)])
    b = build_config([("ici_expert_parallelism", 4), ("dcn_expert_parallelism", 2)])
    assert a == b and (a.mesh.expert, a.mesh.dcn_expert, a.mesh.devices_per_node) == (8, 2, 4)


@pytest.mark.parametrize("items,message", [
    ([("hardware", "gpu_multi")], "MaxText hardware='gpu_multi' is not supported"),
    ([("te_moe_block", "yes")], "MaxText te_moe_block='yes' must be true or false"),
    ([("XLA_PYTHON_CLIENT_MEM_FRACTION", 1.5)],
     "XLA_PYTHON_CLIENT_MEM_FRACTION='1.5' must be a fraction in \\(0, 1\\]"),
    ([("CUDA_DEVICE_MAX_CONNECTIONS", "many")], "CUDA_DEVICE_MAX_CONNECTIONS='many' must be"),
    ([("xla_flags", "xla_gpu_foo=1")], "'xla_gpu_foo=1' is not an XLA flag"),
    ([("xla_gpu_foo", [1, 2])], "xla_gpu_foo=\\[1, 2\\] must be one number, word"),
    ([("dcn_fsdp_parallelism", -1)], "dcn_fsdp_parallelism=-1 must be >= 1"),
    ([("expert_parallelism", 4), ("dcn_expert", 3)], "MeshConfig.dcn_expert=3 must divide"),
    ([("mesh.expert", 4), ("mesh.dcn_expert", 3)], "MeshConfig.dcn_expert=3 must divide"),
    ([("dcn_expert_parallelism", 2), ("ici_expert_parallelism", 4),
      ("model.moe.devices_per_node", 8)], "'model.moe.devices_per_node' \\(8\\) is gone: the "
     "node size follows from the mesh; set .* mesh.dcn_data, mesh.dcn_fsdp, mesh.dcn_expert"),
    ([("environment", "HOME=/tmp")], "HOME='/tmp' is not one a config sets"),
])
def test_config_errors_are_one_line_naming_key_and_value(items, message):
    with pytest.raises(ValueError, match=message) as e:
        build_config(items)
    assert "\n" not in str(e.value)


def test_bad_yaml_is_one_line_with_file_line_column(tmp_path):
    p = tmp_path / "bad.yml"
    p.write_text("steps: 3\nmodel:\n  d_model: [32\nseq_len: 8\n")
    with pytest.raises(ValueError, match=r"bad.yml:4:\d+: invalid YAML") as e:
        build_config(yaml_path=str(p))
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="cannot be read"):
        build_config(yaml_path=str(tmp_path / "missing.yml"))


def test_unknown_key_points_at_config_keys_which_lists_each_once(capsys):
    with pytest.raises(ValueError, match="`dropless config keys` lists the keys"):
        build_config([("te_moe_blok", True)])
    assert main(["config", "keys"]) == 0
    names = [ln for ln in capsys.readouterr().out.splitlines() if not ln.startswith("#")]
    assert len(names) == len(set(names)) and "te_moe_block" in names
    assert set(known_keys()) <= set(names)


def test_maxtext_docstring_keys_are_known():
    for key in ("te_moe_block", "hardware", "prefuse_moe_weights", "dcn_fsdp_parallelism",
                "xla_gpu_enable_command_buffer", "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"):
        assert maxtext.is_known(key)
    assert not maxtext.is_known("xla_recipe") and not maxtext.is_known("XLA_FLAGS")


# One MaxText key at a time: (name, value, the other items it reads) -> our pairs, and the note.
# Every key translated by more than a plain rename is here (see test_every_translated_key_...).
ONE_KEY_CASES = [
    ("te_moe_block", True, {}, [("model.moe.dispatcher", "auto")], None),
    ("te_moe_block", "false", {}, [], "te_moe_block=false changes nothing: dropless has one "
                                      "MoE block"),
    ("hardware", "gpu_multiprocess", {}, [("distributed", True)], None),
    ("hardware", "gpu", {}, [("distributed", False)], None),
    ("attention", "cudnn_flash_te", {}, [("model.attention_kernel", "cudnn")], None),
    ("attention", "cudnn_flash_jax", {}, [("model.attention_kernel", "cudnn")], None),
    ("attention", "dot_product", {}, [("model.attention_kernel", "xla")], None),
    ("max_segments_per_seq", 32, {}, [("model.max_segments_per_seq", 32)], None),
    ("max_segments_per_seq", -1, {}, [], "max_segments_per_seq=-1 (no bound) keeps "
     "model.max_segments_per_seq=32: cudnn_thd's segment form needs one (a batch with a row of "
     "more documents takes the masked form)"),
    ("attention", "autoselected", {}, [("model.attention_kernel", "auto")], None),
    ("attention", "flash", {}, [("model.attention_kernel", "auto")],
     "attention=flash is model.attention_kernel=auto: cuDNN's flash attention on an NVIDIA GPU, "
     "where MaxText runs tokamax's Pallas Triton kernel"),
    ("prefuse_moe_weights", "true", {}, [("model.moe.prefuse_moe_weights", True)], None),
    ("prefuse_moe_weights", False, {}, [("model.moe.prefuse_moe_weights", False)], None),
    ("sparse_matmul", False, {}, [], None),   # read by capacity_factor
    ("megablox", False, {}, [("model.moe.gmm_backend", "auto")], None),
    ("megablox", True, {"use_tokamax_gmm": True}, [], None),
    ("use_tokamax_gmm", "true", {}, [("model.moe.gmm_backend", "tokamax")], None),
    ("use_tokamax_gmm", False, {}, [], None),
    ("te_gmm_quantization", "TE_MXFP8", {}, [("model.moe.gmm_quantization", "mxfp8")], None),
    ("te_gmm_quantization", "none", {}, [("model.moe.gmm_quantization", "none")], None),
    ("capacity_factor", 1.0, {}, [("model.moe.capacity_factor", None)],
     "capacity_factor=1.0 changes nothing with sparse_matmul=true: the grouped-matmul path is "
     "dropless"),
    ("capacity_factor", "1.25", {"sparse_matmul": "false"},
     [("model.moe.capacity_factor", 1.25)], None),
    ("capacity_factor", -1, {"sparse_matmul": False}, [("model.moe.capacity_factor", None)],
     None),
    ("remat_policy", "save_qkv_proj", {}, [("remat", "minimal")], None),
    ("remat_policy", "qkv_proj_offloaded", {}, [("remat", "offload")], None),
    ("n_routing_groups", -1, {}, [("model.moe.n_groups", 1), ("model.moe.topk_groups", 1)],
     None),
    ("n_routing_groups", "8", {}, [("model.moe.n_groups", 8)], None),
    ("topk_routing_group", -1, {}, [("model.moe.topk_groups", 1)], None),
    ("topk_routing_group", 4, {}, [("model.moe.topk_groups", 4)], None),
    ("base_num_kv_heads", 8, {}, [("model.num_kv_heads", 8)], None),   # GQA
    ("base_num_kv_heads", 16, {"attention_type": "mla", "base_num_query_heads": 16}, [], None),
    ("routed_bias", True, {}, [], None),
    ("routed_bias", "false", {}, [("model.moe.bias_update_speed", 0.0)], None),
    ("warmup_steps_fraction", 0.1, {"steps": 1000}, [("warmup_steps", 100)], None),
    # no steps given: the run's, TrainConfig's default (400), not another number
    ("warmup_steps_fraction", 0.1, {}, [("warmup_steps", 40)], None),
    # a fraction of the schedule's steps where they are given (MaxText's int() truncates)
    ("warmup_steps_fraction", 0.1, {"steps": 1000, "learning_rate_schedule_steps": 2000},
     [("warmup_steps", 200)], None),
    ("warmup_steps_fraction", 0.1, {"steps": 1000, "learning_rate_schedule_steps": -1},
     [("warmup_steps", 100)], None),
    ("warmup_steps_fraction", 1 / 49, {"learning_rate_schedule_steps": 49},
     [("warmup_steps", 0)], None),   # 49 x (1 / 49) is 0.9999999999999999
    ("learning_rate_schedule_steps", 1200, {"steps": 1000}, [("lr_decay_steps", 1200)], None),
    ("learning_rate_schedule_steps", -1, {}, [("lr_decay_steps", 0)], None),
    ("learning_rate_schedule_steps", 500, {"steps": 1000}, [("lr_decay_steps", 500)],
     "learning_rate_schedule_steps=500 ends the schedule before steps=1000: from there dropless "
     "trains at learning_rate x min_lr_ratio, where MaxText's rate is 0 "
     "(learning_rate_final_fraction=0 makes both 0)"),
    ("learning_rate_schedule_steps", 500, {"steps": 1000, "learning_rate_final_fraction": 0.0},
     [("lr_decay_steps", 500)], None),   # both 0 after the schedule
    ("lr_schedule_type", "cosine", {}, [], None),
    ("opt_type", "adamw", {}, [], None),
    ("adam_eps_root", 0.0, {}, [], None),
    ("adamw_mask", [], {}, [], None),
    ("cosine_learning_rate_final_fraction", 0.05, {}, [("min_lr_ratio", 0.05)], None),
    ("attention_type", "mla", {}, [("model.attention", "mla")], None),
    ("attention_type", "global", {}, [("model.attention", "mha")], None),
    ("decoder_block", "deepseek", {}, [], "decoder_block=deepseek changes nothing: the "
     "architecture follows from the preset and the model keys"),
    ("enable_checkpointing", False, {}, [("checkpoint_every", 0), ("save_last_step", False)],
     "enable_checkpointing=False is checkpoint_every=0 save_last_step=false: a run stopped by a "
     "signal, a non-finite step or an overflow still saves its last good step, so it can resume"),
    ("enable_checkpointing", True, {}, [], None),
    ("ici_fsdp_parallelism", 8, {"dcn_fsdp_parallelism": 2},
     [("mesh.fsdp", 16), ("mesh.dcn_fsdp", 2)], None),
    ("dcn_expert_parallelism", 2, {}, [("mesh.expert", 2), ("mesh.dcn_expert", 2)], None),
    ("ici_data_parallelism", "4", {}, [("mesh.data", 4), ("mesh.dcn_data", 1)], None),
    ("dcn_data_parallelism", 1, {"ici_data_parallelism": 2},
     [("mesh.data", 2), ("mesh.dcn_data", 1)], None),
    ("ici_expert_parallelism", 8, {}, [("mesh.expert", 8), ("mesh.dcn_expert", 1)], None),
    ("dcn_fsdp_parallelism", 2, {"ici_fsdp_parallelism": 4},
     [("mesh.fsdp", 8), ("mesh.dcn_fsdp", 2)], None),
    ("ici_tensor_parallelism", 1, {}, [], None),
    ("dcn_pipeline_parallelism", 1, {}, [], None),
    ("data_parallelism", 2, {}, [("mesh.data", 2)], None),   # our flat mesh keys
    ("fsdp_parallelism", 4, {}, [("mesh.fsdp", 4)], None),
    ("expert_parallelism", 8, {}, [("mesh.expert", 8)], None),
    ("dcn_data", 1, {}, [("mesh.dcn_data", 1)], None),
    ("dcn_fsdp", 2, {}, [("mesh.dcn_fsdp", 2)], None),
    ("dcn_expert", 2, {}, [("mesh.dcn_expert", 2)], None),
    ("xla_gpu_enable_command_buffer", None, {},
     [("xla_flags+", "--xla_gpu_enable_command_buffer=")], None),
    ("NCCL_DEBUG", "INFO", {}, [("environment+", "NCCL_DEBUG=INFO")], None),
    ("weight_dtype", "bfloat16", {},
     [("model.weight_dtype", "bfloat16"), ("model.moe.weight_dtype", "bfloat16")], None),
    ("model_name", "deepseek3-671b", {}, [("preset", "deepseek3-671b")], None),
    ("num_experts_per_tok", 8, {}, [("model.moe.top_k", 8)], None),
    # data flags
    ("dataset_type", "hf", {}, [], None),
    ("dataset_type", "grain", {}, [], None),
    ("hf_path", "/tmp", {}, [("data", "/tmp")], None),
    ("hf_path", "/tmp", {"hf_data_dir": "c4"}, [("data", "/tmp/c4")], None),
    ("hf_path", "/tmp", {"hf_train_files": "/tmp/a.jsonl"}, [], None),
    ("hf_data_dir", "c4", {"hf_path": "/tmp"}, [], None),
    ("hf_train_files", "d/train.jsonl", {}, [("data", "d/train.jsonl")], None),
    ("grain_train_files", "prepared", {}, [("data", "prepared")], None),
    ("hf_eval_files", "d/eval.jsonl", {}, [("eval_data", "d/eval.jsonl")], None),
    ("train_split", "train", {}, [], None),
    ("eval_split", "validation", {}, [], "eval_split=validation reads the held-out split "
     "dropless has: a prepared dataset's 'eval' split, else eval_fraction of the data (or "
     "hf_eval_files)"),
    ("packing", True, {}, [("packing", "documents")], None),
    ("packing", "false", {}, [("packing", "pad")], None),
    ("add_bos", True, {}, [], "add_bos=True: a BOS is added as the tokenizer's own "
     "post-processor says (a prepared dataset's manifest records it); the flag changes "
     "nothing"),
    ("add_eos", "true", {}, [], None),
    ("tokenizer_path", "no/such/dir", {}, [("tokenizer", "no/such/dir")], None),
    ("grain_worker_count", 4, {}, [], "grain_worker_count=4 changes nothing: dropless builds "
     "batches on one background thread, `prefetch` batches ahead (docs/data.md)"),
]


@pytest.mark.parametrize("name,value,others,pairs,note", ONE_KEY_CASES)
def test_one_key_translates_to_its_pairs_and_note(name, value, others, pairs, note):
    notes: list[str] = []
    assert maxtext.translate_each([(name, value)], context={**others, name: value},
                                  notes=notes) == [pairs]
    assert notes == ([note] if note else [])
    if not others:   # the items themselves are the context by default
        assert maxtext.translate([(name, value)]) == pairs


def test_every_translated_key_that_is_not_a_plain_rename_has_a_case():
    cased = {name for name, *_ in ONE_KEY_CASES}
    others = (set(maxtext.KNOWN) | set(maxtext.FORMER_KEYS)) - set(maxtext.RENAMES)
    noop = set(maxtext.NOOP_ONLY) - {"ici_tensor_parallelism", "dcn_pipeline_parallelism"}
    assert others - noop <= cased


@pytest.mark.parametrize("items,error,message", [
    ([("attention", "paged")], ValueError,
     r"^MaxText attention='paged' is not supported \(training runs one of \['autoselected', "
     r"'dot_product', 'cudnn_flash_te', 'cudnn_flash_jax', 'flash'\]\)$"),
    ([("hardware", "gpu_multi")], ValueError,
     r"^MaxText hardware='gpu_multi' is not supported; known: \('cpu', 'gpu', "
     r"'gpu_multiprocess', 'tpu'\)$"),
    ([("prefuse_moe_weights", "yes")], ValueError,
     "^MaxText prefuse_moe_weights='yes' must be true or false$"),
    ([("sparse_matmul", "yes"), ("steps", 3)], ValueError,
     "^MaxText sparse_matmul='yes' must be true or false$"),
    ([("te_gmm_quantization", "te_fp8")], ValueError,
     r"^MaxText te_gmm_quantization='te_fp8' is not supported; known: \['mxfp8', 'none', "
     r"'te_mxfp8'\]$"),
    ([("remat_policy", "save_everything")], ValueError,
     r"^MaxText remat_policy='save_everything' is not supported; known: \['full', "
     r"'minimal', 'minimal_offloaded', 'none', 'qkv_proj_offloaded', 'save_qkv_proj'\]$"),
    ([("attention_type", "local")], ValueError,
     "^MaxText attention_type='local' is not supported; use 'mla' or 'global'$"),
    ([("ici_tensor_parallelism", 2)], ValueError,
     r"^MaxText ici_tensor_parallelism=2 is not supported \(dropless has no such mesh axis\); "
     "only 1 is accepted$"),
    ([("lr_schedule_type", "wsd")], ValueError,
     r"^MaxText lr_schedule_type='wsd' is not supported \(dropless's schedule is a linear "
     r"warmup, then a cosine decay\); only cosine is accepted$"),
    ([("opt_type", "muon")], ValueError,
     r"^MaxText opt_type='muon' is not supported \(dropless trains with AdamW\); only adamw "
     "is accepted$"),
    ([("adam_eps_root", 1e-8)], ValueError,
     r"^MaxText adam_eps_root=1e-08 is not supported \(dropless's AdamW adds adam_eps outside "
     r"the square root only\); only 0.0 is accepted$"),
    ([("adamw_mask", ["norm"])], ValueError,
     r"^MaxText adamw_mask=\['norm'\] is not supported \(dropless decays matrices only, never "
     r"norm weights or biases\); only \[\] is accepted$"),
    ([("learning_rate_schedule_steps", 0)], ValueError,
     r"^MaxText learning_rate_schedule_steps=0 must be a positive number of steps, or -1 "
     r"\(the run's steps\)$"),
    ([("ici_fsdp_parallelism", 4), ("dcn_fsdp_parallelism", -1)], ValueError,
     r"^MaxText dcn_fsdp_parallelism=-1 must be >= 1 \(MaxText's -1, 'fill the rest', is not "
     r"supported: give the size\)$"),
    ([("ici_expert_parallelism", "x")], ValueError,
     "^MaxText ici_expert_parallelism='x' must be an int$"),
    ([("use_tokamax_gmm", 1)], ValueError, "^MaxText use_tokamax_gmm=1 must be true or false$"),
    ([("enable_checkpointing", "no")], ValueError,
     "^MaxText enable_checkpointing='no' must be true or false$"),
    ([("te_moe_blok", True)], KeyError, "te_moe_blok"),
    ([("dataset_type", "tfds")], ValueError,
     r"^MaxText dataset_type='tfds' is not supported: dropless reads local files .*dropless "
     r"data prepare"),
    ([("hf_path", "allenai/c4")], ValueError,
     r"^MaxText hf_path='allenai/c4' is not a local folder, and dropless downloads nothing "
     r"from the Hugging Face hub: .*huggingface-cli download --repo-type dataset allenai/c4"),
    ([("hf_data_dir", "en")], ValueError, "^MaxText hf_data_dir='en' needs hf_path"),
    ([("hf_train_files", "c4/*.json")], ValueError,
     r"^MaxText hf_train_files='c4/\*.json' names several files; .*dropless data prepare "
     r".* data=OUT$"),
    ([("grain_train_files", "d/x.array_record")], ValueError,
     r"^MaxText grain_train_files='d/x.array_record': a .array_record file is read by "
     r"`dropless data prepare` only"),
    ([("train_split", "validation")], ValueError, "^MaxText train_split='validation' is not "
                                                  "supported"),
    ([("add_eos", False)], ValueError, "^MaxText add_eos=false is not supported"),
    ([("packing", "maybe")], ValueError, "^MaxText packing='maybe' must be true or false$"),
    ([("xla_recipe", "auto")], KeyError, "xla_recipe"),   # ours, not a MaxText flag
])
def test_one_key_errors_name_key_and_value(items, error, message):
    with pytest.raises(error, match=message):
        maxtext.translate(items)


@pytest.mark.parametrize("value,packing", [("true", "documents"), (False, "pad"),
                                           ("documents", "documents"), ("stream", "stream")])
def test_packing_is_maxtexts_boolean_or_ours(value, packing):
    assert build_config([("packing", value)]).packing == packing


def test_a_tokenizer_folder_means_its_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    assert maxtext.translate([("tokenizer_path", str(tmp_path))]) == [
        ("tokenizer", str(tmp_path / "tokenizer.json"))]


@pytest.mark.parametrize("items,message", [
    ([("capacity_factor", "abc")], "MaxText capacity_factor='abc' must be a finite number"),
    ([("capacity_factor", [1])], r"MaxText capacity_factor=\[1\] must be a finite number"),
    ([("sparse_matmul", False), ("capacity_factor", float("nan"))],
     "MaxText capacity_factor=nan must be a finite number"),   # was dropless, silently
    ([("n_routing_groups", 2.5)], "MaxText n_routing_groups=2.5 must be an int"),  # was 2
    ([("n_routing_groups", [8])], r"MaxText n_routing_groups=\[8\] must be an int"),
    ([("topk_routing_group", "x")], "MaxText topk_routing_group='x' must be an int"),
    ([("warmup_steps_fraction", float("inf"))],
     "MaxText warmup_steps_fraction=inf must be a finite number"),
    ([("warmup_steps_fraction", 2)], r"warmup_steps_fraction=2 must be a fraction of the "
     r"steps in \[0, 1\]"),
    ([("warmup_steps_fraction", 0.1), ("steps", "abc")],
     "warmup_steps_fraction=0.1 is a fraction of steps, and steps='abc' is not an int"),
    ([("warmup_steps_fraction", 0.1), ("learning_rate_schedule_steps", "abc")],
     "MaxText learning_rate_schedule_steps='abc' must be an int"),
    ([("routed_bias", False), ("routed_bias_update_rate", "abc")],
     "MaxText routed_bias_update_rate='abc' must be a finite number"),
    ([("remat_policy", ["full"])], r"MaxText remat_policy=\['full'\] is not supported"),
    ([("attention", ["flash"])], r"MaxText attention=\['flash'\] is not supported"),
])
def test_a_bad_value_of_a_translated_flag_is_a_value_error_naming_it(items, message):
    # each was a bare TypeError / OverflowError / int() message, or silently accepted
    with pytest.raises(ValueError, match=message) as e:
        build_config(items)
    assert "\n" not in str(e.value)
