"""runtime.host_memory: in a fresh process started with REUSE_ENV, a jitted step whose buffers
are larger than glibc's arena heaps stops page-faulting once its heap has grown, while under
glibc's defaults every call faults its buffers in afresh (the kernel's own counter, getrusage,
is the judge); `dropless` started from the shell restarts itself with REUSE_ENV exactly when
asked, and a bad DROPLESS_HOST_MALLOC is one ValueError naming it."""
import json
import os
import platform
import subprocess
import sys
import textwrap

import pytest

from dropless.runtime import host_memory

GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"

# A step that writes a fresh 96 MiB (four 24 MiB arrays: each over the main arena's 32 MiB mmap
# limit, the whole over a thread arena's 64 MiB heap) and reduces it; page faults per call.
PROBE = textwrap.dedent("""
    import json, resource
    import jax, jax.numpy as jnp
    from dropless.runtime import host_memory
    f = jax.jit(lambda x: jnp.sum(jnp.stack([jnp.sin(x + i) for i in range(4)]), axis=(1, 2)))
    x = jnp.ones((1536, 4096), jnp.float32)
    faults = []
    for _ in range(20):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        jax.block_until_ready(f(x))
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(json.dumps({"mode": host_memory.mode(), "faults": faults[15:]}))
""")


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in host_memory.GLIBC_ENV and k != host_memory.ENV}
    env["XLA_FLAGS"] = ""   # one host device, whatever the suite's environment asks
    return env


def _probe(env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_reuse_env_stops_the_per_step_page_faults():
    system = _probe(_clean_env())
    reuse = _probe({**_clean_env(), **host_memory.REUSE_ENV})
    assert reuse["mode"] == "reuse" and system["mode"] == "system"
    # 96 MiB of fresh pages: at least 48 faults a call even with 2 MiB huge pages
    assert min(system["faults"]) >= 48, system
    # the heap may still grow now and then (a freed block split by small allocations no
    # longer fits), but most steps fault nothing
    assert sum(n <= 8 for n in reuse["faults"]) >= 4, reuse


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_restart_env_is_due_once_and_keeps_the_users_choices():
    base = {"HOME": "/h", "PATH": "/bin"}
    assert host_memory.restart_env(base) is None and host_memory.mode(base) == "system"
    assert host_memory.restart_env({**base, host_memory.ENV: "system"}) is None
    asked = {**base, host_memory.ENV: "reuse"}
    env = host_memory.restart_env(asked)
    assert env == {**asked, **host_memory.REUSE_ENV}
    assert host_memory.restart_env(env) is None                 # no second restart
    assert host_memory.mode(env) == "reuse"
    own = {**asked, "MALLOC_ARENA_MAX": "4"}
    assert host_memory.restart_env(own) is None
    assert host_memory.mode(own) == "system (the environment sets MALLOC_ARENA_MAX; kept)"
    tunables = {**asked, "GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}
    assert host_memory.restart_env(tunables) is None


def test_bad_environment_value_names_the_variable():
    with pytest.raises(ValueError, match=r"DROPLESS_HOST_MALLOC='fast': use one of system, "
                                         r"reuse"):
        host_memory.restart_env({host_memory.ENV: "fast"})


class _Exec(Exception):
    pass


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_the_shell_command_restarts_itself_and_a_python_call_does_not(monkeypatch):
    import importlib
    cli = importlib.import_module("dropless.cli.main")
    calls = []

    def execve(path, argv, env):
        calls.append((path, argv, env))
        raise _Exec

    for name in host_memory.GLIBC_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(host_memory.ENV, "reuse")
    monkeypatch.setattr(os, "execve", execve)
    orig = [sys.executable, "/venv/bin/dropless", "bench", "moe", "--quick"]
    monkeypatch.setattr(sys, "orig_argv", orig)
    monkeypatch.setattr(sys, "argv", ["dropless", "bench", "moe", "--quick"])
    monkeypatch.setenv("DROPLESS_TRACEBACK", "1")   # let the sentinel through the error edge
    with pytest.raises(_Exec):
        cli.main()
    (path, argv, env), = calls
    assert path == sys.executable and argv == orig
    assert {k: env[k] for k in host_memory.REUSE_ENV} == host_memory.REUSE_ENV
    assert env["PATH"] == os.environ["PATH"]
    # from Python (arguments given) there is no restart; a command outside the loop ones, or
    # the default (glibc's malloc as it is), neither
    calls.clear()
    cli.restart_for_host_memory(from_shell=False)
    monkeypatch.setattr(sys, "argv", ["dropless", "config", "--help"])
    with pytest.raises(SystemExit):
        cli.main()
    monkeypatch.delenv(host_memory.ENV)
    cli.restart_for_host_memory(from_shell=True)
    assert calls == []
