"""Aligned expert segments (`MoEConfig.align_expert_rows`): the layout against a numpy loop,
the layer against the per-token oracle (tests/moe/test_layer.py) and against itself unaligned,
forward and gradients, with empty experts, one expert taking every row and every expert a
non-multiple of the block; under an expert-parallel dispatcher; the grouped matmul's
`group_alignment` checks and what an aligned backend is passed."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless import MoEConfig, moe
from dropless.moe import permute as perm
from dropless.ops.gmm import registry
from tests.moe.test_layer import make, np_route, plain_moe

TOL = dict(rtol=1e-4, atol=1e-5)      # against the float32 oracle (another summation order)
SAME = dict(rtol=1e-6, atol=1e-7)     # aligned vs unaligned: the same products, rows apart


def np_layout(sizes, n, a):
    """Loop form: where each sorted row goes, and which sorted row each padded row holds."""
    e = len(sizes)
    p = -(-(n + e * (a - 1)) // a) * a
    src = [-1] * p
    dest = [-1] * n
    start, pstart = 0, 0
    for s in sizes:
        for r in range(s):
            src[pstart + r] = start + r
            dest[start + r] = pstart + r
        start += s
        pstart += -(-s // a) * a
    return np.array(src), np.array(dest)


def test_docstring_example():
    lay = perm.align_segments(jnp.array([3, 0, 5]), 8, 4)
    assert lay.group_sizes_E.tolist() == [4, 0, 8]
    assert lay.dest_N.tolist() == [0, 1, 2, 4, 5, 6, 7, 8]
    assert perm.aligned_rows(8, 3, 4) == 20 == lay.src_P.shape[0]


@pytest.mark.parametrize("a", [1, 2, 4, 7, 16])
@pytest.mark.parametrize("seed", range(6))
def test_layout_against_loop(a, seed):
    rng = np.random.default_rng(seed)
    e = int(rng.integers(1, 9))
    sizes = rng.integers(0, 12, e) * (rng.random(e) < 0.7)   # some experts empty
    n = int(sizes.sum()) + int(rng.integers(0, 5))            # rows past the sum (a buffer)
    x = jnp.asarray(rng.standard_normal((n, 3)), jnp.float32)
    lay, x_P, back = _layout_round_trip(jnp.asarray(sizes), x, n, a)
    src, dest = np_layout(sizes.tolist(), n, a)
    np.testing.assert_array_equal(np.where(lay.valid_P, lay.src_P, -1), src)
    np.testing.assert_array_equal(np.where(lay.valid_N, lay.dest_N, -1), dest)
    assert (np.asarray(lay.group_sizes_E) % a == 0).all()
    np.testing.assert_array_equal(x_P[src < 0], 0)
    np.testing.assert_array_equal(back[: sizes.sum()], x[: sizes.sum()])
    np.testing.assert_array_equal(back[sizes.sum():], 0)


@functools.partial(jax.jit, static_argnums=(2, 3))
def _layout_round_trip(sizes, x, n, a):
    """align_segments, to_aligned and from_aligned as one program: every case has its own shapes,
    so op by op each case compiled every primitive anew (the numbers are the same either way)."""
    lay = perm.align_segments(sizes, n, a)
    x_P = perm.to_aligned(x, lay)
    return lay, x_P, perm.from_aligned(x_P, lay)


@functools.lru_cache(maxsize=None)
def _layer_fns(cfg):
    """The layer's forward (y, aux) and its gradient (d params, d x of <y, dy>), jitted once per
    config: the routing kinds differ only in the router's weights (traced), so the three kinds
    of one (alignment, backend) share one compiled forward and gradient, and the unaligned
    reference is compiled once per backend."""
    fwd = jax.jit(lambda p, x: moe.apply(p, x, cfg))
    grad = jax.jit(jax.grad(lambda p, x, dy: jnp.vdot(moe.apply(p, x, cfg)[0], dy), (0, 1)))
    return fwd, grad


@functools.partial(jax.jit, static_argnums=4)
def _oracle_grads(p, x, ids, dy, cfg):
    return jax.grad(lambda p, x: jnp.vdot(plain_moe(p, x, cfg, ids), dy), (0, 1))(p, x)


def _routed(kind, params):
    """Router weights that route as `kind` says: empty experts, all rows on one pair, or every
    expert a non-multiple of the block (the default routing, checked)."""
    if kind == "empty":          # only experts 1, 3, 6 reachable
        # float32 spelled out: a weakly typed bias would be another jit signature (a recompile)
        bias = jnp.full((8,), -1e3, jnp.float32)
        params["router"]["bias_E"] = bias.at[jnp.array([1, 3, 6])].set(0.0)
    elif kind == "one_expert":   # expert 5 takes every token's first choice, expert 2 second
        params["router"]["w_DE"] = jnp.zeros_like(params["router"]["w_DE"])
        params["router"]["bias_E"] = jnp.zeros(8).at[5].set(1.0).at[2].set(0.5)
    return params


@pytest.mark.parametrize("backend", ["tiled", "auto", "ragged_dot"])
@pytest.mark.parametrize("kind", ["empty", "one_expert", "non_multiple"])
@pytest.mark.parametrize("a", [4, 16])
def test_layer_matches_oracle_and_unaligned(kind, a, backend):
    cfg0, params, x = make("mixtral", t=27, backend=backend)
    params = _routed(kind, params)
    cfg = dataclasses.replace(cfg0, align_expert_rows=a)
    ids, _ = np_route(x, params, cfg)
    sizes = np.bincount(ids.ravel(), minlength=8)
    if kind == "empty":
        assert (sizes == 0).sum() >= 5
    elif kind == "one_expert":
        assert sorted(sizes.tolist())[-2:] == [27, 27]
    else:
        assert (sizes % a != 0).all(), sizes
    (fwd, grad), (fwd0, grad0) = _layer_fns(cfg), _layer_fns(cfg0)
    y, aux = fwd(params, x)
    np.testing.assert_array_equal(aux["tokens_per_expert"], sizes)   # the real sizes
    np.testing.assert_allclose(y, plain_moe(params, x, cfg, jnp.asarray(ids)), **TOL)
    np.testing.assert_allclose(y, fwd0(params, x)[0], **SAME)
    dy = jax.random.normal(jax.random.key(5), y.shape)
    got = grad(params, x, dy)
    # plain_moe reads only the scoring fields of the config, never the backend or the alignment:
    # one oracle gradient program (the routing `ids` an argument) serves every case
    oracle_cfg = dataclasses.replace(cfg0, gmm_backend="reference")
    for ref, tol in ((_oracle_grads(params, x, jnp.asarray(ids), dy, oracle_cfg), TOL),
                     (grad0(params, x, dy), SAME)):
        for (path, g), (_, r) in zip(jax.tree.leaves_with_path(got),
                                     jax.tree.leaves_with_path(ref)):
            if "bias_E" in jax.tree_util.keystr(path):
                continue   # the bias only selects
            np.testing.assert_allclose(g, r, err_msg=jax.tree_util.keystr(path), **tol)


def test_padding_rows_get_no_gradient_and_are_zero():
    """The rows between segments enter the grouped matmul as zeros and nothing flows back
    from them: the cotangent of the aligned rows is zero there."""
    lay = perm.align_segments(jnp.array([3, 0, 5]), 9, 4)
    x = jnp.arange(27.0).reshape(9, 3)
    x_P, vjp = jax.vjp(lambda x: perm.to_aligned(x, lay), x)
    assert np.asarray(x_P)[~np.asarray(lay.valid_P)].tolist() == [[0.0] * 3] * 12
    y, vjp_back = jax.vjp(lambda y: perm.from_aligned(y, lay), x_P)
    (d_P,) = vjp_back(jnp.ones_like(y))
    np.testing.assert_array_equal(np.asarray(d_P)[~np.asarray(lay.valid_P)], 0)
    (dx,) = vjp(jnp.ones_like(x_P))
    np.testing.assert_array_equal(dx, np.ones((9, 3)) * (np.arange(9) < 8)[:, None])


def test_expert_parallel_a2a_aligned_matches_single_device():
    from tests.moe.dispatch import test_expert_parallel as ep
    from dropless.parallel import shard_params
    cfg = ep._cfg("a2a", align_expert_rows=8)
    mesh, step = ep._step(cfg, "ep4")
    for routing in ("zipf", "one_device"):
        params, x = ep._inputs(routing)
        (_, (y, aux)), grads = step(shard_params(params, mesh), x)
        y_ref, grads_ref, sizes_ref = ep._reference(routing)
        np.testing.assert_allclose(y, y_ref, err_msg=routing, **ep.TOL)
        for got, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
            np.testing.assert_allclose(got, ref, err_msg=routing, **ep.TOL)
        np.testing.assert_array_equal(aux["tokens_per_expert"], sizes_ref)


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_config_refuses_bad_alignment(bad):
    with pytest.raises(ValueError, match="align_expert_rows"):
        MoEConfig(num_experts=4, top_k=1, d_model=8, d_ff=8, align_expert_rows=bad)


def test_config_refuses_alignment_with_quantized_dispatch():
    with pytest.raises(ValueError, match="align_expert_rows.*dispatch_quantization"):
        MoEConfig(num_experts=4, top_k=1, d_model=8, d_ff=8, align_expert_rows=8,
                  gmm_quantization="mxfp8", dispatch_quantization="mxfp8")


def test_grouped_matmul_checks_group_alignment():
    lhs, rhs = jnp.ones((12, 4)), jnp.ones((3, 4, 2))
    for bad in (0, -4, 2.0, True):
        with pytest.raises(ValueError, match="group_alignment must be a positive int"):
            registry.grouped_matmul(lhs, rhs, jnp.array([4, 0, 8]), group_alignment=bad)
    with pytest.raises(ValueError, match=r"group_alignment=4 .*\[4, 0, 6\]"):
        registry.grouped_matmul(lhs, rhs, jnp.array([4, 0, 6]), group_alignment=4)
    out = registry.grouped_matmul(lhs, rhs, jnp.array([4, 0, 8]), backend="tiled",
                                  group_alignment=4)
    np.testing.assert_array_equal(out, np.full((12, 2), 4.0))


def test_aligned_backend_is_told_the_alignment(monkeypatch):
    seen = []

    def fn(lhs, rhs, gs, *, out_dtype, group_alignment):
        seen.append(group_alignment)
        return jax.lax.ragged_dot(lhs, rhs, gs).astype(out_dtype)
    monkeypatch.setitem(registry._REGISTRY, "aligned_probe",
                        registry.BackendSpec("aligned_probe", fn, "test", aligned=True,
                                             row_block=64))
    registry.grouped_matmul(jnp.ones((8, 4)), jnp.ones((2, 4, 2)), jnp.array([4, 4]),
                            backend="aligned_probe", group_alignment=4)
    assert seen == [4]
    assert registry.row_alignment("aligned_probe", "cpu") == 64
    assert registry.row_alignment("tiled", "cpu") == 1
    assert registry.row_alignment("auto", "cpu") == 1   # CPU backends gain nothing from it
