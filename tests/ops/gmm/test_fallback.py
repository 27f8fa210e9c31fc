"""`auto` survives a kernel that fails after lowering: at compile or at its first run.

Legend: M rows, K contraction dim, N output dim, G groups.

Stand-in kernels (ops/gmm/standins.py) put in front of `auto`'s CPU chain fail the way a GPU
kernel can: a custom call XLA cannot compile, a kernel that raises when it runs. The function
compiled through `compile_auto` must then run on the next backend (`native`), give the same
numbers as the reference, say so in one log line and in its Outcome; a failure with nothing to
fall back to raises.
"""
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.ops import grouped_matmul
from dropless.ops.gmm import fallback, registry, standins
from dropless.ops.gmm.baselines import reference_gmm

M, K, N, G = 12, 8, 6, 3
SIZES = jnp.array([5, 0, 6], jnp.int32)


def _loss_and_grads(a, b, gs):
    return jax.value_and_grad(lambda a, b: grouped_matmul(a, b, gs).sum(), (0, 1))(a, b)


def _operands():
    ka, kb = jax.random.split(jax.random.key(0))
    return jax.random.normal(ka, (M, K)), jax.random.normal(kb, (G, K, N)), SIZES


@jax.jit
def _reference(a, b, gs):
    return jax.value_and_grad(lambda a, b: reference_gmm(a, b, gs, out_dtype=a.dtype).sum(),
                              (0, 1))(a, b)


@pytest.fixture
def cheap_floor(monkeypatch):
    """CPU's chain ends at `reference` (a masked loop over G=3 groups: a quick compile) instead
    of `native`, `tiled`, so each retrace costs little; one test keeps the real chain."""
    monkeypatch.setitem(registry.AUTO_CHAINS, "cpu", ("reference",))
    return "reference"


def _lines(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "dropless.ops.gmm"]


@pytest.mark.parametrize("stage", standins.STAGES)
@pytest.mark.parametrize("probe", [True, False], ids=["kernel-probe", "whole-function"])
def test_a_kernel_failing_after_lowering_falls_back(stage, probe, caplog, cheap_floor):
    args = _operands()
    with registry.stand_in("tokamax", standins.failing_gmm(stage), first_on="cpu"):
        assert registry.resolve_backend("auto") == "tokamax"
        with caplog.at_level(logging.WARNING, logger="dropless.ops.gmm"):
            compiled, out = fallback.compile_auto(_loss_and_grads, *args, what="loss",
                                                  probe=probe, run_once=True)
        got = compiled(*args)
    want = _reference(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    assert out.backend == cheap_floor and len(out.fallbacks) == 1
    fb = out.fallbacks[0]
    assert (fb["from"], fb["to"], fb["stage"]) == ("tokamax", cheap_floor, stage)
    # the kernel probe names the shape; a failure of the whole function refuses every shape
    assert (fb["shape"] is not None) == probe
    lines = _lines(caplog)
    assert len(lines) == 1 and f"tokamax failed to {stage} in the loss" in lines[0], lines
    assert lines[0].endswith(f"using {cheap_floor} there")
    rec = out.record()
    assert rec["gmm_backend_ran"] == cheap_floor and rec["gmm_fallbacks"][0]["from"] == "tokamax"


def test_the_real_cpu_chain_takes_over(caplog):
    args = _operands()
    with registry.stand_in("tokamax", standins.failing_gmm("compile"), first_on="cpu"):
        compiled, out = fallback.compile_auto(_loss_and_grads, *args, what="loss")
        got = compiled(*args)
    assert out.backend == "native" and out.fallbacks[0]["to"] == "native"
    np.testing.assert_allclose(got[0], _reference(*args)[0], rtol=1e-5)


def test_only_the_failing_shape_falls_back(cheap_floor):
    # [12, 8] x [3, 8, 6] fails to compile, [12, 6] x [3, 6, 8] works: each shape decides
    bad_rhs = (G, K, N)

    def picky(lhs, rhs, gs, *, out_dtype):
        stage = "compile" if rhs.shape == bad_rhs else None
        if stage:
            return standins.failing_gmm(stage)(lhs, rhs, gs, out_dtype=out_dtype)
        return reference_gmm(lhs, rhs, gs, out_dtype=out_dtype)

    def two(a, b, c, gs):
        return grouped_matmul(grouped_matmul(a, b, gs), c, gs).sum()

    a, b, gs = _operands()
    c = jnp.ones((G, N, K))
    with registry.stand_in("tokamax", picky, first_on="cpu"):
        compiled, out = fallback.compile_auto(two, a, b, c, gs, what="two layers")
    by_rhs = {r["shape"][2]: r["backend"] for r in out.ran}
    assert by_rhs == {bad_rhs: cheap_floor, (G, N, K): "tokamax"}
    assert [f["shape"][2] for f in out.fallbacks] == [bad_rhs]
    np.testing.assert_allclose(compiled(a, b, c, gs), jax.jit(two)(a, b, c, gs), rtol=1e-5)


def test_a_failure_with_nothing_to_fall_back_to_raises(cheap_floor):
    # the floor: a function that fails to compile there is not retried
    def broken(a, b, gs):
        return standins.failing_gmm("compile")(a, b, gs, out_dtype=a.dtype) + grouped_matmul(
            a, b, gs)
    with pytest.raises(Exception, match="No FFI handler|no handler|NOT_FOUND"):
        fallback.compile_auto(broken, *_operands(), what="broken")


def test_a_working_auto_choice_is_kept_and_named():
    compiled, out = fallback.compile_auto(_loss_and_grads, *_operands(), what="loss")
    assert out.backend == "native" and out.fallbacks == ()
    assert [r["asked"] for r in out.ran] == ["auto"]


def test_run_once_refuses_donated_arguments():
    with pytest.raises(ValueError, match="run_once with donated arguments"):
        fallback.compile_auto(_loss_and_grads, *_operands(), what="step",
                              jit_kwargs={"donate_argnums": 0}, run_once=True)


def test_stand_in_is_undone_and_refusals_are_scoped():
    assert registry.auto_chain("cpu") == ("native", "tiled")
    with registry.stand_in("standin_x", standins.failing_gmm("run"), first_on="cpu"):
        assert registry.auto_chain("cpu") == ("standin_x", "native", "tiled")
        with registry.auto_scope(refused=frozenset({("standin_x", None)})):
            assert registry.resolve_backend("auto", "cpu") == "native"
        assert registry.resolve_backend("auto", "cpu") == "standin_x"
    assert "standin_x" not in registry.grouped_matmul_backends()
    assert registry.auto_chain("cpu") == ("native", "tiled")
    # the floor is never refused
    with registry.auto_scope(refused=frozenset({("native", None), ("tiled", None)})):
        assert registry.resolve_backend("auto", "cpu") == "tiled"


def test_what_ran_takes_tokamax_s_own_decision_at_each_shape():
    # auto chose tokamax on CUDA at two shapes; tokamax declined one when traced (pallas_gpu ran)
    a, b = ("a",), ("b",)
    events = [{"asked": "auto", "platform": "cpu", "backend": "tiled", "shape": a},
              {"asked": "auto", "platform": "cuda", "backend": "tokamax", "shape": a},
              {"asked": "tokamax", "backend": "pallas_gpu", "shape": a, "reason": "declined"},
              {"asked": "auto", "platform": "cpu", "backend": "tiled", "shape": b},
              {"asked": "auto", "platform": "cuda", "backend": "tokamax", "shape": b},
              {"asked": "tokamax", "backend": "tokamax", "shape": b, "implementation": "mosaic"}]
    assert registry.what_ran(events, "cuda") == [
        {"asked": "auto", "backend": "pallas_gpu", "shape": a, "reason": "declined"},
        {"asked": "auto", "backend": "tokamax", "shape": b, "implementation": "mosaic"}]
    # lowered for CPU the tokamax branch is not what runs
    assert registry.what_ran(events, "cpu") == [
        {"asked": "auto", "backend": "tiled", "shape": a},
        {"asked": "auto", "backend": "tiled", "shape": b}]
