"""XLA flag recipes: appended to existing flags without overriding the user's."""
import pytest

from dropless.runtime.xla_flags import recipe_env


def test_gpu_recipe_appends_and_respects_user_flags():
    env = {"XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=false",
           "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}
    out = recipe_env("gpu", env)
    flags = out["XLA_FLAGS"].split()
    assert flags[0] == "--xla_gpu_enable_latency_hiding_scheduler=false"
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" not in flags
    assert "--xla_gpu_all_reduce_combine_threshold_bytes=1073741824" in flags
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in out       # the user's value stays


def test_none_recipe_changes_nothing_and_unknown_fails():
    assert recipe_env("none", {}) == {}
    with pytest.raises(ValueError, match="xla_recipe='tpu'"):
        recipe_env("tpu", {})
