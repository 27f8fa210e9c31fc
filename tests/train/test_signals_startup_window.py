"""A stop signal that arrives while the trainer makes its run directory (between making it and
installing the clean-up that removes it) still removes it: `StopRequest.open_undoable` holds a
start-up signal until the undo is in place. The signal is sent from inside `open_run_dir`, and
the directory is handed back only once the watcher thread has begun acting on it (an event, no
delay): without the hold the watcher exits first and the folder stays."""
import subprocess
import sys
import textwrap

from dropless.train.signals import EXIT_PREEMPTED

from tests._support.paths import SRC

SCRIPT = textwrap.dedent("""
    import os, signal, sys, threading
    from dropless import cli
    from dropless.train import loop, signals
    acting = threading.Event()
    exit_now = signals.StopRequest._startup_exit
    def spy(self, signum):
        acting.set()
        exit_now(self, signum)
    signals.StopRequest._startup_exit = spy
    made = loop.open_run_dir
    def open_then_signal(cfg):
        run = made(cfg)
        os.kill(os.getpid(), signal.{sig})
        assert acting.wait(120), "the watcher never saw the signal"
        return run
    loop.open_run_dir = open_then_signal
    sys.exit(cli.main(["train", "run_dir=runs", "run_name=r", "steps=1",
                       "time_kernels=false"]))
""")


def _run(tmp_path, sig: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT.format(sig=sig)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin",
                               "JAX_PLATFORMS": "cpu"})


def test_a_signal_while_the_run_directory_is_made_removes_it(tmp_path):
    for sig in ("SIGINT", "SIGTERM"):
        r = _run(tmp_path, sig)
        assert r.returncode == EXIT_PREEMPTED, r.stderr
        assert f"{sig} during start-up" in r.stderr and "was removed" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
        assert not (tmp_path / "runs" / "r").exists()
