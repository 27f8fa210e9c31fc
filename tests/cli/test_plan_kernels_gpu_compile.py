"""`dropless plan --compile-for h100 --kernels --out FILE` on the deepseek3-1gpu preset, end to
end (the GPU leg: the jax CUDA plugin compiles the step for a compile-only H100): the predicted
per-kernel table (runtime.hlo_kernels) is printed and written as JSON lines in the measured
table's schema (train/profile.py), the grouped matmul and attention have predicted time, the
printed step time is the rows' sum, and the optimizer group moves the bytes AdamW must
(read weights, gradients and both moments, write weights and moments, float32 each).
"""
from __future__ import annotations

import contextlib
import io
import json
import math

import pytest

from dropless.cli import main
from dropless.machine import PROFILES
from dropless.presets import PRESETS
from dropless.train.profile import table_records
from tests._support import cuda_compile
from tests._support.param_count import param_counts

cuda_compile.require_plugin()

ARGV = ["plan", "--preset", "deepseek3-1gpu", "--hardware", "h100", "--gpus", "1",
        "--compile-for", "h100", "--kernels"]


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> tuple[int, str, list[dict]]:
    """One `dropless plan ... --kernels --out X`: its status, its text, its JSON lines."""
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
    counts = param_counts(PRESETS["deepseek3-1gpu"]())
    params = counts["total"] + counts["mtp"] - counts["router_bias"]
    reference = params * (3 * 4 + 4 * 4)   # read w, g, m, v; write w, m, v: float32 each
    got = next(r for r in recs if r["event"] == "group" and r["group"] == "optimizer")
    assert math.isclose(got["bytes"], reference, rel_tol=0.2), (got["bytes"], reference)
