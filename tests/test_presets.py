"""Presets: parameter counts against published numbers and a hand count; FLOPs per token
against a hand count; the deepseek3-test preset runs forward with MTP."""
import jax
import jax.numpy as jnp
import pytest

from dropless.models import arithmetic as ar
from dropless.models import decoder
from dropless.models.arithmetic import param_counts
from dropless.presets import PRESETS, PUBLISHED_COUNTS, get_preset
from dropless.train import metrics as met


@pytest.mark.parametrize("name", sorted(PUBLISHED_COUNTS))
def test_published_parameter_counts(name):
    total, active = PUBLISHED_COUNTS[name]
    c = param_counts(get_preset(name))
    assert abs(c["total"] - total) / total < 0.01, c
    assert abs(c["active"] - active) / active < 0.03, c   # published actives are rounded


def test_tiny_hand_count():
    # tiny: d=128, 4 layers, 4 heads, MLA (no q low-rank, L=64, N=32, R=16, V=32),
    # layer 0 dense (d_ff 384), layers 1-3 MoE (8 experts d_ff 128, top-2, 1 shared), vocab 256.
    attn = 128 * 4 * 48 + 64 + 128 * 80 + 64 * 4 * 64 + 4 * 32 * 128   # wq, kv_norm, kv_a, kv_b, wo
    dense = 3 * 128 * 384
    experts = 8 * 3 * 128 * 128
    moe = 128 * 8 + 8 + experts + 3 * 128 * 128                        # router w + bias, shared
    norms = 4 * 2 * 128 + 128
    total = 256 * 128 * 2 + 4 * attn + dense + 3 * moe + norms
    c = param_counts(get_preset("tiny"))
    assert c["total"] == total
    assert c["active"] == total - 3 * experts * 6 // 8


def test_tiny_flops_hand_count():
    # matmul weights per token: attention 4 * (24576 + 10240 + 16384 + 16384) = 270336,
    # dense FFN 147456, MoE 3 * (router 1024 + shared 49152 + 2 experts 98304) = 445440,
    # head 32768 -> 896000; training = 6x. Attention: 3 (fwd+bwd) * 4 layers * 2 (QK, AV) *
    # 4 heads * (48 + 32) * S/2 keys (causal, as MaxText counts it) = 3 * 4 * 4 * 80 * S, S = 128.
    cfg = get_preset("tiny")
    assert ar.matmul_params(cfg) == {"main": 896000.0, "mtp": 0.0}
    want = 6 * 896000 + 3 * 4 * 4 * 80 * 128
    f = ar.flops_per_token(cfg, 128)
    assert f["model"] == want and f["executed"] == want
    f_cap = ar.flops_per_token(cfg, 128, capacity_factor=1.5)
    assert f_cap["executed"] == want + 6 * (3 * 8 * 3 * 128 * 128 * 2 / 8) * 0.5


def test_throughput_arithmetic():
    t = met.throughput(step_time_s=2.0, tokens=1000, flops_per_token=1e9, num_devices=2,
                       peak_flops_per_device=1e12)
    assert t["tokens_per_s"] == 500 and t["tflops_per_device"] == 0.25 and t["mfu"] == 0.25
    assert met.throughput(step_time_s=1, tokens=1, flops_per_token=1, num_devices=1,
                          peak_flops_per_device=None)["mfu"] is None


def test_device_peak_table():
    from dropless import machine
    assert machine.device_peak_flops("NVIDIA H100 80GB HBM3", "bfloat16") == 989.4e12
    assert machine.device_peak_flops("NVIDIA GB200", "fp8") == 5000e12   # not B200's
    assert machine.device_peak_flops("NVIDIA B200", "mxfp8") == 4500e12
    assert machine.device_peak_flops("cpu", "bfloat16") is None


def test_expert_load_summary():
    s = met.expert_load_summary([[2, 2, 2, 2], [8, 0, 0, 0]])
    assert s == {"expert_load_max_over_mean": 4.0, "expert_load_max_over_mean_avg": 2.5}


def test_deepseek3_test_forward_with_mtp():
    cfg = get_preset("deepseek3-test")
    params = decoder.init_params(jax.random.key(0), cfg)
    tokens = jnp.zeros((2, 8), jnp.int32)

    @jax.jit
    def run(params, tokens):
        logits, h, aux = decoder.forward(params, tokens, cfg)
        return logits, aux, decoder.mtp_logits(params, h, tokens, cfg)[0]
    logits, aux, mtp = run(params, tokens)
    assert logits.shape == (2, 8, 256) and len(mtp) == 1 and mtp[0].shape == (2, 8, 256)
    assert aux["tokens_per_expert_LE"].shape == (2, 8)
    assert int(aux["tokens_per_expert_LE"].sum()) == 2 * 2 * 8 * 2   # 2 layers, T=16, top-2


def test_unknown_preset_suggests():
    with pytest.raises(ValueError, match="preset='tiny2'.*did you mean 'tiny'"):
        get_preset("tiny2")


def test_big_presets_init_abstractly():
    for name in PRESETS:
        shapes = jax.eval_shape(lambda k, n=name: decoder.init_params(k, get_preset(n)),
                                jax.random.key(0))
        runs = shapes.get("layer_runs")   # the scan layout: one stacked run per layer kind
        depth = (len(shapes["layers"]) if runs is None
                 else sum(jax.tree.leaves(r)[0].shape[0] for r in runs))
        assert depth == get_preset(name).num_layers


def test_deepseek3_1gpu_hand_count_and_its_weights():
    # d=1024, 16 heads, MLA (q rank 384, kv rank 256, nope 64, rope 32, v 64), layer 0 dense
    # (d_ff 4096), layers 1-15 MoE (64 experts of d_ff 512, top-8, 2 shared = 1024 wide),
    # vocab 32768, embedding and head untied, no MTP.
    d, h = 1024, 16
    attn = (d * 384 + 384 + 384 * h * 96          # wq_a, q_norm, wq_b
            + d * (256 + 32) + 256 + 256 * h * 128   # wkv_a, kv_norm, wkv_b
            + h * 64 * d)                        # wo
    experts = 64 * 3 * d * 512
    moe = d * 64 + 64 + experts + 3 * d * 1024   # router w + bias, routed, shared
    total = 2 * 32768 * d + 16 * attn + 3 * d * 4096 + 15 * moe + 16 * 2 * d + d
    m = get_preset("deepseek3-1gpu")
    c = param_counts(m)
    assert c["total"] == total == 1_683_468_224
    assert c["active"] == total - 15 * experts * (64 - 8) // 64 == 362_262_464
    # an independent count: the weights the model initialises (their shapes, nothing allocated)
    shapes = jax.eval_shape(lambda: decoder.init_params(jax.random.PRNGKey(0), m))
    assert sum(x.size for x in jax.tree.leaves(shapes)) == total
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(shapes))   # master weights
    assert (m.dtype, m.moe.dtype, m.moe.score_func) == ("bfloat16", "bfloat16", "sigmoid")
    assert 1e9 <= c["total"] <= 3e9 and 0.3e9 <= c["active"] <= 0.8e9


def test_deepseek3_1gpu_trains_on_cpu_at_a_reduced_size(tmp_path):
    """The preset's full width (1024, 64 experts top-8, vocab 32768, bf16 on f32) with one dense
    and one MoE layer at sequence 64: its 190M parameters and Adam moments fit a CPU's memory
    (the whole preset's 27 GB of state do not, docs/training.md "One GPU")."""
    from dropless.config_file import build_config
    from dropless.presets import RUN_SETTINGS
    from dropless.train.loop import train
    (tmp_path / "c.txt").write_text("def add(a, b):\n    return a + b\n\n" * 300)
    cfg = build_config([("preset", "deepseek3-1gpu"), *RUN_SETTINGS["deepseek3-1gpu"].items(),
                        ("model.num_layers", 2), ("seq_len", 64), ("per_device_batch_size", 1),
                        ("steps", 3), ("data", str(tmp_path / "c.txt")),
                        ("eval_fraction", 0.1), ("eval_batches", 1), ("checkpoint_every", 0),
                        ("save_last_step", False),   # 2.3 GB of state not written
                        ("time_kernels", False), ("learning_rate", 3e-4),
                        ("run_dir", str(tmp_path / "runs")), ("mesh.data", 1)])
    assert cfg.remat == "minimal" and cfg.model.weight_dtype == "float32"
    result = train(cfg, echo=lambda s: None)
    losses = [result.losses[n] for n in (1, 2, 3)]
    assert all(jnp.isfinite(x) for x in losses)
    assert abs(losses[0] - float(jnp.log(32768.0))) < 1.0   # uniform over the vocabulary at init


def test_a_one_gpu_preset_brings_its_run_settings_and_a_given_key_wins():
    from dropless.config_file import build_config
    from dropless.presets import RUN_SETTINGS
    cfg = build_config([("preset", "deepseek3-1gpu")])
    assert {k: getattr(cfg, k) for k in RUN_SETTINGS["deepseek3-1gpu"]} == \
        {"seq_len": 4096, "per_device_batch_size": 4, "remat": "minimal"}
    cfg = build_config([("preset", "deepseek3-1gpu"), ("seq_len", 128), ("remat", "none")])
    assert (cfg.seq_len, cfg.per_device_batch_size, cfg.remat) == (128, 4, "none")
    assert build_config([("preset", "deepseek3-test")]).seq_len != 4096   # others: unchanged
