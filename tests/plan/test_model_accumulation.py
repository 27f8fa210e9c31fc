"""Gradient accumulation in the planner (`TrainConfig.gradient_accumulation_steps` k): one
micro-batch's memory plus a float32 gradient accumulator; every part of the step k times one
micro-batch's except the optimizer's, which runs once. The reference for k > 1 is the k = 1
plan of the same micro-batch, scaled by hand (`_accumulated_by_hand`), and the trainer's own
`global_batch_size` for the tokens a step trains on.
"""
from __future__ import annotations

import json

import pytest

from dropless.cli import main
from dropless.machine import get_profile
from dropless.plan import memory
from dropless.plan.from_train import build_plan
from dropless.plan.layout import flat_settings
from dropless.plan.model import predict
from dropless.plan.reference import REFERENCE
from dropless.plan.sweep import candidate_layouts, suggest, sweep_gpus
from dropless.presets import get_preset
from tests.plan.plans import bf16, plan_of

K = 4
ONE_GPU = ["--preset", "deepseek3-1gpu", "--hardware", "h100", "--gpus", "1"]
# plans that exercise every part: one device (compute and optimizer only); the reference's
# 128-GPU layout (FSDP, EP with MXFP8 grouped matmuls, offload) under each overlap, and with
# its EP in chunks; data parallelism over 4 replicas of a dense model, its query and value
# offloaded
PLANS = {
    "one_gpu": lambda: build_plan([("preset", "deepseek3-1gpu"), ("hardware", "h100"),
                                   ("gpus", 1)]),
    "reference": lambda: (REFERENCE, get_profile("gb300")),
    "reference_serial": lambda: (REFERENCE.replace(overlap="none"), get_profile("gb300")),
    "reference_full": lambda: (REFERENCE.replace(overlap="full"), get_profile("gb300")),
    "reference_chunked": lambda: (REFERENCE.replace_moe(ep_comm_overlap_chunks=4),
                                  get_profile("gb300")),
    "dense_data": lambda: (plan_of(bf16(get_preset("deepseek3-test")).replace(moe=None),
                                   data=4, fsdp=2, seq=1024, remat="offload"),
                           get_profile("h100")),
}


def _plan(name):
    cfg, hw, *_ = PLANS[name]()
    return cfg, hw


def _accumulated_by_hand(one: dict, k: int) -> dict:
    """The step of k micro-batches from one micro-batch's plan: every part k times, the
    optimizer once, and the replicas' gradient reduction once, after the loop, all of it
    exposed (where XLA:GPU puts it: tests/train/test_step_accumulation_gpu_compile.py)."""
    def scale(parts):
        return {p: (v if p in ("optimizer", "data") else k * v) for p, v in parts.items()}
    kernel, exposed = scale(one["time"]["kernel_s"]), scale(one["time"]["exposed_s"])
    exposed["data"] = kernel["data"]
    return {"kernel_s": kernel, "exposed_s": exposed, "step_s": sum(exposed.values())}


def test_without_accumulation_the_plan_is_one_micro_batch_and_no_accumulator():
    cfg, hw = _plan("reference")
    assert cfg.accumulation == 1 and cfg.step_tokens_per_device == cfg.micro_tokens_per_device
    r = predict(cfg, hw)
    mem = r["memory"]
    assert mem["grad_accumulator"] == 0.0
    parts = ("parameters", "gradients", "optimizer_state", "gathered_weights",
             "compute_weights", "activations", "layer_workspace", "logits", "ep_buffers")
    assert mem["total"] == sum(mem[p] for p in parts)   # exact: adding 0.0 changes nothing
    assert r["time"]["step_s"] == sum(r["time"]["exposed_s"].values())
    explicit = predict(cfg.replace_run(gradient_accumulation_steps=1), hw)
    assert json.dumps(explicit, sort_keys=True) == json.dumps(r, sort_keys=True)


@pytest.mark.parametrize("name", sorted(PLANS))
def test_every_part_but_the_optimizer_runs_once_per_micro_batch(name):
    cfg, hw = _plan(name)
    one = predict(cfg, hw)
    many = predict(cfg.replace_run(gradient_accumulation_steps=K), hw)
    want = _accumulated_by_hand(one, K)
    for kind in ("kernel_s", "exposed_s"):
        assert many["time"][kind].keys() == want[kind].keys()
        for part, v in want[kind].items():
            assert many["time"][kind][part] == pytest.approx(v, rel=1e-12, abs=0), (kind, part)
    assert many["time"]["kernel_s"]["optimizer"] == one["time"]["kernel_s"]["optimizer"] > 0
    assert many["time"]["step_s"] == pytest.approx(want["step_s"], rel=1e-12)
    fl1, flk = one["flops"], many["flops"]
    assert flk["model_per_device"] == pytest.approx(K * fl1["model_per_device"], rel=1e-12)
    assert flk["executed_per_device"] == pytest.approx(K * fl1["executed_per_device"], rel=1e-12)
    assert flk["model_per_token"] == pytest.approx(fl1["model_per_token"], rel=1e-12)
    # the optimizer is paid once for K micro-batches: more useful work a second
    assert many["mfu"] > one["mfu"]
    assert many["tokens_per_s"] > one["tokens_per_s"]
    assert many["tflops_per_device"] == pytest.approx(
        flk["model_per_device"] / many["time"]["step_s"] / 1e12, rel=1e-12)


@pytest.mark.parametrize("name", sorted(PLANS))
def test_a_step_trains_on_the_trainers_global_batch(name):
    cfg, hw = _plan(name)
    run = cfg.run.replace(gradient_accumulation_steps=K)
    r = predict(cfg.replace(run=run), hw)
    tokens = r["tokens_per_s"] * r["time"]["step_s"]
    assert tokens == pytest.approx(run.global_batch_size * run.seq_len, rel=1e-12)
    assert run.global_batch_size == K * run.micro_batch_size
    per_device = r["tokens_per_s_per_device"] * r["time"]["step_s"]
    assert per_device == pytest.approx(K * run.per_device_batch_size * run.seq_len, rel=1e-12)


@pytest.mark.parametrize("name", sorted(PLANS))
def test_memory_is_one_micro_batch_plus_a_float32_accumulator(name):
    cfg, hw = _plan(name)
    one = predict(cfg, hw)["memory"]
    many = predict(cfg.replace_run(gradient_accumulation_steps=K), hw)["memory"]
    for part in ("parameters", "gradients", "optimizer_state", "gathered_weights",
                 "compute_weights", "activations", "layer_workspace", "logits", "ep_buffers",
                 "host_offloaded"):
        assert many[part] == one[part], part
    # one float32 value per parameter the device holds, whatever the weights' dtype
    assert many["grad_accumulator"] == memory.sharded_params(cfg) * 4 > 0
    assert many["grad_accumulator"] == one["parameters"] * 4 / cfg.weight_bytes
    assert many["total"] == pytest.approx(one["total"] + many["grad_accumulator"], rel=1e-12)
    assert many["headroom"] == pytest.approx(one["headroom"] - many["grad_accumulator"],
                                             rel=1e-12)


def test_the_one_gpu_presets_float32_accumulator_is_its_weights():
    """deepseek3-1gpu keeps float32 weights: its accumulator is exactly the size of its weights
    (and of all their float32 gradients, which its unrolled step never holds at once:
    plan/memory.py)."""
    cfg, hw = _plan("one_gpu")
    assert cfg.model.weight_dtype == "float32"
    mem = predict(cfg.replace_run(gradient_accumulation_steps=K), hw)["memory"]
    assert mem["grad_accumulator"] == mem["parameters"] > mem["gradients"]


@pytest.mark.parametrize("name", ["reference", "dense_data"])
def test_traffic_is_one_micro_batchs_per_pass(name):
    cfg, hw = _plan(name)
    one = predict(cfg, hw)["bytes"]
    many = predict(cfg.replace_run(gradient_accumulation_steps=K), hw)["bytes"]
    for kind in ("fsdp", "data", "ep", "ep_real_rows", "ep_without_dedup", "ep_with_dedup"):
        if kind not in one:
            continue
        times = 1 if kind == "data" else K   # the summed gradients are reduced once
        for link in ("intra", "inter"):
            assert many[kind][link] == pytest.approx(times * one[kind][link], rel=1e-12)
    assert many["host_offload"] == K * one["host_offload"] > 0
    if "ep_dispatch_wire" in one:
        w1, wk = one["ep_dispatch_wire"], many["ep_dispatch_wire"]
        assert wk["dispatch_bytes"] == w1["dispatch_bytes"]   # one dispatch is one dispatch
        assert wk["step_bytes"] == pytest.approx(K * w1["step_bytes"], rel=1e-12)
        assert many["ep_rows_per_token"] == one["ep_rows_per_token"]


def test_the_same_global_batch_trades_memory_for_the_optimizers_share():
    """Per-device batch 8 in one pass against 2 x 4 accumulation steps: the same tokens and
    FLOPs a step, a quarter of the activations, the accumulator on top."""
    cfg, hw = _plan("one_gpu")
    whole = predict(cfg.replace_run(per_device_batch_size=8), hw)
    split = predict(cfg.replace_run(per_device_batch_size=2, gradient_accumulation_steps=4), hw)
    assert split["flops"]["model_per_device"] == pytest.approx(
        whole["flops"]["model_per_device"], rel=1e-12)
    assert split["memory"]["activations"] == pytest.approx(
        whole["memory"]["activations"] / 4, rel=1e-12)
    assert split["memory"]["logits"] == pytest.approx(whole["memory"]["logits"] / 4, rel=1e-12)
    assert split["time"]["kernel_s"]["optimizer"] == whole["time"]["kernel_s"]["optimizer"]


def test_flat_settings_sweep_and_suggest_keep_the_accumulation():
    cfg, hw = _plan("reference")
    cfg = cfg.replace_run(gradient_accumulation_steps=K)
    assert flat_settings(cfg)["gradient_accumulation_steps"] == K
    assert predict(cfg, hw)["layout"]["gradient_accumulation_steps"] == K
    assert {c.accumulation for c, _ in candidate_layouts(cfg)} == {K}
    row = sweep_gpus(cfg, hw, [cfg.mesh.num_devices])[0]
    assert row["step_s"] == predict(cfg, hw)["time"]["step_s"]
    best = suggest(cfg, hw, top=1)[0]
    once = suggest(cfg.replace_run(gradient_accumulation_steps=1), hw, top=10 ** 4)
    same = [r for r in once if all(r[k] == best[k] for k in
                                   ("fsdp", "ep", "data", "remat", "ragged_buffer_factor"))]
    assert same and best["tokens_per_s"] > same[0]["tokens_per_s"]


def test_the_calibration_times_one_micro_batchs_kernels_and_plans_one_pass():
    """`dropless plan --calibrate` times the matmuls of one forward and backward pass, and
    predicts the trainer's step it times, which accumulates nothing."""
    from dropless.bench import calibrate
    cfg, _ = _plan("reference")
    mm, gmm = calibrate.kernel_shapes(cfg.replace_run(gradient_accumulation_steps=K))
    t = cfg.run.per_device_batch_size * cfg.run.seq_len
    assert mm[0] == t and gmm[0] == t * cfg.moe.top_k
    assert (mm, gmm) == calibrate.kernel_shapes(cfg)
    assert calibrate._train_plan(2).accumulation == 1
    parts = calibrate.train_parts(get_profile("h100"), 2)
    assert parts["optimizer"] > 0 and parts["gemm"] > 0


def test_the_command_prints_the_accumulation(capsys):
    assert main(["plan", *ONE_GPU, f"gradient_accumulation_steps={K}"]) == 0
    text = capsys.readouterr().out
    assert f"per-device batch 4 x seq 4096 x {K} accumulation steps, remat minimal" in text
    acc = [ln.split() for ln in text.splitlines() if ln.strip().startswith("grad_accumulator")]
    weights = [ln.split() for ln in text.splitlines() if ln.strip().startswith("parameters")]
    assert len(acc) == 1 and float(acc[0][1]) > 0 and acc[0][1] == weights[0][1]
    assert main(["plan", *ONE_GPU]) == 0
    text = capsys.readouterr().out
    assert "per-device batch 4 x seq 4096, remat minimal" in text
    assert "accumulation" not in text
    assert main(["plan", *ONE_GPU, f"gradient_accumulation_steps={K}", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["layout"]["gradient_accumulation_steps"] == K
    assert r["memory"]["grad_accumulator"] == r["memory"]["parameters"] > 0


@pytest.mark.parametrize("value, why", [("0", "must be a positive int"),
                                        ("-1", "must be a positive int"),
                                        ("x", "must be an int"), ("1.5", "must be an int")])
def test_a_bad_accumulation_is_refused_in_one_line_naming_the_key(value, why, capsys):
    assert main(["plan", *ONE_GPU, f"gradient_accumulation_steps={value}"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and captured.out == ""
    assert err.startswith("dropless: error: ")
    assert "gradient_accumulation_steps" in err and why in err
