"""Two processes on 127.0.0.1 (gloo, 2 CPU devices each) build only their own rows of the
global batch; the gathered batches equal the single-process ones bitwise, also for a loader
started mid-run (a resume on another process count), and the trainer's loss over them (a small
MLA + MoE model) equals the one-process loss to float32 rounding."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from tests._support import loader_worker as worker
from tests._support.paths import SRC, SUPPORT
from tests._support.prepared_data import random_docs, write_prepared

TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(data_dir, out) -> list[tuple[int, str]]:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    coordinator = f"127.0.0.1:{_free_port()}"
    procs = [subprocess.Popen([sys.executable, str(SUPPORT / "loader_worker.py"), coordinator,
                               "2", str(pid), str(data_dir), str(out)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for pid in range(2)]
    results = []
    try:
        for p in procs:
            log, _ = p.communicate(timeout=TIMEOUT_S)
            results.append((p.returncode, log))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"2-process loader run timed out after {TIMEOUT_S}s")
    return results


def test_two_processes_build_their_rows_of_the_single_process_batch(tmp_path):
    rng = np.random.default_rng(0)
    data = tmp_path / "ds"
    write_prepared(data, {"train": [random_docs(rng, 80), random_docs(rng, 60)],
                          "eval": [random_docs(rng, 10)]})
    out = tmp_path / "got.npz"
    results = _run(data, out)
    if any(rc != 0 and "address already in use" in log.lower() for rc, log in results):
        results = _run(data, out)   # the free port was taken meanwhile: once more
    for pid, (rc, log) in enumerate(results):
        assert rc == 0, f"process {pid} exited {rc}:\n{log[-4000:]}"
    got = np.load(out)
    assert got["rows"].tolist() == [[[0, 2], [2, 4]], [[4, 6], [6, 8]]]   # each built its half
    ref, rows = worker.batches(str(data), None)             # one process, every row
    assert rows == ((0, worker.B),)
    for k, b in enumerate(ref):
        for name in b._fields:
            np.testing.assert_array_equal(got[f"{name}_{k}"], getattr(b, name), err_msg=name)
    # the loss on the same layout (4 devices, rows split in 4) in this one process: equal to
    # float32 rounding (gloo's cross-process all-reduce adds the 4 partial sums in its own order)
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    sh = NamedSharding(Mesh(np.array(jax.devices()[:4]), ("data",)), PartitionSpec("data"))
    worker._model()
    want = [float(jax.jit(worker.loss)(jax.device_put(b, sh))) for b in ref]
    assert np.all(np.isfinite(want)) and len(set(want)) == len(want), want
    np.testing.assert_allclose(got["losses"], np.array(want), rtol=1e-6, atol=0)
