"""SIGINT / SIGTERM inside `exit_on_signals`: one line and exit 130 / 75 at once, while XLA
computations are in flight (where a KeyboardInterrupt's unwinding and interpreter shutdown
segfaulted), and also while the main thread is inside one long C++ call."""
import os
import signal
import subprocess
import sys

import pytest

from tests._support.paths import SRC

BUSY = r"""
import sys
import jax, jax.numpy as jnp
from dropless.runtime.interrupt import exit_on_signals
step = jax.jit(lambda x: jnp.tanh(x @ x.T) @ x)
x = jnp.ones((256, 256))
with exit_on_signals("the test loop"):
    step(x).block_until_ready()
    print("ready", flush=True)
    while True:                     # dispatch ahead: computations always in flight
        for _ in range(8):
            x = step(x)
        if sys.argv[1] == "blocked":
            import time; time.sleep(3600)      # the main thread inside one C call
        x.block_until_ready()
"""


@pytest.mark.parametrize("sig,code,where", [(signal.SIGINT, 130, "computing"),
                                            (signal.SIGTERM, 75, "blocked")])
def test_a_signal_ends_the_block_at_once_with_one_line(sig, code, where):
    env = dict(os.environ, PYTHONPATH=SRC, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    p = subprocess.Popen([sys.executable, "-c", BUSY, where], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        p.send_signal(sig)
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
    name = signal.Signals(sig).name
    assert p.returncode == code, err
    assert err == f"dropless: {name}: the test loop stopped, nothing written\n"


def test_outside_the_main_thread_nothing_is_installed():
    import threading
    from dropless.runtime.interrupt import exit_on_signals
    before = signal.getsignal(signal.SIGINT)
    seen = []

    def worker():
        with exit_on_signals("x"):
            seen.append(signal.getsignal(signal.SIGINT))
    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == [before] and signal.getsignal(signal.SIGINT) == before
