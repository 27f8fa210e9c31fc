"""The memory pre-flight as XLA:GPU compiles the step: deepseek3-1gpu at its run settings
(`presets.RUN_SETTINGS`: sequence 4096, batch 4, remat=minimal), its layers unrolled as it
ships, fits an H100 and an H200 (the step compiled for compile-only devices from the jax CUDA
plugin, with abstract inputs; train/compile_only.py), with the GPU's grouped-matmul kernels and
the XLA attention, and the planner's memory model of that layout is near it. The same preset with
its layers scanned (accumulation, the refusal of an oversized config):
test_preflight_scanned_gpu_compile.py.

Each device is checked against its own memory: XLA schedules the step for the memory the target
declares (jax 0.11.2: 45.36 GiB on the H100, 45.38 on the H200). Two compiles of the whole
16-layer step, about 50 s each on an idle 2-core machine. The compiled bytes are checked against
an independent floor: the arguments are exactly the float32 parameters and two Adam moments
(`models.arithmetic.param_counts` x 12 bytes, plus the step counter and key), and the
temporaries hold at least the float32 gradients.

`dropless plan --compile-for h100 --kernels --out FILE` on the same preset, end to end: the
predicted per-kernel table (runtime.hlo_kernels) is printed and written as JSON lines in the
measured table's schema (train/profile.py), the grouped matmul and attention have predicted
time, the printed step time is the rows' sum, and the optimizer group moves the bytes AdamW must
(read weights, gradients and both moments, write weights and moments, float32 each). Its step
is the H100 step above (the same TrainConfig): the module's compiles are shared
(`cuda_compile.compiled_once`), so the file costs two compiles, not three.
"""
from __future__ import annotations

import contextlib
import io
import json
import math

import pytest

from dropless.cli import main
from dropless.config import TrainConfig
from dropless.machine import PROFILES
from dropless.models.arithmetic import param_counts
from dropless.presets import PRESETS, RUN_SETTINGS, get_preset
from dropless.runtime import hlo_kernels
from dropless.train import preflight
from dropless.train.profile import table_records
from tests._support import cuda_compile
from tests._support.param_count import param_counts as counted_params

cuda_compile.require_plugin()

GiB = 2 ** 30
TRITON, MOSAIC = "__gpu$xla.gpu.triton", "mosaic_gpu_v2"


def _cfg() -> TrainConfig:
    return TrainConfig(model=get_preset("deepseek3-1gpu"), preset="deepseek3-1gpu",
                       **RUN_SETTINGS["deepseek3-1gpu"])


@pytest.fixture(scope="module", autouse=True)
def shared_compiles():
    """The pre-flight's H100 check and `dropless plan --compile-for h100` compile the same step:
    once in this module."""
    with cuda_compile.compiled_once() as done:
        yield done


@pytest.fixture(scope="module")
def compiled() -> dict:
    """{kind: (the pre-flight's verdict, the compiled step's optimized HLO text)}."""
    out = {}
    for kind in ("h100", "h200"):
        texts = []
        fit = preflight.check(_cfg(), target=kind, on_compiled=lambda e: texts.append(e.as_text()))
        out[kind] = (fit, texts[0])
    return out


@pytest.fixture(scope="module")
def fits(compiled) -> dict:
    return {kind: fit for kind, (fit, _) in compiled.items()}


@pytest.mark.parametrize("kind", ["h100", "h200"])
def test_the_step_runs_each_grouped_matmul_kernel_once_a_layer(compiled, kind):
    """The compile-only step holds the GPU's grouped-matmul kernels (Pallas/Mosaic custom calls
    lowered for the named GPU), not XLA's ragged_dot: per MoE layer the forward's three (gate,
    up, down), their dlhs and drhs. Nine, not twelve: remat=minimal keeps the forward's
    outputs (moe.SAVED_NAMES), so the backward pass does not run them again."""
    text = compiled[kind][1]
    assert "ragged-dot" not in text
    gmm = [r for r in hlo_kernels.kernels(text) if r["group"] == "moe_gmm"
           and r["kind"] in (TRITON, MOSAIC)]
    model = get_preset("deepseek3-1gpu")
    moe_layers = model.num_layers - model.first_k_dense
    # unrolled: one instruction a launch
    assert len(gmm) == 9 * moe_layers and {r["count"] for r in gmm} == {1}, gmm
    rows = RUN_SETTINGS["deepseek3-1gpu"]["per_device_batch_size"] * 4096 * 8   # top-8
    assert sum(r["flops"] for r in gmm) == 9 * moe_layers * 2 * rows * 1024 * 512


@pytest.mark.parametrize("kind", ["h100", "h200"])
def test_the_step_runs_the_xla_attention_without_cudnn(compiled, kind):
    """cuDNN's flash attention is traced only with the cuDNN library, which the compile-only
    process lacks: the step holds the XLA attention (no cuDNN custom call), whose S x S
    scores make the compiled bytes an upper bound of the GPU's."""
    assert "__cudnn$fmha" not in compiled[kind][1]


@pytest.mark.parametrize("kind", ["h100", "h200"])
def test_preset_fits_by_the_compiled_step(fits, kind):
    fit = fits[kind]
    assert fit["method"] == "compiled"
    c = fit["compiled"]
    n = param_counts(get_preset("deepseek3-1gpu"))["total"]
    # float32 weights + 2 Adam moments (+ the step, the key, the bias-update counters: < 1 MiB)
    assert 12 * n <= c["arguments"] <= 12 * n + 2 ** 20
    assert c["aliased"] == pytest.approx(c["arguments"], rel=1e-3)   # the state is donated
    assert c["temp"] >= 4 * n                                        # the gradients at least
    limit = cuda_compile.MEMORY_BYTES[kind] * 0.92
    assert fit["limit"] == limit and fit["total"] < limit
    assert fit["total"] == c["arguments"] + c["outputs"] - c["aliased"] + c["temp"] + c["code"]
    assert "compiled step" in preflight.summary(fit)


def test_the_planners_unrolled_model_is_near_the_compiled_step(fits):
    """The planner's memory model (`dropless plan`'s, with the attention the compiled step runs:
    the XLA one, `naive`) of the layout the preset ships, unrolled: a layer's activations are
    freed as its backward pass writes its gradients (the blocks' bfloat16 gradients in the
    place of their cast weights), and the backward holds one block's workspace at a time
    (plan/memory.py). Within 10% above the compiled step and at most 3% under it (jax 0.11.2:
    45.53 against 45.36 GiB on the H100, 45.38 on the H200); the scanned layout's model:
    test_preflight_scanned_gpu_compile.py."""
    assert get_preset("deepseek3-1gpu").scan_layers is False
    for fit in fits.values():
        ratio = fit["model_total"] / fit["total"]
        assert 0.97 <= ratio <= 1.10, (fit["total"] / GiB, fit["model_total"] / GiB)


# `dropless plan --compile-for h100 --kernels`

ARGV = ["plan", "--preset", "deepseek3-1gpu", "--hardware", "h100", "--gpus", "1",
        "--compile-for", "h100", "--kernels"]


@pytest.fixture(scope="module")
def planned(tmp_path_factory, compiled) -> tuple[int, str, list[dict]]:
    """One `dropless plan ... --kernels --out X` (after `compiled`, whose H100 step it reuses):
    its status, its text, its JSON lines."""
    out = tmp_path_factory.mktemp("kernels") / "kernels.jsonl"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main([*ARGV, "--out", str(out)])
    return rc, buf.getvalue(), [json.loads(ln) for ln in out.read_text().splitlines()]


def test_the_table_is_written_in_the_measured_tables_schema(planned):
    rc, _, recs = planned
    assert rc == 0
    head, rest = recs[0], recs[1:]
    assert head["event"] == "header" and head["target"] == "h100"
    assert head["command"] == ("dropless plan gpus=1 preset=deepseek3-1gpu hardware=h100 "
                               "--compile-for h100 --kernels")
    import jax
    assert head["jax"] == jax.__version__ and len(head["date"]) == 10
    kern = [r for r in rest if r["event"] == "kernel"]
    groups = [r for r in rest if r["event"] == "group"]
    assert rest == kern + groups and len(kern) == head["kernels"] > 100
    # every key of a measured record is in the predicted one
    measured = table_records([{"name": "k", "count": 1, "total_us": 1.0, "share": 1.0,
                               "group": "other", "hlo_op": "k", "scope": None}], steps=1)
    assert set(measured[0]) <= set(kern[0]) and set(measured[-1]) <= set(groups[0])
    assert {g["group"] for g in groups} == {"attention", "moe_gmm", "dispatch_permute",
                                           "router", "optimizer", "other"}
    assert sum(r["total_us"] for r in kern) == pytest.approx(head["predicted_step_us"])
    assert sum(g["total_us"] for g in groups) == pytest.approx(head["predicted_step_us"])
    for r in kern:
        bw = PROFILES["h100"].hbm_bw * PROFILES["h100"].hbm_efficiency
        assert r["bytes"] == r["bytes_read"] + r["bytes_written"]
        assert r["total_us"] >= r["bytes"] / bw * 1e6 * (1 - 1e-9)   # never under the roofline


def test_the_grouped_matmul_and_attention_have_predicted_time_and_the_step_is_printed(planned):
    _, text, recs = planned
    groups = {r["group"]: r for r in recs if r["event"] == "group"}
    for g in ("moe_gmm", "attention"):
        assert groups[g]["total_us"] > 0 and groups[g]["flops"] > 0, g
    # the routed experts' three matmuls (gate, up, down), forward only, 2 x 4096 tokens each
    # sent to top_k experts, in every MoE layer: a floor for the group's FLOPs
    m = PRESETS["deepseek3-1gpu"]()
    floor = (3 * 2 * (2 * 4096) * m.moe.top_k * m.d_model * m.moe.d_ff
             * (m.num_layers - m.first_k_dense))
    assert groups["moe_gmm"]["flops"] >= floor
    head = recs[0]
    assert f"  predicted step: {head['predicted_step_us'] / 1e3:.1f} ms" in text
    assert "Kernels of the step compiled for h100" in text and "By group:" in text


def test_the_optimizer_group_moves_adamws_bytes(planned):
    _, _, recs = planned
    counts = counted_params(PRESETS["deepseek3-1gpu"]())
    params = counts["total"] + counts["mtp"] - counts["router_bias"]
    reference = params * (3 * 4 + 4 * 4)   # read w, g, m, v; write w, m, v: float32 each
    got = next(r for r in recs if r["event"] == "group" and r["group"] == "optimizer")
    assert math.isclose(got["bytes"], reference, rel_tol=0.2), (got["bytes"], reference)
