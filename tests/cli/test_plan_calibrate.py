"""`dropless plan --calibrate` on a CPU gets the host devices it asks for (`--calibrate-devices`,
default 8) without the user setting XLA_FLAGS; a count the user set in XLA_FLAGS wins. The
calibration itself is replaced by one that reports the devices it found (it is timed in
tests/bench/test_calibrate.py); the process is fresh, so JAX starts inside the command."""
import json
import os
import subprocess
import sys

import pytest

from tests._support.paths import SRC

STUB = """
import json, sys
import dropless.bench.calibrate as c
def run_calibration(devices, workload):
    import jax
    c.check_devices(devices)
    return {"text": json.dumps({"devices": jax.device_count(), "asked": devices})}
c.run_calibration = run_calibration
from dropless.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def _plan(args: list[str], xla_flags: str | None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
               JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    if xla_flags is not None:
        env["XLA_FLAGS"] = xla_flags
    return subprocess.run([sys.executable, "-c", STUB, "plan", "--calibrate", *args], env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args,want", [([], 8), (["--calibrate-devices", "3"], 3)])
def test_the_host_devices_asked_for_exist_without_xla_flags(args, want):
    r = _plan(args, None)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"devices": want, "asked": want}


def test_a_count_the_user_set_wins_and_too_few_is_one_line():
    r = _plan(["--calibrate-devices", "2"], "--xla_force_host_platform_device_count=4")
    assert r.returncode == 0 and json.loads(r.stdout.strip().splitlines()[-1])["devices"] == 4
    r = _plan(["--calibrate-devices", "6"], "--xla_force_host_platform_device_count=4")
    assert r.returncode == 2 and "--calibrate-devices" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
