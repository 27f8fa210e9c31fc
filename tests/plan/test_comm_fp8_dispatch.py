"""plan.comm.ep_dispatch_wire: a forward dispatch with MXFP8 rows at the deepseek3-671b shape.

Legend: D model dim, K top-k. A row is D bf16 values (2D bytes) or D E4M3 codes + D/32 E8M0
scales; each row also carries K (id, weight) pairs of 8 bytes, which do not shrink.
"""
import pytest

from dropless.machine import get_profile
from dropless.plan import comm
from dropless.presets import get_preset
from tests.plan.plans import plan_of


@pytest.mark.parametrize("remat,dispatches,transfers", [("full", 2, 6), ("none", 1, 4)])
def test_only_the_forward_dispatch_shrinks_by_the_format(remat, dispatches, transfers):
    model = get_preset("deepseek3-671b")
    cfg = plan_of(model, fsdp=2, ep=64, remat=remat, devices_per_node=8)
    hw = get_profile("h200")
    w = comm.ep_dispatch_wire(cfg, hw)
    d, k = model.d_model, model.moe.top_k
    bf16_row, fp8_row = 2 * d + 8 * k, d + d // 32 + 8 * k    # bytes a row, with its entries
    assert w["dispatch_ratio"] == pytest.approx(fp8_row / bf16_row)
    assert 0.51 < w["dispatch_ratio"] < 0.52
    assert w["layer_bytes"] == pytest.approx(transfers * w["dispatch_bytes"])
    saved = dispatches * (w["dispatch_bytes"] - w["dispatch_bytes_mxfp8"])
    assert w["layer_bytes"] - w["layer_bytes_mxfp8"] == pytest.approx(saved)
