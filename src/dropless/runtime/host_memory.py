"""The host heap JAX's CPU buffers come from: what one step frees, the next step reuses.

XLA:CPU takes each execution's buffers from malloc. glibc serves a thread's allocation from
that thread's arena, and one larger than the arena's heap (64 MiB; above 32 MiB in the main
arena) from a fresh mmap, unmapped again when it is freed. So every step faults in and zeroes
each large buffer afresh. In the MoE layer's fwd+bwd at 2048 tokens, 64 experts top-8, D=512,
F=1024 that was about 610 MB a step: 156k page faults and 280 ms of system time where
transparent huge pages are off, 6-21k faults and 50-100 ms (with spikes of 200-500 ms) where
they are on (docs/grouped_matmul.md).

`REUSE_ENV` holds glibc's own tunables for one arena that serves every allocation below 1 GiB
from its heap and gives the heap's top back to the system only once 2 GiB of it are free. A
step's freed buffers are then the next step's, faulted in once; the process's resident memory
stays near its peak instead of falling between steps. glibc reads them when the process starts,
so that every thread, XLA's workers included, takes the one arena. (`mallopt` inside the process
reaches only threads that take an arena after the call.)

The price is memory. In that layer the heap kept growing for 20 steps, to 2.65 GB resident
against 1.34 GB at most under glibc's defaults, for a median step 4% faster (497 against 518
ms) and no page faults in most steps. So it is a choice, not the default: with
DROPLESS_HOST_MALLOC=reuse, `dropless train`, `bench` and `eval` start themselves again with
REUSE_ENV added (`restart_env`, before anything runs), unless the environment already sets one
of glibc's MALLOC_* tunables (the user's choice is kept) or the C library is not glibc. A Python
program gets the same by starting with REUSE_ENV in its environment.
"""
from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping

ENV = "DROPLESS_HOST_MALLOC"
MODES = ("system", "reuse")
# glibc's malloc tunables (mallopt(3): M_ARENA_MAX, M_MMAP_THRESHOLD, M_TRIM_THRESHOLD,
# M_TOP_PAD) as its environment spells them
REUSE_ENV = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": str(1 << 30),
             "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1), "MALLOC_TOP_PAD_": str(64 << 20)}
# the environment's other ways of setting them: a user who set one chose for themselves
GLIBC_ENV = (*REUSE_ENV, "MALLOC_ARENA_TEST", "GLIBC_TUNABLES")


def choice(environ: Mapping[str, str] | None = None) -> str:
    """DROPLESS_HOST_MALLOC: "system" (glibc's defaults; the default) or "reuse". Raises
    ValueError naming the variable for any other value."""
    env = os.environ if environ is None else environ
    value = env.get(ENV) or "system"
    if value not in MODES:
        raise ValueError(f"{ENV}={value!r}: use one of {', '.join(MODES)} (or leave it unset)")
    return value


def _glibc() -> bool:
    return sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


def mode(environ: Mapping[str, str] | None = None) -> str:
    """How this process's malloc runs, for benchmark and run records: "reuse" (started with
    REUSE_ENV) or "system" (glibc's defaults, or the user's own MALLOC_* tunables, in brackets)."""
    env = os.environ if environ is None else environ
    if not _glibc():
        return f"system (the C library is not glibc: {sys.platform})"
    if all(env.get(k) == v for k, v in REUSE_ENV.items()):
        return "reuse"
    kept = [k for k in GLIBC_ENV if k in env]
    if kept:
        return f"system (the environment sets {kept[0]}; kept)"
    return "system"


def restart_env(environ: Mapping[str, str] | None = None) -> dict[str, str] | None:
    """The whole environment to start this process again with, so that its malloc reuses freed
    memory; None where no restart is due (DROPLESS_HOST_MALLOC is not reuse, already so, glibc's
    tunables set by the user, not glibc). Raises ValueError for a bad DROPLESS_HOST_MALLOC."""
    env = dict(os.environ if environ is None else environ)
    if choice(env) == "system" or not _glibc() or any(k in env for k in GLIBC_ENV):
        return None
    return {**env, **REUSE_ENV}
