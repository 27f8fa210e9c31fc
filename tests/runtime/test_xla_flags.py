"""XLA flags and environment at start-up: recipes appended to existing flags without overriding
the user's, flags this XLA does not know refused before JAX would abort, the process environment
winning over the config, and a note for each setting that changes nothing on this platform."""
import os
import subprocess
import sys

import pytest

from dropless.config_file import build_config
from dropless.runtime import xla_flags as xf
from dropless.runtime.xla_flags import recipe_env
from tests._support.paths import EXAMPLES, SRC

GB300 = str(EXAMPLES / "deepseek3_671b_gb300.yml")


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


def test_unknown_xla_flag_is_refused_before_jax_would_abort():
    """XLA aborts the process on an unknown flag; the config refuses it first."""
    cfg = build_config([("xla_gpu_no_such_flag", 1), ("xla_gpu_enable_command_buffer", "")])
    with pytest.raises(ValueError, match="'--xla_gpu_no_such_flag=1' is not known to this XLA"):
        xf.apply_startup(cfg)


def test_environment_and_flags_yield_to_the_process_environment():
    cfg = build_config([("xla_gpu_enable_command_buffer", ""), ("xla_recipe", "gpu"),
                        ("XLA_PYTHON_CLIENT_MEM_FRACTION", 0.88),
                        ("CUDA_DEVICE_MAX_CONNECTIONS", 16)])
    env = {"XLA_FLAGS": "--xla_gpu_enable_command_buffer=FUSION", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    changes, lines = xf.startup_env(cfg, env)
    flags = changes["XLA_FLAGS"].split()
    assert flags[0] == "--xla_gpu_enable_command_buffer=FUSION"        # the user's, kept
    assert "--xla_gpu_enable_command_buffer=" not in flags
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in flags     # the recipe's
    assert changes["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.88"          # the config's, not 0.92
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in changes
    assert any("CUDA_DEVICE_MAX_CONNECTIONS=16: the environment already has" in ln
               for ln in lines)


def test_platform_notes_say_what_changes_nothing():
    cfg = build_config(yaml_path=GB300)
    cpu = xf.platform_notes(cfg, "cpu")
    assert any(n.startswith("xla_gpu_all_reduce_combine_threshold_bytes: an XLA:GPU flag")
               for n in cpu)
    assert any(n.startswith("CUDA_DEVICE_MAX_CONNECTIONS: read by the GPU") for n in cpu)
    assert xf.platform_notes(cfg, "gpu") == []


def test_flag_names_read_from_jaxlib_agree_with_xla():
    """The names read from the shared objects hold every flag we use (the recipes, the GB300
    example, the device count conftest sets), and a name they lack is one XLA itself aborts on
    (its own parser, in a subprocess), while one they hold starts cleanly."""
    known = xf.known_flag_names()
    used = [f for flags, _ in xf.RECIPES.values() for f in flags]
    used += list(xf.parse_flags(build_config(yaml_path=GB300).xla_flags).values())
    assert len(known) > 200
    assert not xf.unknown_flags(tuple(used)), xf.unknown_flags(tuple(used))
    assert xf.unknown_flags(("--xla_cpu_no_such_flag=1", "--xla_dump_to=/tmp",
                             "--noxla_cpu_enable_fast_math")) == (
        "--xla_cpu_no_such_flag=1", "--noxla_cpu_enable_fast_math")

    def starts(flags: str) -> subprocess.CompletedProcess:
        env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu", PYTHONPATH=SRC)
        return subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                              capture_output=True, text=True, timeout=300)
    bad = starts("--xla_cpu_no_such_flag=1")
    assert bad.returncode != 0 and "xla_cpu_no_such_flag" in bad.stderr
    assert starts("--xla_force_host_platform_device_count=2 --xla_cpu_enable_fast_math=false"
                  ).returncode == 0


def test_environment_flags_and_platforms_refused_by_name():
    with pytest.raises(ValueError, match="XLA_FLAGS in the environment holds '--xla_nope=1'"):
        xf.check_environment_flags("--xla_force_host_platform_device_count=8 --xla_nope=1")
    xf.check_environment_flags("--xla_force_host_platform_device_count=8")
    xf.check_environment_flags("")
    from dropless.runtime import environment
    assert environment.installed_platforms()[0] == "cpu"
    environment.check_platforms("cpu")
    environment.check_platforms("")
    with pytest.raises(ValueError, match="JAX_PLATFORMS='cpu,tpuu'.*'tpuu'.*available: cpu"):
        environment.check_platforms("cpu,tpuu")
