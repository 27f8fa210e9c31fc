"""The planner's chunked-EP pipeline (plan/overlap.py): hand-worked phases, k = 1 unchanged, and
its effect at the reference's 128-GPU layout."""
from __future__ import annotations

import pytest

from dropless.machine import get_profile
from dropless.plan import comm
from dropless.plan.model import layer_times, predict
from dropless.plan.overlap import ep_pipeline, transfer_time
from dropless.plan.reference import REFERENCE

HW = get_profile("gb300")


def _chunked(k: int, **plan):
    return REFERENCE.replace_moe(ep_comm_overlap_chunks=k).replace(**plan)


def test_one_chunk_is_the_serial_layer():
    """k = 1: every transfer exposed, and the kernel time is n transfers of all T tokens."""
    cfg = _chunked(1)
    one = comm.a2a_time(comm.ep_bytes_per_transfer(cfg, HW), cfg, HW)
    p = ep_pipeline(cfg, HW, gmm_s=1.0)
    n = comm.ep_transfers_per_layer(cfg)
    assert p["kernel_s"] == pytest.approx(n * one) == pytest.approx(p["exposed_s"])
    assert layer_times(cfg, HW, True)["ep"] == pytest.approx(n * one)


@pytest.mark.parametrize("k", [2, 4, 8])
def test_pipeline_phases_hand_worked(k):
    """remat=offload: 3 phases (forward, recomputed forward, backward) of 2 transfers each,
    the gmm split 1:1:2. Exposed per phase = m + (k-1) max(0, m - c)."""
    cfg = _chunked(k)
    m = 2 * transfer_time(cfg, HW, k)
    for gmm in (0.0, 3 * m * k, 1e-9):
        want = sum(m + (k - 1) * max(0.0, m - gmm * share / k) for share in (.25, .25, .5))
        p = ep_pipeline(cfg, HW, gmm)
        assert p["exposed_s"] == pytest.approx(want)
        assert p["kernel_s"] == pytest.approx(3 * k * m)
    # matmuls long enough hide all but one chunk's transfers per phase (fill and drain)
    assert ep_pipeline(cfg, HW, 100.0)["exposed_s"] == pytest.approx(3 * m)
    # no matmuls hide nothing
    assert ep_pipeline(cfg, HW, 0.0)["exposed_s"] == pytest.approx(3 * k * m)


def test_chunks_shorten_the_reference_step_and_pay_latency_and_padding():
    base = predict(_chunked(1), HW)
    steps = {k: predict(_chunked(k), HW)["time"] for k in (2, 4)}
    for k, t in steps.items():
        assert t["step_s"] < base["time"]["step_s"], k
        assert t["exposed_s"]["ep"] < base["time"]["exposed_s"]["ep"]
        # more collectives (one latency each) and more tile padding per chunk
        assert t["kernel_s"]["ep"] > base["time"]["kernel_s"]["ep"]
        assert t["kernel_s"]["gmm"] > base["time"]["kernel_s"]["gmm"]
    assert steps[4]["step_s"] < steps[2]["step_s"]
    # overlap="full" already hides EP: chunks only add their padding and latency there
    full = predict(_chunked(1, overlap="full"), HW)["time"]["step_s"]
    assert predict(_chunked(4, overlap="full"), HW)["time"]["step_s"] >= full
