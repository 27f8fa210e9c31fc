"""`dropless bench dispatch`: an expert-parallel size that does not divide the devices JAX has is
refused before anything is compiled, as one line with exit 2 at the command line."""
import os

import jax

from dropless.bench import dispatch
from dropless.cli import main


def test_ep_that_does_not_divide_the_devices_is_one_line(monkeypatch, capsys):
    # --host-devices takes effect only in a fresh process: here JAX has its devices already
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    n = jax.device_count()
    assert n % 3
    assert main(["bench", "dispatch", "--ep", "3", "--host-devices", "3"]) == 2
    err = capsys.readouterr().err
    assert err == (f"dropless: error: --ep=3 does not divide the {n} devices (on CPU, start a "
                   "fresh process with --host-devices or XLA_FLAGS)\n")
