"""The EP rows a token sends (`plan.comm.expected_devices_per_token`) for any expert count the
config allows (up to a million): exact binomials while they are small, a float product past
them, and a routing simulation whose draws stay bounded (it drew 8,192 x E scores: 64 GiB at a
million experts, and `dropless plan` died of it)."""
import math
import time

import pytest

from dropless.config.names import MAX_EXPERTS
from dropless.config_file import build_config
from dropless.plan import comm


@pytest.mark.parametrize("e,p,k", [(256, 32, 8), (256, 1, 8), (64, 32, 60), (1024, 512, 300),
                                   (1024, 300, 512), (10, 5, 8), (4096, 2048, 1000)])
def test_none_on_device_is_the_binomial_ratio(e, p, k):
    exact = math.comb(e - p, k) / math.comb(e, k)
    assert comm._none_on_device(e, p, k) == pytest.approx(exact, rel=1e-9, abs=1e-300)
    if min(p, k) <= comm.EXACT_TERMS:    # one correctly rounded division: the same float
        assert comm._none_on_device(e, p, k) == exact


def test_the_float_product_answers_at_once_where_binomials_take_minutes():
    t0 = time.perf_counter()
    # C(2^19, 2^19) / C(2^20, 2^19) = 1 / C(2^20, 2^19): far below the smallest float
    assert comm._none_on_device(2 ** 20, 2 ** 19, 2 ** 19) == 0.0
    assert time.perf_counter() - t0 < 5
    y = comm._none_on_device(2 ** 20, 2 ** 10, 2 ** 10)
    ref = math.exp(2 * math.lgamma(2 ** 20 - 2 ** 10 + 1) - math.lgamma(2 ** 20 + 1)
                   - math.lgamma(2 ** 20 - 2 ** 11 + 1))
    assert y == pytest.approx(ref, rel=1e-6)


def test_the_simulation_draws_a_bounded_number_of_scores():
    assert comm.simulated_tokens(256) == comm.simulated_tokens(2048) == 8192   # the presets'
    assert comm.simulated_tokens(MAX_EXPERTS) * MAX_EXPERTS <= comm.SIMULATED_SCORES
    assert comm.simulated_tokens(MAX_EXPERTS) >= 1


def test_a_million_grouped_experts_plan_in_bounded_memory_and_time():
    cfg = build_config([("preset", "deepseek3-671b"), ("model.moe.num_experts", MAX_EXPERTS),
                        ("model.moe.n_groups", 1024), ("model.moe.topk_groups", 512)])
    t0 = time.perf_counter()
    rows = comm.expected_devices_per_token(cfg.model, 8)
    assert time.perf_counter() - t0 < 30
    assert 1.0 <= rows <= 8.0
