"""Two processes on 127.0.0.1 (gloo CPU collectives, 4 devices each) run the expert-parallel
layer forward and backward; the result must equal the single-process layer without a mesh."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from tests._support.paths import SRC, SUPPORT  # noqa: E402

TIMEOUT_S = 240
from tests._support import ep_worker as worker  # noqa: E402


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(dispatcher: str, out: str) -> list[subprocess.Popen]:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    coordinator = f"127.0.0.1:{_free_port()}"
    return [subprocess.Popen([sys.executable, str(SUPPORT / "ep_worker.py"),
                              coordinator, "2", str(pid), out, dispatcher],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for pid in range(2)]


def _wait(procs: list[subprocess.Popen]) -> list[tuple[int, str]]:
    """Wait for all, killing every one if any runs past the timeout (never hang CI)."""
    results = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=TIMEOUT_S)
            results.append((p.returncode, out))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        logs = [p.communicate()[0] for p in procs]
        pytest.fail(f"2-process EP run timed out after {TIMEOUT_S}s; logs:\n" + "\n---\n".join(
            (log or "")[-3000:] for log in logs))
    return results


@pytest.mark.parametrize("dispatcher", ["a2a"])
def test_two_processes_match_single_process(tmp_path, dispatcher):
    out = str(tmp_path / "result.npz")
    procs = _launch(dispatcher, out)
    # the single-process reference, computed while the two processes start and compile
    cfg, params, x = worker.case(dispatcher)
    step = jax.jit(jax.value_and_grad(lambda p, x: worker.loss_fn(p, x, cfg, None),
                                      argnums=(0, 1), has_aux=True))
    (loss, (y, _)), (g_params, g_x) = jax.block_until_ready(step(params, x))
    results = _wait(procs)
    if any(rc != 0 and "address already in use" in log.lower() for rc, log in results):
        results = _wait(_launch(dispatcher, out))  # the free port was taken meanwhile: once more
    for pid, (rc, log) in enumerate(results):
        assert rc == 0, f"process {pid} exited {rc}:\n{log[-4000:]}"
    got = np.load(out)
    assert int(got["rounds"]) > 1  # the skewed routing really needed extra rounds
    np.testing.assert_allclose(got["loss"], loss, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["y"], y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["g_x"], g_x, rtol=1e-5, atol=1e-5)
    for group, leaves in g_params.items():
        for name, ref in leaves.items():
            np.testing.assert_allclose(got[f"g_{group}.{name}"], ref, rtol=1e-5, atol=1e-5,
                                       err_msg=f"{group}/{name}")
