"""tokamax's shipped tuned configs: the file per device kind, its checks, and the context that
applies it around tokamax's forward and backward (a stand-in tokamax records whether it was
inside the context at each call).

Legend: M rows (sorted by group), K contraction dim, N output dim, G groups.
"""
import importlib.machinery
import json
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.ops import grouped_matmul
from dropless.ops.gmm import registry, winners
from dropless.ops.gmm.baselines import reference_gmm
from dropless.ops.gpu import tokamax_backend, tokamax_tuned

VERSION = "0.0.12" if tuple(map(int, jax.__version__.split(".")[:2])) < (0, 11) else "0.0.17"
H200 = "NVIDIA H200"
DUMP = json.dumps({"device_kind": H200, "data": [[{"op": "a"}, {}], [{"op": "b"}, {}]]})


def standin():
    """A tokamax whose AutotuningResult counts how deep its contexts are entered and whose
    ragged_dot records that depth at every call."""
    state = {"depth": 0, "calls": [], "loaded": []}

    class AutotuningResult:
        def __init__(self, dump):
            self.dump = dump

        @classmethod
        def loads(cls, text):
            state["loaded"].append(json.loads(text)["device_kind"])
            return cls(text)

        def __enter__(self):
            state["depth"] += 1
            return self

        def __exit__(self, *exc):
            state["depth"] -= 1

    def ragged_dot(lhs, rhs, gs, *, preferred_element_type, implementation):
        state["calls"].append(state["depth"])
        return reference_gmm(lhs, rhs, gs, out_dtype=preferred_element_type)

    mod = types.ModuleType("tokamax")
    mod.__spec__ = importlib.machinery.ModuleSpec("tokamax", None)
    mod.ragged_dot, mod.AutotuningResult = ragged_dot, AutotuningResult
    mod.ops = types.SimpleNamespace(ragged_dot=types.SimpleNamespace(
        IMPLEMENTATIONS={"mosaic_gpu": None}))
    return mod, state


@pytest.fixture
def tokamax(monkeypatch):
    mod, state = standin()
    monkeypatch.setitem(sys.modules, "tokamax", mod)
    monkeypatch.setattr(tokamax_backend, "tokamax_version", lambda: VERSION)
    caches = (tokamax_backend.tokamax_problem, tokamax_backend._works,
              tokamax_backend._warn_once, tokamax_tuned._tuned)
    for f in caches:
        f.cache_clear()
    yield state
    for f in caches:
        f.cache_clear()


def test_file_names():
    assert tokamax_tuned.file_name("NVIDIA H200") == "tokamax_nvidia_h200.json"
    assert tokamax_tuned.file_name("NVIDIA H100 80GB HBM3") == \
        "tokamax_nvidia_h100_80gb_hbm3.json"


@pytest.mark.parametrize("text, match", [
    ("{", "tokamax_x.json: not JSON"),
    ('{"device_kind": "NVIDIA H200"}', "an object with 'device_kind' and a 'data' list"),
    ('{"device_kind": "NVIDIA H100", "data": []}',
     "tuned for device_kind='NVIDIA H100', not 'NVIDIA H200'; write it to "
     "tokamax_nvidia_h100.json"),
])
def test_a_file_that_is_not_a_dump_for_its_kind_is_named(text, match):
    with pytest.raises(ValueError, match=match):
        tokamax_tuned.check_dump(text, H200, "tokamax_x.json")


def test_every_shipped_file_is_a_dump_for_its_kind():
    folder = tokamax_tuned.resources.files(tokamax_tuned.PACKAGE).joinpath(tokamax_tuned.FOLDER)
    for path in (folder.iterdir() if folder.is_dir() else ()):
        if path.name.endswith(".json"):
            kind = json.loads(path.read_text())["device_kind"]
            assert tokamax_tuned.file_name(kind) == path.name
            tokamax_tuned.check_dump(path.read_text(), kind, path.name)


def fwd_bwd(events):
    lhs = jnp.asarray(np.random.default_rng(0).normal(size=(24, 16)), jnp.bfloat16)
    rhs = jnp.asarray(np.random.default_rng(1).normal(size=(3, 16, 8)), jnp.bfloat16)
    gs = jnp.array([10, 0, 9], jnp.int32)
    dy = jnp.ones((24, 8), jnp.bfloat16)
    with registry.auto_scope(events=events):
        out, vjp = jax.vjp(lambda a, b: grouped_matmul(a, b, gs, backend="tokamax"), lhs, rhs)
        return (out, *vjp(dy)), (lhs, rhs, gs, dy)


def reference(lhs, rhs, gs, dy):
    out, vjp = jax.vjp(lambda a, b: reference_gmm(a, b, gs, out_dtype=jnp.bfloat16), lhs, rhs)
    return (out, *vjp(dy))


def test_shipped_configs_apply_around_forward_and_backward(tokamax, monkeypatch):
    monkeypatch.setattr(tokamax_tuned, "shipped_text", lambda kind: DUMP if kind == H200 else None)
    events = []
    with winners.device_scope(H200):
        got, args = fwd_bwd(events)
    assert tokamax["loaded"] == [H200]
    # the probe, the forward, and the backward's call: every one inside the context
    assert len(tokamax["calls"]) >= 3 and all(d == 1 for d in tokamax["calls"])
    assert tokamax["depth"] == 0
    mine = [e for e in events if e["asked"] == "tokamax"]
    assert mine[0]["configs"] == "tuned: tuned/tokamax_nvidia_h200.json (2 configs)"
    for g, w in zip(got, reference(*args)):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   rtol=1e-2, atol=1e-2)


def test_no_file_for_the_kind_is_the_heuristic_and_says_so(tokamax, monkeypatch):
    monkeypatch.setattr(tokamax_tuned, "shipped_text", lambda kind: None)
    events = []
    with winners.device_scope("NVIDIA H100 80GB HBM3"):
        fwd_bwd(events)
    assert tokamax["loaded"] == [] and all(d == 0 for d in tokamax["calls"])
    mine = [e for e in events if e["asked"] == "tokamax"]
    assert mine[0]["configs"] == ("heuristic: no tuned configs for NVIDIA H100 80GB HBM3 "
                                  "(tuned/tokamax_nvidia_h100_80gb_hbm3.json is not in the "
                                  "package)")


def test_no_gpu_kind_is_the_heuristic(tokamax):
    events = []
    fwd_bwd(events)    # a CPU process outside device_scope: no GPU kind
    mine = [e for e in events if e["asked"] == "tokamax"]
    assert mine[0]["configs"] == "heuristic: no GPU device kind in this process"


def test_a_bad_shipped_file_is_an_error_naming_it(tokamax, monkeypatch):
    monkeypatch.setattr(tokamax_tuned, "shipped_text",
                        lambda kind: json.dumps({"device_kind": "NVIDIA B200", "data": []}))
    with pytest.raises(ValueError, match="tokamax_nvidia_h200.json: tuned for device_kind="):
        tokamax_tuned.tuned(H200, sys.modules["tokamax"])
