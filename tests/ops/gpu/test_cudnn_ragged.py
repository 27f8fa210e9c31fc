"""The cuDNN grouped GEMM is detected, never assumed: version parsing, the flag, the one-line
reasons, and the backend refusing where it would run XLA's zero-padded ragged_dot instead.

Legend: M rows (sorted by group), K contraction dim, N output dim, G groups.
"""
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.ops import grouped_matmul
from dropless.ops.gmm import registry
from dropless.ops.gpu import cudnn_ragged


def test_version_integer_by_hand():
    assert cudnn_ragged._from_int(92200) == (9, 22, 0)
    assert cudnn_ragged._from_int(91901) == (9, 19, 1)


def test_flag_is_read_as_a_whole_word():
    assert cudnn_ragged.flag_set(f"--xla_foo=1 {cudnn_ragged.FLAG}")
    assert not cudnn_ragged.flag_set("--xla_gpu_experimental_use_ragged_dot_fusion=false")
    assert not cudnn_ragged.flag_set("")


@pytest.mark.parametrize("version, flag, want", [
    (None, True, "no cuDNN library found"),
    ((9, 19, 0), True, "needs cuDNN >= 9.22 for XLA's grouped GEMM; this process loads 9.19.0"),
    ((9, 22, 0), False, "needs XLA_FLAGS to hold --xla_gpu_experimental_use_ragged_dot_fusion"),
    ((9, 22, 0), True, None),
    ((10, 0, 1), True, None),
])
def test_problem_lines(version, flag, want):
    got = cudnn_ragged.problem_for(version, flag)
    if want is None:
        assert got is None
    else:
        assert want in got and len(got.splitlines()) == 1


def test_info_reports_what_this_process_has():
    got = cudnn_ragged.info()
    assert set(got) == {"cudnn_version", "cudnn_ragged_dot"}
    assert got["cudnn_ragged_dot"] == (cudnn_ragged.problem() or "usable")


def test_unusable_backend_refuses_by_name_and_auto_skips_it(monkeypatch):
    monkeypatch.setattr(cudnn_ragged, "problem", lambda: "cudnn_ragged_dot: no cuDNN")
    monkeypatch.setitem(registry._REGISTRY, "cudnn_ragged_dot", registry.BackendSpec(
        "cudnn_ragged_dot", cudnn_ragged.cudnn_ragged_gmm, "test",
        problem=cudnn_ragged.problem))
    assert registry.unusable("cudnn_ragged_dot") == "cudnn_ragged_dot: no cuDNN"
    with pytest.raises(ValueError, match="cudnn_ragged_dot: no cuDNN"):
        grouped_matmul(jnp.ones((4, 2)), jnp.ones((2, 2, 3)), jnp.array([2, 2]),
                       backend="cudnn_ragged_dot")


def test_where_detected_it_is_ragged_dot(monkeypatch):
    monkeypatch.setattr(cudnn_ragged, "problem", lambda: None)
    monkeypatch.setattr(cudnn_ragged, "info", lambda: {"cudnn_version": "9.22.0"})
    lhs = jnp.arange(12.0).reshape(6, 2)
    rhs = jnp.arange(12.0).reshape(2, 2, 3)
    gs = jnp.array([2, 3])
    got = grouped_matmul(lhs, rhs, gs, backend="cudnn_ragged_dot")
    want = grouped_matmul(lhs, rhs, gs, backend="reference")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)
