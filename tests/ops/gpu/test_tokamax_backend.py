"""`tokamax` cannot crash `auto`: every way it fails falls back to `pallas_gpu`, with one log line.

Legend: M rows, K contraction dim, N output dim, G groups.

A stand-in `tokamax` module (sys.modules) reproduces each failure seen with real wheels on this
host: 0.0.12 beside jax 0.11 (`pl.dot` is gone: AttributeError when traced), 0.0.17 without
jax_triton ("Unknown implementation: triton"), a kernel that traces but fails to lower for
CUDA, and an import that fails (0.0.17 without xprof). Each is lowered for CUDA (abstract H200)
through `auto`, and the module must hold our three kernels; a stand-in that works is used.
"""
import importlib.machinery
import logging
import sys
import types

import jax
import jax.extend
import jax.numpy as jnp
import pytest
from jax.interpreters import mlir

from dropless.ops import grouped_matmul
from dropless.ops.gmm import registry
from dropless.ops.gpu import tokamax_backend, triton_check
from dropless.ops.gmm.baselines import reference_gmm

G, M, K, N = 4, 40, 16, 24
SIZES = jnp.array([10, 0, 17, 5], jnp.int32)
OURS = ("dropless_gmm", "dropless_gmm_dlhs", "dropless_gmm_drhs")
# a version the running jax supports, so the failure comes from the stand-in's behaviour
VERSION = "0.0.12" if tuple(map(int, jax.__version__.split(".")[:2])) < (0, 11) else "0.0.17"


def _standin(ragged_dot, implementations=("xla", "mosaic_gpu", "triton")):
    mod = types.ModuleType("tokamax")
    mod.__spec__ = importlib.machinery.ModuleSpec("tokamax", None)
    mod.ragged_dot = ragged_dot
    mod.ops = types.SimpleNamespace(ragged_dot=types.SimpleNamespace(
        IMPLEMENTATIONS=dict.fromkeys(implementations)))
    return mod


@pytest.fixture
def install(monkeypatch):
    def put(module, version=VERSION):
        monkeypatch.setitem(sys.modules, "tokamax", module)
        monkeypatch.setattr(tokamax_backend, "tokamax_version", lambda: version)
        for f in (tokamax_backend.tokamax_problem, tokamax_backend._works,
                  tokamax_backend._warn_once):
            f.cache_clear()
    yield put
    for f in (tokamax_backend.tokamax_problem, tokamax_backend._works, tokamax_backend._warn_once):
        f.cache_clear()


def _auto_kernels(caplog):
    def f(lhs, rhs, gs, dy):
        out, vjp = jax.vjp(lambda a, b: grouped_matmul(a, b, gs), lhs, rhs)
        return out, vjp(dy)
    args = (jax.ShapeDtypeStruct((M, K), jnp.bfloat16), jax.ShapeDtypeStruct((G, K, N),
                                                                              jnp.bfloat16),
            SIZES, jax.ShapeDtypeStruct((M, N), jnp.bfloat16))
    with caplog.at_level(logging.WARNING, logger="dropless.ops.gmm"):
        kernels = triton_check.triton_kernels(triton_check.cuda_lowered(f, *args))
    lines = [r.getMessage() for r in caplog.records if r.name == "dropless.ops.gmm"]
    return sorted(k.name for k in kernels), lines


def _raises(exc):
    def ragged_dot(*a, **kw):
        raise exc
    return ragged_dot


@pytest.mark.parametrize("exc,why", [
    (AttributeError("module 'jax.experimental.pallas' has no attribute 'dot'"),
     "AttributeError: module 'jax.experimental.pallas' has no attribute 'dot'"),
    (ValueError("Unknown implementation: triton"), "ValueError: Unknown implementation"),
    (NotImplementedError("no NVIDIA device"), "NotImplementedError: no NVIDIA device"),
])
def test_a_trace_failure_falls_back_with_one_line(install, caplog, exc, why):
    install(_standin(_raises(exc)))
    assert registry.resolve_backend("auto", "cuda") == "tokamax"
    names, lines = _auto_kernels(caplog)
    assert names == sorted(OURS)
    assert len(lines) == 1, lines
    assert why in lines[0] and lines[0].endswith("using pallas_gpu")
    assert "mosaic: " in lines[0] and "triton: " in lines[0]


_bad = jax.extend.core.Primitive("standin_kernel_fails_to_lower")
_bad.def_abstract_eval(lambda x, rhs: jax.core.ShapedArray((x.shape[0], rhs.shape[2]), x.dtype))


def _no_cuda_lowering(ctx, *args):
    raise RuntimeError("stand-in kernel: Mosaic GPU lowering failed")


mlir.register_lowering(_bad, _no_cuda_lowering, platform="cuda")


@jax.custom_vjp
def _lowers_badly(lhs, rhs):
    return _bad.bind(lhs, rhs)


_lowers_badly.defvjp(lambda lhs, rhs: (_bad.bind(lhs, rhs), (lhs, rhs)),
                     lambda res, dy: (jnp.zeros_like(res[0]), jnp.zeros_like(res[1])))


def test_a_lowering_failure_falls_back(install, caplog):
    install(_standin(lambda lhs, rhs, gs, **kw: _lowers_badly(lhs, rhs)))
    names, lines = _auto_kernels(caplog)
    assert names == sorted(OURS)
    assert len(lines) == 1 and "Mosaic GPU lowering failed" in lines[0], lines


def test_only_the_implementations_this_tokamax_has_are_tried(install, caplog):
    install(_standin(_raises(NotImplementedError("declined")), implementations=("xla",
                                                                                 "mosaic_gpu")))
    _, lines = _auto_kernels(caplog)
    assert "mosaic: NotImplementedError: declined" in lines[0] and "triton" not in lines[0]


def test_an_import_failure_makes_auto_pick_pallas_gpu(monkeypatch, install, caplog):
    install(_standin(_raises(AssertionError("unused"))))
    monkeypatch.setitem(sys.modules, "tokamax", None)   # `import tokamax` raises ImportError
    monkeypatch.setattr(registry.importlib.util, "find_spec", lambda name: object())
    assert not registry.tokamax_available()
    assert "pip install 'dropless[gpu]'" in tokamax_backend.tokamax_problem()
    assert registry.resolve_backend("auto", "cuda") == "pallas_gpu"


def test_a_working_tokamax_is_used(install, caplog):
    calls = []

    def ragged_dot(lhs, rhs, gs, *, preferred_element_type, implementation):
        calls.append(implementation)
        return reference_gmm(lhs, rhs, gs, out_dtype=preferred_element_type)
    install(_standin(ragged_dot))
    names, lines = _auto_kernels(caplog)
    assert names == [] and lines == []
    assert ("mosaic",) in calls


@pytest.mark.parametrize("tok,jx,ok", [("0.0.12", "0.10.2", True), ("0.0.12", "0.11.2", False),
                                       ("0.0.17", "0.11.2", True), ("0.0.17", "0.12.0.1", True),
                                       ("0.0.17", "0.10.2", False), ("0.0.11", "0.10.2", False),
                                       ("0.0.18", "0.12.0", False)])
def test_version_pairs(tok, jx, ok):
    problem = tokamax_backend.version_problem(tok, jx)
    assert (problem is None) == ok, problem
    if tok == "0.0.12" and not ok:
        assert "pallas.dot" in problem and "0.0.17" in problem


def test_a_wrong_pair_falls_back_without_calling_tokamax(install, caplog):
    install(_standin(_raises(AssertionError("must not be called"))),
            version="0.0.17" if VERSION == "0.0.12" else "0.0.12")
    assert registry.resolve_backend("auto", "cuda") == "pallas_gpu"
    lhs, rhs = jnp.ones((M, K)), jnp.ones((G, K, N))
    with caplog.at_level(logging.WARNING, logger="dropless.ops.gmm"):
        out = grouped_matmul(lhs, rhs, SIZES, backend="tokamax")
    assert out.shape == (M, N)
    assert "supported: tokamax 0.0.12 with jax 0.10.x" in caplog.records[-1].getMessage()
