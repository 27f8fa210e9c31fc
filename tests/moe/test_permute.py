"""Permutation: the hand-worked example and gradients against plain autodiff of gathers; the
native row gathers that permute and combine run for float32 on CPU (in the compiled HLO), combine
and its gradients against the XLA form (combine_reference) and a float64 loop, and the XLA path
for other dtypes, without the native library, and in a lowering for CUDA; the native counting
sort against XLA's sort and numpy, in and out of range, and the same XLA fallbacks."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.moe import permute as perm

from tests._support.jaxpr_walk import equations


def test_hand_worked_example():
    # from the module docstring: T=3, K=2, E=3
    ids = jnp.array([[2, 0], [0, 1], [2, 1]])
    p = perm.sort_by_expert(ids, 3)
    assert p.order_N.tolist() == [1, 2, 3, 5, 0, 4]
    assert p.inv_N.tolist() == [4, 0, 1, 2, 5, 3]
    assert p.group_sizes_E.tolist() == [2, 2, 2]
    x = jnp.array([[10.0], [20.0], [30.0]])
    assert perm.permute(x, p.order_N, p.inv_N, 2)[:, 0].tolist() == [10, 20, 20, 30, 10, 30]


def test_empty_experts_and_round_trip():
    ids = jnp.array([[4, 1], [4, 1], [1, 4]])  # experts 0, 2, 3 receive nothing
    p = perm.sort_by_expert(ids, 5)
    assert p.group_sizes_E.tolist() == [0, 3, 0, 0, 3]
    x = jnp.arange(6.0).reshape(3, 2)
    x_nd = perm.permute(x, p.order_N, p.inv_N, 2)
    back = perm.unpermute(x_nd, p.order_N, p.inv_N, 2)
    np.testing.assert_array_equal(back, jnp.repeat(x[:, None], 2, axis=1))


def test_grads_match_autodiff_of_plain_gathers():
    key = jax.random.key(0)
    t, k, e, d = 7, 3, 5, 4
    ids = jax.vmap(lambda kk: jax.random.choice(kk, e, (k,), replace=False))(
        jax.random.split(key, t))
    p = perm.sort_by_expert(ids, e)
    x = jax.random.normal(key, (t, d))
    w_nd = jax.random.normal(jax.random.key(1), (t * k, d))
    w_tkd = jax.random.normal(jax.random.key(2), (t, k, d))
    plain_perm = lambda x: x[p.order_N // k]
    plain_unperm = lambda y: y[p.inv_N].reshape(t, k, d)
    f = lambda x: jnp.sum(perm.permute(x, p.order_N, p.inv_N, k) * w_nd)
    g = lambda x: jnp.sum(plain_perm(x) * w_nd)
    np.testing.assert_allclose(jax.grad(f)(x), jax.grad(g)(x), rtol=1e-6)
    y = jax.random.normal(key, (t * k, d))
    f = lambda y: jnp.sum(perm.unpermute(y, p.order_N, p.inv_N, k) * w_tkd)
    g = lambda y: jnp.sum(plain_unperm(y) * w_tkd)
    np.testing.assert_allclose(jax.grad(f)(y), jax.grad(g)(y), rtol=1e-6)


# ---- the native row gathers (float32 on CPU) against the XLA form and a float64 loop ----
# Legend as in moe/permute.py: T tokens, D model dim, K top-k, N = T*K routed rows, E experts.

NATIVE = ("dropless_gather_rows_f32", "dropless_gather_sum_f32", "dropless_row_dots_f32")


def _routing(t, k, e, used, seed=0):
    """ids [T, K]: K distinct experts a token, drawn from the first `used` of E (the rest get no
    rows), and their Permutation."""
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(used, k, replace=False) for _ in range(t)]).astype(np.int32)
    return ids, perm.sort_by_expert(jnp.asarray(ids), e)


def _targets(fn, *args) -> set[str]:
    """The custom calls of fn's compiled HLO (for this host: CPU)."""
    hlo = jax.jit(fn).lower(*args).compile().as_text()
    return set(re.findall(r'custom_call_target="([^"]+)"', hlo))


def _fns(p, k):
    """permute and combine, each with its gradient (a cotangent through jax.vjp)."""
    def permute_grad(x, d):
        return jax.vjp(lambda x: perm.permute(x, p.order_N, p.inv_N, k), x)[1](d)[0]

    def combine_grads(y, w, dy):
        return jax.vjp(lambda y, w: perm.combine(y, w, p.order_N, p.inv_N), y, w)[1](dy)
    return (lambda x: perm.permute(x, p.order_N, p.inv_N, k), permute_grad,
            lambda y, w: perm.combine(y, w, p.order_N, p.inv_N), combine_grads)


def _operands(t, k, d, dtype=jnp.float32, seed=1):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((t, d)), dtype)
    d_nd = jnp.asarray(rng.standard_normal((t * k, d)), dtype)
    y = jnp.asarray(rng.standard_normal((t * k, d)), dtype)
    w = jnp.asarray(rng.standard_normal((t, k)), dtype)
    dy = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
    return x, d_nd, y, w, dy


def test_float32_on_cpu_runs_the_native_gathers():
    t, k, e, d = 24, 2, 6, 8
    _, p = _routing(t, k, e, e)
    x, d_nd, y, w, dy = _operands(t, k, d)
    fwd, fwd_grad, comb, comb_grads = _fns(p, k)
    assert "dropless_gather_rows_f32" in _targets(fwd, x)
    assert "dropless_gather_sum_f32" in _targets(fwd_grad, x, d_nd)
    assert "dropless_gather_sum_f32" in _targets(comb, y, w)
    assert {"dropless_gather_rows_f32", "dropless_row_dots_f32"} <= _targets(comb_grads, y, w, dy)
    # and XLA's row gather is not compiled beside them (platform_dependent kept one branch)
    for fn, args in ((fwd, (x,)), (fwd_grad, (x, d_nd)), (comb, (y, w))):
        assert " gather(" not in jax.jit(fn).lower(*args).compile().as_text()


def np_combine(y, w, inv, dy):
    """(y_TD, d_y_ND, d_weights_TK) in float64, one (token, choice) at a time."""
    y, w, dy = (np.asarray(a, np.float64) for a in (y, w, dy))
    t, k = w.shape
    out, d_y, d_w = np.zeros((t, y.shape[1])), np.zeros_like(y), np.zeros((t, k))
    for tok in range(t):
        for j in range(k):
            row = int(inv[tok * k + j])
            out[tok] += w[tok, j] * y[row]
            d_y[row] += w[tok, j] * dy[tok]
            d_w[tok, j] = np.dot(dy[tok], y[row])
    return out, d_y, d_w


def _close(got, want, rtol=1e-6):
    want = np.asarray(want, np.float64)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=rtol,
                               atol=rtol * float(np.abs(want).max(initial=0.0)))


# (T, K, E, experts used, D): experts past `used` receive no tokens; K = 1 and K = 8; D = 37 has a
# vector tail in the native dots
@pytest.mark.parametrize("t, k, e, used, d", [(96, 2, 8, 5, 40), (64, 1, 4, 3, 37),
                                              (48, 8, 16, 10, 24), (300, 4, 8, 8, 384)])
def test_combine_and_its_grads_match_xla_and_float64_loop(t, k, e, used, d):
    _, p = _routing(t, k, e, used, seed=t)
    assert (np.asarray(p.group_sizes_E)[used:] == 0).all()
    _, _, y, w, dy = _operands(t, k, d, seed=k)

    def value_and_grads(fn):
        out, pullback = jax.vjp(lambda y, w: fn(y, w, p.order_N, p.inv_N), y, w)
        return (out, *pullback(dy))
    got = jax.jit(lambda: value_and_grads(perm.combine))()
    xla = jax.jit(lambda: value_and_grads(perm.combine_reference))()
    loop = np_combine(y, w, np.asarray(p.inv_N), dy)
    assert got[0].dtype == jnp.float32 and got[0].shape == (t, d)
    assert got[1].shape == y.shape and got[2].shape == w.shape
    for a, b, c in zip(got, xla, loop):
        _close(a, b)
        _close(a, c)


def _computed(jaxpr, size: int) -> int:
    """Equations in `jaxpr` (nested bodies included) that compute a 3-D array of `size`
    elements ([T, K, D] in some order) by arithmetic (not by moving rows: gathers, reshapes,
    calls)."""
    moves = {"gather", "reshape", "custom_vjp_call", "custom_vjp_call_jaxpr", "pjit", "jit"}
    return sum(eqn.primitive.name not in moves
               and any(len(getattr(v.aval, "shape", ())) == 3 and v.aval.size == size
                       for v in eqn.outvars)
               for eqn in equations(jaxpr))


def test_xla_combine_gradient_never_forms_the_weighted_token_choices():
    """The XLA path's gradient gathers d_y straight from dy_TD and the weights; autodiff of
    the definition multiplies dy by the weights into a [T, K, D] array first (then gathers it:
    on a GPU a write and a read of K x the tokens' rows more per layer). Same values."""
    t, k, e, d = 40, 4, 8, 16
    _, p = _routing(t, k, e, e)
    _, _, y, w, dy = _operands(t, k, d)
    y = y.astype(jnp.bfloat16)

    def grads(fn):
        return lambda y, w, dy: jax.vjp(lambda y, w: fn(y, w, p.order_N, p.inv_N), y, w)[1](dy)
    from dropless.ops import kernels
    ref = jax.make_jaxpr(grads(perm.combine_reference))(y, w, dy).jaxpr
    got = jax.make_jaxpr(grads(kernels.combine_xla))(y, w, dy).jaxpr
    assert _computed(ref, t * k * d) >= 1          # the check sees autodiff's product
    assert _computed(got, t * k * d) == 0
    for a, b in zip(jax.jit(grads(kernels.combine_xla))(y, w, dy),
                    jax.jit(grads(perm.combine_reference))(y, w, dy)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("k", [1, 3, 8])
def test_native_permute_and_grad_match_plain_gathers(k):
    t, e, d = 50, 8, 37
    _, p = _routing(t, k, e, e, seed=k)
    x, d_nd, *_ = _operands(t, k, d)
    fwd, fwd_grad, *_ = _fns(p, k)
    assert "dropless_gather_sum_f32" in _targets(fwd_grad, x, d_nd)
    plain = lambda x: x[p.order_N // k]
    np.testing.assert_array_equal(jax.jit(fwd)(x), plain(x))
    want = jax.vjp(plain, x)[1](d_nd)[0]                 # XLA's scatter-add transpose
    np.testing.assert_allclose(jax.jit(fwd_grad)(x, d_nd), want, rtol=1e-6,
                               atol=1e-6 * float(np.abs(want).max()))


@pytest.mark.parametrize("y_dtype, w_dtype", [(jnp.bfloat16, jnp.bfloat16),
                                              (jnp.float32, jnp.bfloat16),
                                              (jnp.bfloat16, jnp.float32)])
def test_other_dtypes_take_the_xla_path(y_dtype, w_dtype):
    t, k, e, d = 40, 2, 6, 16
    _, p = _routing(t, k, e, 4)
    x, d_nd, y, w, dy = _operands(t, k, d)
    x, d_nd, y, w = x.astype(y_dtype), d_nd.astype(y_dtype), y.astype(y_dtype), w.astype(w_dtype)
    fwd, fwd_grad, comb, comb_grads = _fns(p, k)
    for fn, args in ((fwd, (x,)), (fwd_grad, (x, d_nd)), (comb, (y, w)),
                     (comb_grads, (y, w, dy))):
        if fn in (fwd, fwd_grad) and y_dtype == jnp.float32:
            continue   # float32 rows permute natively (the test above)
        assert not any(n in _targets(fn, *args) for n in NATIVE)
    out = jax.jit(comb)(y, w)
    d_y, d_w = jax.jit(comb_grads)(y, w, dy)
    assert out.dtype == jnp.float32 and d_y.dtype == y_dtype and d_w.dtype == w_dtype
    ref = lambda y, w: perm.combine_reference(y, w, p.order_N, p.inv_N)
    np.testing.assert_array_equal(out, ref(y, w))
    for a, b in zip((d_y, d_w), jax.vjp(ref, y, w)[1](dy)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    # the reference rounds the weights to the rows' dtype, then sums exact products in float32
    w_used = np.asarray(w.astype(y_dtype), np.float64)
    want, want_dy, want_dw = np_combine(np.asarray(y, np.float64), w_used,
                                        np.asarray(p.inv_N), dy)
    _close(out, want)
    # the gradients are rounded to bfloat16 where the reference's operand is (w: always)
    _close(d_y, want_dy, rtol=2.0 ** -7 if y_dtype == jnp.bfloat16 else 1e-6)
    _close(d_w, want_dw, rtol=2.0 ** -7)
    if y_dtype == jnp.bfloat16:
        np.testing.assert_array_equal(jax.jit(fwd)(x), x[p.order_N // k])


def test_without_the_library_every_dtype_takes_the_xla_path(monkeypatch):
    from dropless.ops import native as library
    t, k, e, d = 30, 2, 5, 8
    ids_tk, p = _routing(t, k, e, e)
    native_sort = jax.jit(lambda i: perm.sort_by_expert(i, e))(jnp.asarray(ids_tk))
    x, d_nd, y, w, dy = _operands(t, k, d)
    fwd, fwd_grad, comb, comb_grads = _fns(p, k)
    native = [jax.jit(f)(*a) for f, a in ((fwd, (x,)), (fwd_grad, (x, d_nd)), (comb, (y, w)),
                                          (comb_grads, (y, w, dy)))]
    monkeypatch.setattr(library, "problem", lambda: "the native kernel is unavailable: test")
    # (new functions: jit keeps the traces above, the choice is made when tracing)
    for fn, args, want in zip(_fns(p, k),
                              ((x,), (x, d_nd), (y, w), (y, w, dy)), native):
        assert not any(n in _targets(fn, *args) for n in NATIVE)
        for a, b in zip(jax.tree.leaves(jax.jit(fn)(*args)), jax.tree.leaves(want)):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * float(np.abs(b).max()))
    sort = lambda i: perm.sort_by_expert(i, e)
    assert "dropless_sort_by_expert" not in _targets(sort, jnp.asarray(ids_tk))
    for a, b in zip(jax.jit(sort)(jnp.asarray(ids_tk)), native_sort):
        np.testing.assert_array_equal(a, b)


def test_a_process_whose_default_backend_is_not_the_cpu_never_builds_the_library(monkeypatch):
    from dropless.ops import native
    t, k, e, d = 12, 2, 4, 8
    _, p = _routing(t, k, e, e)
    x, d_nd, y, w, dy = _operands(t, k, d)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    asked = []
    monkeypatch.setattr(native, "problem", lambda: asked.append(1))
    for fn, args in zip(_fns(p, k), ((x,), (x, d_nd), (y, w), (y, w, dy))):
        assert not any(n in _targets(fn, *args) for n in NATIVE)
    ids = jnp.zeros((t, k), jnp.int32)
    assert "dropless_sort_by_expert" not in _targets(lambda i: perm.sort_by_expert(i, e), ids)
    assert asked == []


def _cuda_lowers() -> bool:
    try:
        jax.jit(jnp.sin).trace(jnp.ones(2)).lower(lowering_platforms=("cuda",))
    except Exception:   # any failure: this jax cannot lower for CUDA here  # noqa: BLE001
        return False
    return True


def test_lowering_for_cuda_keeps_xlas_gathers():
    if not _cuda_lowers():
        pytest.skip("this jax cannot lower for CUDA here")
    t, k, e, d = 24, 2, 6, 8
    _, p = _routing(t, k, e, e)
    x, d_nd, y, w, dy = _operands(t, k, d)
    for fn, args in zip(_fns(p, k), ((x,), (x, d_nd), (y, w), (y, w, dy))):
        traced = jax.jit(fn).trace(*args)
        cuda = traced.lower(lowering_platforms=("cuda",)).as_text()
        assert "dropless_gather" not in cuda and "dropless_row_dots" not in cuda
        assert "stablehlo.gather" in cuda
        cpu = traced.lower(lowering_platforms=("cpu",)).as_text()   # (the same trace, for CPU)
        assert "dropless_gather" in cpu or "dropless_row_dots" in cpu


# ---- the native counting sort (CPU) against XLA's stable sort and a numpy oracle ----

def _np_sort(ids, e):
    """order, inv, sizes the way numpy says: a stable argsort, its inverse, and bincount with
    numpy's negative indices (an id in [-E, 0) counts for id + E; others outside [0, E) not)."""
    ids = np.asarray(ids).reshape(-1)
    order = np.argsort(ids, kind="stable")
    inv = np.empty_like(order)
    inv[order] = np.arange(ids.size)
    sizes = np.zeros(e, np.int64)
    for v in ids:
        if -e <= v < e:
            sizes[v] += 1
    return order, inv, sizes


@pytest.mark.parametrize("ids, e", [
    (np.random.default_rng(0).integers(0, 256, (1024, 8)), 256),   # the 256-expert case's shape
    (np.zeros((50, 2), int), 3),                                    # one expert takes every row
    (np.array([[2, 2], [0, 2], [1, 0]]), 3),                        # ties keep their order
    (np.array([[5, -1], [0, 7], [-4, 2], [-1, 3]]), 4),             # out of range, both ways
    (np.zeros((0, 2), int), 4),                                     # no rows
])
def test_native_sort_matches_xla_and_numpy(ids, e):
    ids = jnp.asarray(ids, jnp.int32)
    flat = ids.reshape(-1)
    want = _np_sort(ids, e)
    ref = jax.jit(lambda f: perm.sort_by_expert_reference(f, e))(flat)
    got = jax.jit(lambda i: perm.sort_by_expert(i, e))(ids)
    for a, b, w in zip(got, ref, want):
        assert a.dtype == jnp.int32
        np.testing.assert_array_equal(a, w)
        np.testing.assert_array_equal(b, w)
    assert "dropless_sort_by_expert" in _targets(lambda i: perm.sort_by_expert(i, e), ids)


def test_native_sort_under_vmap_sorts_each_item():
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 5, (3, 40, 2)), jnp.int32)
    got = jax.jit(jax.vmap(lambda i: perm.sort_by_expert(i, 5)))(ids)
    for b in range(3):
        for a, w in zip(got, _np_sort(ids[b], 5)):
            np.testing.assert_array_equal(a[b], w)


def test_lowering_for_cuda_keeps_xlas_sort():
    if not _cuda_lowers():
        pytest.skip("this jax cannot lower for CUDA here")
    traced = jax.jit(lambda i: perm.sort_by_expert(i, 6)).trace(jnp.zeros((24, 2), jnp.int32))
    cuda = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "dropless_sort_by_expert" not in cuda and "stablehlo.sort" in cuda
    assert "dropless_sort_by_expert" in traced.lower(lowering_platforms=("cpu",)).as_text()
