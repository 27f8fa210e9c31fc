"""The memory pre-flight as XLA:GPU compiles the step: deepseek3-1gpu at its run settings
(`presets.RUN_SETTINGS`: sequence 4096, batch 4, remat=minimal), its layers unrolled as it
ships, fits an H100 and an H200 (the step compiled for compile-only devices from the jax CUDA
plugin, with abstract inputs; train/compile_only.py), with the GPU's grouped-matmul kernels and
the XLA attention. The same preset with its layers scanned (the planner's layout, accumulation,
the refusal of an oversized config): test_preflight_scanned_gpu_compile.py.

Each device is checked against its own memory: XLA schedules the step for the memory the target
declares (jax 0.11.2: 45.36 GiB on the H100, 45.38 on the H200). Two compiles of the whole
16-layer step, about 50 s each on an idle 2-core machine. The compiled bytes are checked against
an independent floor: the arguments are exactly the float32 parameters and two Adam moments
(`models.arithmetic.param_counts` x 12 bytes, plus the step counter and key), and the
temporaries hold at least the float32 gradients.
"""
from __future__ import annotations

import pytest

from dropless.config import TrainConfig
from dropless.models.arithmetic import param_counts
from dropless.presets import RUN_SETTINGS, get_preset
from dropless.runtime import hlo_kernels
from dropless.train import preflight
from tests._support import cuda_compile

cuda_compile.require_plugin()

GiB = 2 ** 30
TRITON, MOSAIC = "__gpu$xla.gpu.triton", "mosaic_gpu_v2"


def _cfg() -> TrainConfig:
    return TrainConfig(model=get_preset("deepseek3-1gpu"), preset="deepseek3-1gpu",
                       **RUN_SETTINGS["deepseek3-1gpu"])


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


def test_the_preset_ships_unrolled_under_the_planners_scanned_model(fits):
    """The planner's memory model (`dropless plan`'s, with the attention the compiled step runs:
    the XLA one, `naive`) describes the scanned layout, where the stacked activations and the
    stacked float32 gradients are alive together (within 10% of that compile:
    test_preflight_scanned_gpu_compile.py). Unrolled, as the preset ships, a layer's activations
    are freed as its backward pass writes its gradients, and nothing is copied into or out of
    stacks: the step holds well under the model (jax 0.11.2: 45.36 against 58.75 GiB; scanned
    54.00), so under the scanned step too."""
    assert get_preset("deepseek3-1gpu").scan_layers is False
    for fit in fits.values():
        assert fit["total"] < 0.85 * fit["model_total"], (fit["total"] / GiB,
                                                          fit["model_total"] / GiB)
