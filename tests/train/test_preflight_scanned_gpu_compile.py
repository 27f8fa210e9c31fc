"""The memory pre-flight as XLA:GPU compiles the step of deepseek3-1gpu at its run settings
(`presets.RUN_SETTINGS`: sequence 4096, batch 4, remat=minimal) with its layers scanned
(`model.scan_layers=true`; the preset ships unrolled: test_preflight_gpu_compile.py), for
compile-only devices from the jax CUDA plugin: the planner's memory model of the scanned layout
(stacked activations and gradients alive together) is within 10% of it; accumulating 4
micro-batches costs about one gradient buffer more. The scanned layout compiles one MoE layer
body (about 30 s a compile on an idle 2-core machine; two here); accumulation is about the
batch, not the layout. Oversized configs are refused in tests/cli/test_plan_gpu_compile.py (one
device, the H200) and tests/train/test_preflight_mesh_gpu_compile.py (a mesh of H100s).
"""
from __future__ import annotations

import pytest

from dropless.config import TrainConfig
from dropless.models.arithmetic import param_counts
from dropless.presets import RUN_SETTINGS, get_preset
from dropless.train import preflight
from tests._support import cuda_compile

cuda_compile.require_plugin()

GiB = 2 ** 30


def _cfg(**over) -> TrainConfig:
    settings = {**RUN_SETTINGS["deepseek3-1gpu"], **over}
    model = get_preset("deepseek3-1gpu").replace(scan_layers=True)
    return TrainConfig(model=model, preset="deepseek3-1gpu", **settings)


@pytest.fixture(scope="module")
def scanned() -> dict:
    """The pre-flight's verdict on the scanned preset, for an H100."""
    return preflight.check(_cfg(), target="h100")


def test_the_planners_memory_model_is_near_the_compiled_step(scanned):
    """The planner's memory model of the same step (`dropless plan`'s, with the attention the
    compiled step runs: the XLA one, `naive`; the scanned layout's rule, plan/memory.py)
    against XLA's analysis of the executable, within 10% (jax 0.11.2: 58.75 against 54.00
    GiB). remat=minimal keeps no S x S tensor of the XLA
    attention (its products have batch dims), nor runs the grouped matmuls twice."""
    assert scanned["method"] == "compiled" and scanned["total"] < scanned["limit"]
    assert scanned["model_total"] == pytest.approx(scanned["total"], rel=0.10), (
        scanned["model_total"] / GiB, scanned["total"] / GiB)


def test_accumulation_adds_one_gradient_buffer_not_activations(scanned):
    """gradient_accumulation_steps=4 at the preset's batch (a step of 4 x 4 sequences), layers
    scanned: the compiled H100 step holds one micro-batch's activations at a time. Beyond the
    one-pass step it costs at most the float32 accumulator (4 bytes a parameter) and one more
    float32 copy of the weights in the loop's state (jax 0.11.2: 60.28 against 54.00 GiB, the
    accumulator's 6.26 GiB and 0.02 more), nothing like three more micro-batches' activations."""
    fit = preflight.check(_cfg(gradient_accumulation_steps=4), target="h100")
    n = param_counts(get_preset("deepseek3-1gpu"))["total"]
    one = scanned
    assert fit["method"] == "compiled"
    # the state, and the batch: 4 x b rows of 4097 int32 instead of b
    b = RUN_SETTINGS["deepseek3-1gpu"]["per_device_batch_size"]
    assert fit["compiled"]["arguments"] - one["compiled"]["arguments"] == 3 * b * 4097 * 4
    extra = fit["total"] - one["total"]
    assert 0 < extra <= 8 * n, (extra / GiB, 4 * n / GiB)
    assert fit["total"] < fit["limit"]

