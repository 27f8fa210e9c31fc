"""Grouped matmul: every backend against a plain NumPy loop, forward and gradients."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

from dropless.ops import grouped_matmul, grouped_matmul_backends, padding_stats
from dropless.ops.gmm.registry import tokamax_available
from dropless.ops.gmm.tiled import plan_tiles
from tests._support.gmm_reference import np_gmm, np_gmm_grads, operands

# tokamax runs where it is installed (the `gpu` extra); on CPU through its "xla" implementation,
# which checks our delegation and its VJP, not its GPU kernels (tests/ops/gpu/test_pallas_gpu.py)
TOKAMAX = pytest.param("tokamax", marks=pytest.mark.skipif(
    not tokamax_available(), reason="tokamax not installed (optional: pip install 'dropless[gpu]')"))
# native is a jax.ffi kernel registered for the CPU: on a GPU (the device check runs this file
# with JAX_PLATFORMS=cuda) it is refused when lowered (tests/ops/native/test_cpu_only.py)
NATIVE = pytest.param("native", marks=pytest.mark.skipif(
    jax.default_backend() != "cpu", reason="native runs on CPU only; the default backend is "
                                           f"{jax.default_backend()}"))
# pallas_gpu runs in Pallas interpret mode on CPU: the same kernels, executed by XLA:CPU
JITTABLE = ["reference", "ragged_dot", "tiled", NATIVE, "padded", "pallas_gpu", TOKAMAX]
ALL = JITTABLE + ["loop"]


def run(backend, lhs, rhs, gs, **opts):
    if backend == "tiled":
        opts.setdefault("tile_sizes", (8, 4, 2))  # small tiles: exercise full and masked classes
    if backend == "pallas_gpu":
        opts.setdefault("block_m", 16)  # tiles shared by several groups, and the zero tail
    if backend == "tokamax" and jax.default_backend() == "cpu":
        opts.setdefault("implementation", "xla")
    return grouped_matmul(lhs, rhs, gs, backend=backend, **opts)


# One shape (M=30, G=5) for every routing: a jitted backend compiles its forward+backward once
# and runs all six (group sizes are a traced argument, as in a training step). M=30 is not a
# multiple of any tile (8, 4, 2) or of pallas_gpu's block_m=16, so windows clamp at the end.
M = 30
CASES = {
    "uniform": [6, 6, 6, 6, 6],
    "empty_groups": [0, 12, 0, 18, 0],      # empty first, middle and last groups
    "one_group_takes_all": [0, 0, 30, 0, 0],
    "sum_below_m": [3, 0, 5, 2, 4],         # rows 14..29 must come out zero
    "odd_sizes": [1, 7, 13, 9, 0],          # a one-row group; a masked tile at the end
    "all_empty": [0, 0, 0, 0, 0],
}


def fwd_and_vjp(gmm):
    """(out, dlhs, drhs) of `gmm(lhs, rhs, sizes)` for the output gradient dy."""
    def f(lhs, rhs, sizes, dy):
        out, pullback = jax.vjp(lambda a, b: gmm(a, b, sizes), lhs, rhs)
        return (out, *pullback(dy))
    return f


@functools.lru_cache(maxsize=None)
def compiled_fwd_bwd(backend):
    """fwd_and_vjp of a backend, jitted once for any routing (eager for `loop`)."""
    f = fwd_and_vjp(lambda a, b, gs: run(backend, a, b, gs))
    return f if backend == "loop" else jax.jit(f)


def test_hand_worked_case():
    # rows 0,1 -> group 0; group 1 empty; rows 2,3,4 -> group 2; row 5 past the sum -> zeros
    lhs = jnp.arange(12, dtype=jnp.float32).reshape(6, 2)
    rhs = jnp.stack([jnp.eye(2), 5 * jnp.eye(2), jnp.array([[0.0, 1.0], [1.0, 0.0]])])
    expected = np.array([[0, 1], [2, 3], [5, 4], [7, 6], [9, 8], [0, 0]], np.float32)
    for backend in ["reference", "ragged_dot", "tiled", "padded", "pallas_gpu", "loop"] + (
            ["tokamax"] if tokamax_available() else []):
        out = run(backend, lhs, rhs, jnp.array([2, 0, 3]))
        np.testing.assert_array_equal(np.asarray(out), expected, err_msg=backend)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_and_grads_f32(backend, case):
    sizes = CASES[case]
    lhs, rhs, gs, dy = operands(M, 5, 3, sizes)
    out, dl, dr = compiled_fwd_bwd(backend)(lhs, rhs, gs, dy)
    np.testing.assert_allclose(out, np_gmm(lhs, rhs, sizes), rtol=1e-5, atol=1e-5)
    edl, edr = np_gmm_grads(lhs, rhs, sizes, dy)
    np.testing.assert_allclose(dl, edl, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(dr, edr, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("backend", JITTABLE)
def test_bf16_matches_f32_reference(backend):
    sizes = CASES["odd_sizes"]
    lhs, rhs, gs, dy = operands(M, 16, 8, sizes, jnp.bfloat16)
    out, dl, dr = compiled_fwd_bwd(backend)(lhs, rhs, gs, dy)
    assert out.dtype == dl.dtype == dr.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), np_gmm(lhs, rhs, sizes),
                               rtol=2e-2, atol=5e-2)
    edl, edr = np_gmm_grads(lhs, rhs, sizes, dy)
    np.testing.assert_allclose(np.asarray(dl, np.float32), edl, rtol=2e-2, atol=1e-1)
    np.testing.assert_allclose(np.asarray(dr, np.float32), edr, rtol=2e-2, atol=1e-1)


def test_preferred_element_type_sets_output_dtype():
    # the output dtype is fixed when the function is traced: no need to compile and run it
    lhs, rhs, gs, _ = operands(12, 4, 3, [5, 7], jnp.bfloat16)
    for backend in ["reference", "ragged_dot", "tiled", "padded", "pallas_gpu"]:
        out = jax.eval_shape(lambda a, b: run(backend, a, b, gs,
                                              preferred_element_type=jnp.float32), lhs, rhs)
        assert out.dtype == jnp.float32, backend


@pytest.mark.parametrize("backend", ["tiled", NATIVE, "ragged_dot", "padded", "reference",
                                     "pallas_gpu"])
def test_jit_once_for_any_routing(backend):
    traces = []

    def f(a, b, g):
        traces.append(1)
        return run(backend, a, b, g)

    jf = jax.jit(f)
    lhs, rhs, _, _ = operands(30, 4, 3, [10, 10, 10])
    for sizes in ([10, 10, 10], [0, 30, 0], [1, 2, 3]):
        np.testing.assert_allclose(jf(lhs, rhs, jnp.asarray(sizes)), np_gmm(lhs, rhs, sizes),
                                   rtol=1e-5, atol=1e-5)
    assert len(traces) == 1


def test_tiled_default_tiles_large_groups():
    # default tile sizes (1024, 896, ...): one group spans full and masked tiles, one is tiny
    sizes = [1300, 3, 0, 290]
    lhs, rhs, gs, dy = operands(1600, 8, 4, sizes)
    gmm = lambda a, b, g: grouped_matmul(a, b, g, backend="tiled")
    out, dl, dr = jax.jit(fwd_and_vjp(gmm))(lhs, rhs, gs, dy)
    np.testing.assert_allclose(out, np_gmm(lhs, rhs, sizes), rtol=1e-5, atol=1e-4)
    edl, edr = np_gmm_grads(lhs, rhs, sizes, dy)
    np.testing.assert_allclose(dl, edl, rtol=1e-5, atol=1e-3)
    np.testing.assert_allclose(dr, edr, rtol=1e-5, atol=1e-3)


def test_tile_plan_hand_worked():
    # the docstring example: sizes [5, 0, 3], m=8, tiles (4, 2)
    classes = plan_tiles(jnp.array([5, 0, 3]), 8, (4, 2))
    full, masked4, masked2 = classes
    assert (full.size, full.masked, int(full.count)) == (4, False, 1)
    assert int(full.group_P[0]) == 0 and int(full.row_P[0]) == 0
    assert int(masked4.count) == 1 and int(masked4.group_P[0]) == 2
    assert int(masked4.row_P[0]) == 5
    assert int(masked2.count) == 1 and int(masked2.group_P[0]) == 0
    assert int(masked2.row_P[0]) == 4


@functools.partial(jax.jit, static_argnums=4)
def tiled_fwd_bwd(lhs, rhs, gs, dy, tile_sizes):
    return fwd_and_vjp(lambda a, b, g: grouped_matmul(a, b, g, backend="tiled",
                                                      tile_sizes=tile_sizes))(lhs, rhs, gs, dy)


# each example compiles (the shape and the tiles change), so few random ones, plus the edges
@settings(max_examples=8, deadline=None)
@given(st.lists(st.integers(0, 20), min_size=1, max_size=6), st.integers(0, 5),
       st.sampled_from([(8, 4, 2), (5, 3), (16,), (7, 6, 1)]))
@example([0], 0, (8, 4, 2))                # one empty group, M=1
@example([1, 1, 1, 1, 1, 1], 0, (5, 3))    # one-row groups, no rows past the sum
@example([20, 0, 17, 3], 5, (7, 6, 1))     # full and masked tiles, rows past the sum
@example([0, 0, 0], 5, (16,))              # all empty; the tile is larger than M
def test_tiled_property_any_sizes(sizes, extra_rows, tile_sizes):
    m = max(sum(sizes) + extra_rows, 1)
    lhs, rhs, gs, dy = operands(m, 3, 2, sizes, seed=len(sizes))
    out, dl, dr = tiled_fwd_bwd(lhs, rhs, gs, dy, tile_sizes)
    np.testing.assert_allclose(out, np_gmm(lhs, rhs, sizes), rtol=1e-5, atol=1e-5)
    edl, edr = np_gmm_grads(lhs, rhs, sizes, dy)
    np.testing.assert_allclose(dl, edl, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(dr, edr, rtol=1e-5, atol=1e-4)


def test_padded_drops_rows_past_capacity_and_reports_padding():
    sizes = [6, 2, 0]
    lhs, rhs, gs, _ = operands(8, 3, 2, sizes)
    out = grouped_matmul(lhs, rhs, gs, backend="padded", capacity=4)
    expected = np_gmm(lhs, rhs, sizes)
    expected[4:6] = 0  # group 0's rows 4 and 5 exceed capacity 4: dropped
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    assert padding_stats(sizes, 4) == {"capacity": 4, "useful_rows": 8, "executed_rows": 12,
                                       "padding_rows": 6, "dropped_rows": 2}


def test_backend_list_and_unknown_backend():
    assert {"reference", "ragged_dot", "tiled", "padded", "pallas_gpu", "tokamax", "loop"} <= set(
        grouped_matmul_backends())
    assert grouped_matmul_backends()[0] == "auto"
    lhs, rhs, gs, _ = operands(4, 2, 2, [2, 2])
    with pytest.raises(ValueError, match=r"backend='nope'.*tiled"):
        grouped_matmul(lhs, rhs, gs, backend="nope")


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="native runs on CPU only")
def test_old_name_openblas_is_native_with_one_deprecation_warning(monkeypatch):
    import warnings
    from dropless.ops import resolve_backend
    from dropless.ops.gmm import aliases, registry
    monkeypatch.setattr(aliases, "_WARNED", set())   # as in a fresh process
    sizes = [4, 0, 6]
    lhs, rhs, gs, _ = operands(10, 4, 3, sizes)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = jax.jit(lambda a, b: grouped_matmul(a, b, gs, backend="openblas"))(lhs, rhs)
        registry.check_backend_name("openblas")
        assert resolve_backend("openblas") == "native"
        assert registry.unusable("openblas") is None
        with registry.auto_scope(refused=frozenset({("openblas", None)})):
            assert resolve_backend("auto", "cpu") == "tiled"   # a refusal of the old name
    said = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(said) == 1 and "'openblas' is now called 'native'" in str(said[0].message)
    new = jax.jit(lambda a, b: grouped_matmul(a, b, gs, backend="native"))(lhs, rhs)
    np.testing.assert_array_equal(old, new)
    np.testing.assert_allclose(new, np_gmm(lhs, rhs, sizes), rtol=1e-5, atol=1e-5)
    # listed under its new name only; the old one is not a name of its own
    assert "native" in grouped_matmul_backends() and "openblas" not in grouped_matmul_backends()
    assert registry.backend_spec("openblas") is registry.backend_spec("native")


def test_bad_inputs_name_the_argument():
    lhs, rhs, gs, _ = operands(6, 4, 2, [3, 3])
    with pytest.raises(ValueError, match="K=3 does not match rhs K=4"):
        grouped_matmul(lhs[:, :3], rhs, gs)
    with pytest.raises(ValueError, match="group_sizes must have shape"):
        grouped_matmul(lhs, rhs, jnp.array([1, 2, 3]))
    with pytest.raises(ValueError, match=r"group_sizes must be >= 0; got \[-1, 3\]"):
        grouped_matmul(lhs, rhs, jnp.array([-1, 3]))
    with pytest.raises(ValueError, match="exceeds lhs rows M=6"):
        grouped_matmul(lhs, rhs, jnp.array([4, 3]))
    with pytest.raises(ValueError, match="group_sizes must be integers"):
        grouped_matmul(lhs, rhs, jnp.array([3.0, 3.0]))
    with pytest.raises(ValueError, match="lhs must be 2-D"):
        grouped_matmul(lhs[None], rhs, gs)
    with pytest.raises(ValueError, match=r"takes options \['tile_sizes'\]; got unknown \['capacity'\]"):
        grouped_matmul(lhs, rhs, gs, backend="tiled", capacity=3)
    with pytest.raises(ValueError, match="tile_sizes"):
        grouped_matmul(lhs, rhs, gs, backend="tiled", tile_sizes=(0,))


def test_loop_backend_refuses_jit_with_a_clear_message():
    lhs, rhs, gs, _ = operands(6, 4, 2, [3, 3])
    with pytest.raises(ValueError, match="'loop'.*cannot run under jax.jit"):
        jax.jit(lambda g: grouped_matmul(lhs, rhs, g, backend="loop"))(gs)


def test_auto_per_platform_never_ragged_dot_on_cuda():
    from dropless.ops import resolve_backend
    assert resolve_backend("auto", "cpu") == "native"   # tiled where it cannot build
    gpu_choice = "tokamax" if tokamax_available() else "pallas_gpu"
    assert resolve_backend("auto", "cuda") == gpu_choice
    assert resolve_backend("auto", "tpu") == "ragged_dot"
    assert resolve_backend("ragged_dot", "cuda") == "ragged_dot"  # by name only
