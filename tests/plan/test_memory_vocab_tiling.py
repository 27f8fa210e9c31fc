"""The planner under `num_vocab_tiling` N (train/cross_entropy.py): the logits term is 1/N of the
untiled one (a tile's logits at a time) and the head's GEMM time counts one more forward of the
head (3 passes -> 4), the rest of the plan unchanged."""
import dataclasses

import pytest

from dropless.machine import get_profile
from dropless.plan import memory
from dropless.plan.model import head_times
from tests._support.model_configs import model_config
from tests.plan.plans import plan_of

MODEL = model_config(vocab_size=32000, d_model=64, num_layers=2, num_heads=2, num_kv_heads=1,
                     head_dim=32, d_ff=128, attention="mha", scan_layers=True,
                     dtype="bfloat16", weight_dtype="float32")


def _plan(tiles: int):
    plan = plan_of(MODEL, seq=64)
    return dataclasses.replace(plan, run=plan.run.replace(num_vocab_tiling=tiles))


@pytest.mark.parametrize("tiles", [2, 8])
def test_tiles_divide_the_logits_and_add_a_head_forward(tiles):
    hw = get_profile("h100")
    one, tiled = memory.memory_per_device(_plan(1), hw), memory.memory_per_device(_plan(tiles), hw)
    assert one["logits"] == 64 * 32000 * (2 + 4)          # bf16 + float32, 64 tokens
    assert tiled["logits"] == one["logits"] / tiles
    assert tiled["total"] == one["total"] - one["logits"] * (1 - 1 / tiles)
    h1, ht = head_times(_plan(1), hw), head_times(_plan(tiles), hw)
    assert ht["gemm"] == pytest.approx(h1["gemm"] * 4 / 3, rel=1e-12)
    assert ht["elementwise"] == h1["elementwise"]
