"""Tests run on 8 host CPU devices so expert-parallel code can be tested without GPUs.

XLA:CPU's LLVM backend runs at -O0 here (`--xla_backend_optimization_level=0`): most of the
suite's time is compiling small programs, and the backend's optimisation is a third or more of
each compile. The HLO passes (fusion, layout, scheduling) are XLA's defaults, so the programs
are the ones users run, compiled to slower machine code whose rounding may differ in the last
bit. `DROPLESS_TEST_XLA_OPT=default` keeps XLA's own level; the GPU leg (.ci/jax_leg) and the
AVX2 leg (Makefile) run so, the AVX2 leg with the MoE layer's tests and the tests marked
`xla_default_opt` (bits pinned by a fixture that XLA's default level computed), which a run at
-O0 deselects, saying so at the end."""
import os

import pytest

OPT_FLAG = "--xla_backend_optimization_level=0"
if os.environ.get("DROPLESS_TEST_XLA_OPT", "0") == "0":
    TEST_XLA_FLAGS = f"--xla_force_host_platform_device_count=8 {OPT_FLAG}"
else:
    TEST_XLA_FLAGS = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("XLA_FLAGS", TEST_XLA_FLAGS)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
AT_O0 = OPT_FLAG in os.environ["XLA_FLAGS"].split()
_DESELECTED: list[str] = []


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "xla_default_opt: pins bits that XLA:CPU's default optimisation level "
        "computes; deselected at -O0 (tests/conftest.py), run by the AVX2 leg")


def pytest_collection_modifyitems(config, items):
    if not AT_O0:
        return
    dropped = [it for it in items if it.get_closest_marker("xla_default_opt")]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [it for it in items if not it.get_closest_marker("xla_default_opt")]
        _DESELECTED.extend(it.nodeid for it in dropped)


def pytest_sessionfinish(session):
    out = getattr(session.config, "workeroutput", None)    # an xdist worker: tell the controller
    if out is not None:
        out["xla_default_opt_deselected"] = list(_DESELECTED)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """xdist's controller: each worker collected (and deselected) on its own."""
    for nodeid in getattr(node, "workeroutput", {}).get("xla_default_opt_deselected", ()):
        if nodeid not in _DESELECTED:
            _DESELECTED.append(nodeid)


def pytest_terminal_summary(terminalreporter):
    if _DESELECTED:
        terminalreporter.write_line(
            f"{len(_DESELECTED)} tests marked xla_default_opt were deselected at XLA's -O0; "
            "DROPLESS_TEST_XLA_OPT=default runs them (the AVX2 leg does)")
