"""What an export leaves out of config.json (dropless.hf.round_trip.not_carried): every field of
ModelConfig and MoEConfig, changed on each architecture's released config, is written (a load
of the export reads it back), refused, named in a note, or deliberately neither (how dropless
runs the model, or a field the architecture does not use); and `hf.save` says each note once,
as a NotCarriedWarning from Python or to `announce`.

transformers' own config classes (4.57.6, 5.25.0) decide what is expressible: Mixtral's and
Qwen3-MoE's have `router_aux_loss_coef` (our load_balance_coef) and no z-loss or sequence-wise
weight; DeepseekV3Config has no loss weight at all (DeepSeek's released config.json adds
`aux_loss_alpha` with `seq_aux`, the sequence-wise weight, which transformers keeps as an extra
attribute); none has an MTP loss weight, a bias update speed or a capacity."""
import dataclasses
import functools
import json
import warnings

import pytest

from dropless import hf
from dropless.hf import config_map as cm
from dropless.hf import round_trip as rt
from tests._support.paths import HF_FIXTURES

RELEASED = {"mixtral": "mixtral-8x7b", "qwen3": "qwen3-30b-a3b", "deepseek": "deepseek-v3"}
ALL = set(RELEASED)


@functools.lru_cache(maxsize=None)
def base(arch: str):
    """The released config of `arch` as a ModelConfig (its MTP modules included)."""
    conf = json.loads((HF_FIXTURES / "released" / RELEASED[arch] / "config.json").read_text())
    return cm.model_config(conf, mtp_depth=int(conf.get("num_nextn_predict_layers") or 0))[0]


def changed(cfg, **dotted):
    """`cfg` with fields set by dotted name (`moe__z_loss_coef` for moe.z_loss_coef)."""
    top = {k: v for k, v in dotted.items() if not k.startswith("moe__")}
    moe = {k[5:]: v for k, v in dotted.items() if k.startswith("moe__")}
    return cfg.replace(**{"moe": cfg.moe.replace(**moe) if moe else cfg.moe, **top})


def field(cfg, dotted: str):
    return functools.reduce(getattr, dotted.split("."), cfg)


# The settings each architecture's config.json cannot carry (a value away from what a load of
# the export gives), and so names.
NAMED = [("moe.load_balance_coef", 0.01, {"deepseek"}),
         ("moe.seq_aux_coef", 1e-3, {"mixtral", "qwen3"}),
         ("moe.z_loss_coef", 1e-3, ALL),
         ("moe.bias_update_speed", 0.005, ALL),
         ("mtp_loss_coef", 0.1, {"deepseek"}),      # Mixtral and Qwen3 have no MTP modules
         ("moe.capacity_factor", 1.25, ALL)]


@pytest.mark.parametrize("arch", sorted(ALL))
@pytest.mark.parametrize("name,value,lost_in", NAMED, ids=[n for n, *_ in NAMED])
def test_each_setting_the_architecture_cannot_carry_is_named(arch, name, value, lost_in):
    assert rt.not_carried(base(arch)) == {}
    cfg = changed(base(arch), **{name.replace(".", "__"): value})
    assert rt.not_carried(cfg) == ({name: value} if arch in lost_in else {})


@pytest.mark.parametrize("arch", sorted(ALL))
def test_zero_or_the_default_names_nothing(arch):
    """The values a load of an export gives: zero loss weights, the score function's bias
    speed, the MTP weight's default, dropless routing."""
    cfg = changed(base(arch), moe__load_balance_coef=0.0, moe__seq_aux_coef=0.0,
                  moe__z_loss_coef=0.0, moe__bias_update_speed=None, mtp_loss_coef=0.3,
                  moe__capacity_factor=None)
    assert rt.not_carried(cfg) == {} and rt.not_carried_words(cfg) == []


def test_what_has_no_effect_is_not_named():
    """An MTP weight without MTP modules; DeepSeek's zero bias speed is not its default (0.001)
    and is named, a softmax model's is its default."""
    ds = base("deepseek")
    assert rt.not_carried(changed(ds, mtp_depth=0, mtp_loss_coef=0.1)) == {}
    assert rt.not_carried(changed(ds, moe__bias_update_speed=0.0)) == {
        "moe.bias_update_speed": 0.0}
    assert rt.not_carried(changed(base("mixtral"), moe__bias_update_speed=0.0)) == {}


def test_several_settings_are_one_line_each_in_field_order():
    cfg = changed(base("qwen3"), moe__z_loss_coef=1e-3, moe__seq_aux_coef=2e-4,
                  moe__capacity_factor=2.0)
    assert rt.not_carried_words(cfg) == [
        "moe.seq_aux_coef=0.0002 is not written: Qwen3MoeForCausalLM's config.json cannot "
        "carry it (a training setting; the exported model computes the same)",
        "moe.z_loss_coef=0.001 is not written: Qwen3MoeForCausalLM's config.json cannot carry "
        "it (a training setting; the exported model computes the same)",
        "moe.capacity_factor=2.0 is not written: Qwen3MoeForCausalLM's config.json cannot "
        "carry it (the exported model is dropless: it routes every token)"]


# One change per field (dotted name -> the settings that change it; a field that must move with
# another moves both). A new field of ModelConfig or MoEConfig fails the test until added here.
def _pattern(cfg):
    return {"first_k_dense": 0, "layer_pattern": "M" * (cfg.num_layers - 1) + "D"}


CHANGES = {
    "vocab_size": lambda c: {"vocab_size": c.vocab_size + 1},
    "d_model": lambda c: {"d_model": 2 * c.d_model, "moe__d_model": 2 * c.d_model},
    "num_layers": lambda c: {"num_layers": c.num_layers + 1},
    "num_heads": lambda c: {"num_heads": 2 * c.num_heads},
    "d_ff": lambda c: {"d_ff": c.d_ff + 2},
    "attention": lambda c: {"attention": "mha" if c.attention == "mla" else "mla"},
    "attention_kernel": lambda c: {"attention_kernel": "xla"},
    "max_segments_per_seq": lambda c: {"max_segments_per_seq": 8},
    "first_k_dense": lambda c: {"first_k_dense": 1},
    "layer_pattern": _pattern,
    "moe": lambda c: {"moe": None},
    "num_kv_heads": lambda c: {"num_kv_heads": c.kv_heads // 2},
    "head_dim": lambda c: {"head_dim": 64},
    "qk_norm": lambda c: {"qk_norm": not c.qk_norm},
    "q_lora_rank": lambda c: {"q_lora_rank": 0 if c.q_lora_rank else 64},
    "kv_lora_rank": lambda c: {"kv_lora_rank": 256},
    "qk_nope_head_dim": lambda c: {"qk_nope_head_dim": 64},
    "qk_rope_head_dim": lambda c: {"qk_rope_head_dim": 32},
    "v_head_dim": lambda c: {"v_head_dim": 64},
    "mla_norm_eps": lambda c: {"mla_norm_eps": 1e-5},
    "rope_theta": lambda c: {"rope_theta": 2 * c.rope_theta},
    "rope_type": lambda c: {"rope_type": "default" if c.rope_type == "yarn" else "yarn"},
    "rope_factor": lambda c: {"rope_factor": 20.0},
    "rope_original_max_position": lambda c: {"rope_original_max_position": 2048},
    "rope_beta_fast": lambda c: {"rope_beta_fast": 16.0},
    "rope_beta_slow": lambda c: {"rope_beta_slow": 2.0},
    "rope_mscale": lambda c: {"rope_mscale": 0.5},
    "rope_mscale_all_dim": lambda c: {"rope_mscale_all_dim": 0.5},
    "norm_eps": lambda c: {"norm_eps": 1e-5},
    "tie_embeddings": lambda c: {"tie_embeddings": not c.tie_embeddings},
    "mtp_depth": lambda c: {"mtp_depth": c.mtp_depth + 1},
    "mtp_loss_coef": lambda c: {"mtp_loss_coef": 0.1},
    "dtype": lambda c: {"dtype": "float32"},
    "weight_dtype": lambda c: {"weight_dtype": "float32"},
    "scan_layers": lambda c: {"scan_layers": True},
    "init": lambda c: {"init": "normal"},
    "init_std": lambda c: {"init_std": 0.01},
    "head_init_std": lambda c: {"head_init_std": 0.01},
    "embed_init_std": lambda c: {"embed_init_std": 0.01},
    "init_residual_scaling": lambda c: {"init_residual_scaling": True},
    "moe.num_experts": lambda c: {"moe__num_experts": 2 * c.moe.num_experts},
    "moe.top_k": lambda c: {"moe__top_k": 1},
    "moe.d_model": lambda c: {"d_model": 2 * c.d_model, "moe__d_model": 2 * c.d_model},
    "moe.d_ff": lambda c: {"moe__d_ff": 2 * c.moe.d_ff},
    "moe.num_shared_experts": lambda c: {"moe__num_shared_experts": c.moe.num_shared_experts + 1},
    "moe.score_func": lambda c: {"moe__score_func": "sigmoid" if c.moe.score_func == "softmax"
                                 else "softmax"},
    "moe.norm_topk_prob": lambda c: {"moe__norm_topk_prob": not c.moe.norm_topk_prob},
    "moe.routed_scaling_factor": lambda c: {"moe__routed_scaling_factor": 2.0},
    "moe.n_groups": lambda c: {"moe__n_groups": 2 if c.moe.n_groups == 1 else 4},
    "moe.topk_groups": lambda c: {"moe__n_groups": 4, "moe__topk_groups": 2},
    "moe.capacity_factor": lambda c: {"moe__capacity_factor": 1.25},
    "moe.gmm_backend": lambda c: {"moe__gmm_backend": "ragged_dot"},
    "moe.align_expert_rows": lambda c: {"moe__align_expert_rows": 128},
    "moe.gmm_quantization": lambda c: {"moe__gmm_quantization": "mxfp8"},
    "moe.mx_scale_rounding": lambda c: {"moe__mx_scale_rounding": "up"},
    "moe.mx_grad_elem": lambda c: {"moe__mx_grad_elem": "e5m2"},
    "moe.nvfp4_weight_blocks": lambda c: {"moe__nvfp4_weight_blocks": "1d"},
    "moe.nvfp4_tensor_scale": lambda c: {"moe__nvfp4_tensor_scale": False},
    "moe.nvfp4_rht": lambda c: {"moe__nvfp4_rht": False},
    "moe.nvfp4_stochastic_rounding": lambda c: {"moe__nvfp4_stochastic_rounding": False},
    "moe.nvfp4_seed": lambda c: {"moe__nvfp4_seed": 7},
    "moe.dispatch_quantization": lambda c: {"moe__gmm_quantization": "mxfp8",
                                            "moe__dispatch_quantization": "mxfp8"},
    "moe.dtype": lambda c: {"moe__dtype": "float32"},
    "moe.weight_dtype": lambda c: {"moe__weight_dtype": "float32"},
    "moe.prefuse_moe_weights": lambda c: {"moe__prefuse_moe_weights": True},
    "moe.load_balance_coef": lambda c: {"moe__load_balance_coef": 0.01},
    "moe.seq_aux_coef": lambda c: {"moe__seq_aux_coef": 1e-3},
    "moe.z_loss_coef": lambda c: {"moe__z_loss_coef": 1e-3},
    "moe.bias_update_speed": lambda c: {"moe__bias_update_speed": 0.005},
    "moe.dispatcher": lambda c: {"moe__dispatcher": "a2a"},
    "moe.ragged_buffer_factor": lambda c: {"moe__ragged_buffer_factor": 3.0},
    "moe.overflow": lambda c: {"moe__overflow": "error"},
    "moe.overflow_check_every_n_steps": lambda c: {"moe__overflow_check_every_n_steps": 5},
    "moe.ep_comm_overlap_chunks": lambda c: {"moe__ep_comm_overlap_chunks": 2},
}
# How dropless runs, stores or first draws the model: whoever loads the folder chooses again.
NOT_THE_MODELS = {
    "attention_kernel", "max_segments_per_seq", "scan_layers", "dtype", "init", "head_init_std",
    "embed_init_std", "init_residual_scaling", "moe.gmm_backend", "moe.align_expert_rows",
    "moe.gmm_quantization", "moe.mx_scale_rounding", "moe.mx_grad_elem",
    "moe.nvfp4_weight_blocks", "moe.nvfp4_tensor_scale", "moe.nvfp4_rht",
    "moe.nvfp4_stochastic_rounding", "moe.nvfp4_seed", "moe.dispatch_quantization", "moe.dtype",
    "moe.weight_dtype", "moe.prefuse_moe_weights", "moe.dispatcher", "moe.ragged_buffer_factor",
    "moe.overflow", "moe.overflow_check_every_n_steps", "moe.ep_comm_overlap_chunks"}
_MLA = {"q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
        "mla_norm_eps"}
_YARN = {"rope_factor", "rope_original_max_position", "rope_beta_fast", "rope_beta_slow",
         "rope_mscale", "rope_mscale_all_dim"}
# fields the architecture's forward pass does not read (the released Mixtral and Qwen3-MoE use
# plain RoPE and no MTP modules)
UNUSED = {"mixtral": _MLA | _YARN | {"mtp_loss_coef"}, "qwen3": _MLA | _YARN | {"mtp_loss_coef"},
          "deepseek": {"num_kv_heads", "head_dim", "qk_norm"}}


def _dotted_fields() -> set[str]:
    from dropless.config import ModelConfig, MoEConfig
    return ({f.name for f in dataclasses.fields(ModelConfig)}
            | {f"moe.{f.name}" for f in dataclasses.fields(MoEConfig)})


def test_every_field_has_a_change():
    assert set(CHANGES) == _dotted_fields()
    assert set(rt.NOTED) <= set(CHANGES) and NOT_THE_MODELS <= set(CHANGES)
    assert not set(rt.NOTED) & NOT_THE_MODELS


def _same(cfg):
    return cfg if cfg.attention == "mla" else cfg.replace(head_dim=cfg.mha_head_dim)


@pytest.mark.parametrize("arch", sorted(ALL))
@pytest.mark.parametrize("name", sorted(CHANGES))
def test_every_field_is_written_refused_named_or_not_the_models(arch, name):
    """Changed alone, a field the export loses (a load of config.json reads another value) is
    named by `not_carried` exactly when it is in NOTED; the others are how dropless runs the
    model or unused by the architecture. A refused change (UnsupportedCheckpoint) is a forward
    pass the architecture cannot express."""
    cfg = changed(base(arch), **CHANGES[name](base(arch)))
    try:
        out = rt.exported_config(cfg)
    except hf.UnsupportedCheckpoint:
        assert name not in rt.NOTED, "a training setting is noted, never refused"
        return
    back = cm.model_config(out, mtp_depth=out.get("num_nextn_predict_layers") or 0)[0]
    lost = (field(_same(cfg), name) != field(_same(back), name)) if cfg.moe else False
    named = rt.not_carried(cfg)
    if lost and name in rt.NOTED and name not in UNUSED[arch]:
        assert named == {name: field(cfg, name)}
    else:
        assert named == {}
        assert not lost or name in NOT_THE_MODELS | UNUSED[arch], f"{name} is lost unsaid"


def _tiny(arch: str):
    folder = {"mixtral": "mixtral", "qwen3": "qwen3_moe", "deepseek": "deepseek_v3_yarn"}[arch]
    return hf.load(HF_FIXTURES / folder, dtype="float32")


def test_save_from_python_warns_once_per_setting(tmp_path):
    cfg, params = _tiny("deepseek")
    noisy = changed(cfg, moe__load_balance_coef=0.01, moe__z_loss_coef=1e-3, mtp_loss_coef=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hf.save(noisy, params, tmp_path / "out")
    notes = [w for w in caught if issubclass(w.category, hf.NotCarriedWarning)]
    assert [str(w.message) for w in notes] == rt.not_carried_words(noisy)
    assert [str(w.message).split("=")[0] for w in notes] == [
        "moe.load_balance_coef", "moe.z_loss_coef", "mtp_loss_coef"]
    assert all(w.filename == __file__ for w in notes)     # pointing at the caller
    out = json.loads((tmp_path / "out" / "config.json").read_text())
    assert not {"router_aux_loss_coef", "aux_loss_alpha", "z_loss_coef"} & set(out)
    assert hf.read_config(tmp_path / "out")[0] == cfg   # the model, without the settings


def test_save_with_announce_says_each_line_once_and_warns_nothing(tmp_path):
    cfg, params = _tiny("mixtral")
    noisy = changed(cfg, moe__seq_aux_coef=1e-3)
    lines = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", hf.NotCarriedWarning)
        hf.save(noisy, params, tmp_path / "said", announce=lines.append)
        hf.save(cfg, params, tmp_path / "quiet")                 # nothing to say: no warning
    assert lines == ["moe.seq_aux_coef=0.001 is not written: MixtralForCausalLM's config.json "
                     "cannot carry it (a training setting; the exported model computes the same)"]


def test_a_refused_save_says_no_note(tmp_path):
    cfg, params = _tiny("mixtral")
    bad = changed(cfg, moe__z_loss_coef=1e-3, moe__routed_scaling_factor=2.0)
    lines = []
    with pytest.raises(hf.UnsupportedCheckpoint, match="routed_scaling_factor"):
        hf.save(bad, params, tmp_path / "out", announce=lines.append)
    assert lines == [] and not (tmp_path / "out").exists()
