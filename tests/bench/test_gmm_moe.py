"""`dropless bench gmm|moe`: the dense baselines' gradients, and that every record is written.

No timing is asserted here (CI machines are noisy); the numbers live in benchmarks/results/.
"""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.bench import dense, gmm as bench_gmm, moe as bench_moe


def _autodiff_matmul(a, b):
    return jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_dense_matmul_vjp_matches_autodiff(dtype, tol):
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((24, 16)), dtype)
    b = jnp.asarray(rng.standard_normal((16, 8)), dtype)
    dy = jnp.asarray(rng.standard_normal((24, 8)), dtype)
    _, fb = dense.fwd_and_fwd_bwd(dense.matmul)
    out, (da, db) = jax.jit(fb)(a, b, dy)
    ref_out, vjp = jax.vjp(_autodiff_matmul, a, b)
    ref_da, ref_db = vjp(dy)
    for got, want in ((out, ref_out), (da, ref_da), (db, ref_db)):
        assert got.dtype == want.dtype
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   rtol=tol, atol=tol * 8)


def test_dense_swiglu_gradients_match_autodiff():
    rng = np.random.default_rng(1)
    x, wg, wu, wd = (jnp.asarray(rng.standard_normal(s), jnp.float32) / 4
                     for s in ((12, 8), (8, 6), (8, 6), (6, 8)))
    dy = jnp.asarray(rng.standard_normal((12, 8)), jnp.float32)

    def plain(x, wg, wu, wd):
        return (jax.nn.silu(x @ wg) * (x @ wu)) @ wd
    out, grads = dense.fwd_and_fwd_bwd(dense.swiglu)[1](x, wg, wu, wd, dy)
    ref_out, vjp = jax.vjp(plain, x, wg, wu, wd)
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, vjp(dy)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_group_sizes_for_every_routing():
    for routing in bench_gmm.ROUTINGS:
        sizes = bench_gmm.group_sizes_for(routing, 256, 8, seed=8)
        assert sizes.shape == (8,) and sizes.sum() == 256 and (sizes >= 0).all(), routing
    assert (bench_gmm.group_sizes_for("quarter_empty", 256, 8) == 0).sum() == 2
    assert bench_gmm.group_sizes_for("half", 256, 8)[0] > 96   # about 128 of 256 rows
    with pytest.raises(ValueError, match="routing='zip'"):
        bench_gmm.group_sizes_for("zip", 256, 8)


def test_bench_gmm_writes_every_backend_and_mode(tmp_path):
    # one routing: a routing changes only the group sizes (test_group_sizes_for_every_routing)
    # and whether split_floor runs (uniform only); the records are the same
    out = tmp_path / "gmm.jsonl"
    args = bench_gmm.GmmOptions(m=256, k=32, n=32, groups=(8,), routings=("uniform",),
                                dtypes=("float32",),
                                backends=("auto", "ragged_dot", "padded", "loop"), repeats=1,
                                out=str(out))
    assert bench_gmm.run(args) == 0
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    seen = {(r["routing"], r["mode"], r["backend"]) for r in recs}
    for mode in ("fwd", "fwd+bwd"):
        for b in ("dense", "auto", "ragged_dot", "padded", "loop"):
            assert ("uniform", mode, b) in seen
    assert {r["mode"] for r in recs if r["backend"] == "split_floor"} == {"fwd", "fwd+bwd"}
    for r in recs:
        assert r["median_ms"] > 0 and r["ratio_to_dense"] > 0, r
        assert r["machine"]["jax"] == jax.__version__
    assert all(r["padding"]["executed_rows"] >= 256 and r["padding"]["dropped_rows"] == 0
               for r in recs if r["backend"] == "padded")


def test_bench_gmm_times_both_native_kernels_and_names_a_bad_suffix(tmp_path):
    from dropless.ops import native
    before = native.gemm_calls()
    out = tmp_path / "gmm.jsonl"
    # the second entry under the backend's old name: recorded under its new one
    args = bench_gmm.GmmOptions(m=256, k=32, n=32, groups=(8,), routings=("uniform",),
                                dtypes=("float32",), backends=("native:own", "openblas:openblas"),
                                repeats=1, out=str(out))
    assert bench_gmm.run(args) == 0
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    seen = {(r["mode"], r["backend"], r["resolved"]) for r in recs}
    for mode in ("fwd", "fwd+bwd"):
        assert {(mode, "native:own", "native"), (mode, "native:openblas", "native")} <= seen
    assert all(r["native_kernel"] == "auto" and r["openblas_core"] for r in recs)
    assert native.kernel() == "auto"   # put back after each timed call
    after = native.gemm_calls()
    assert after["own"] > before["own"] and after["openblas"] > before["openblas"]
    for bad in ("tiled:own", "native:fast", "openblas:fast"):
        with pytest.raises(ValueError, match=f"--backends '{bad}': a ':kernel' suffix goes on "
                                             "native only, one of native:auto, native:own"):
            bench_gmm.run(dataclasses.replace(args, backends=(bad,)))


def test_bench_moe_reports_drops_of_the_capacity_baseline(tmp_path):
    out = tmp_path / "moe.jsonl"
    # no fused/* rows: the GPU dry run below writes and checks them
    args = bench_moe.MoEOptions(rows=256, d_model=32, d_ff=32, experts=((8, 2),),
                                routings=("zipf",), capacity_factors=(1.0,), backends=("auto",),
                                repeats=1, fused=False, out=str(out))
    assert bench_moe.run(args) == 0
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    by = {(r["mode"], r["variant"]): r for r in recs}
    assert by[("fwd", "dropless/auto")]["dropped_rows"] == 0
    assert by[("fwd", "capacity/1")]["dropped_rows"] > 0  # Zipf overflows a 1.0 capacity
    assert by[("fwd+bwd", "dense")]["ratio_to_dense"] == 1.0


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_split_floor_computes_the_grouped_problem(dtype):
    rng = np.random.default_rng(2)
    a = jnp.asarray(rng.standard_normal((32, 8)), dtype)
    b = jnp.asarray(rng.standard_normal((8, 4)), dtype)
    dy = jnp.asarray(rng.standard_normal((32, 4)), dtype)
    fwd, fb = dense.split_floor(4)
    out, (da, db) = jax.jit(fb)(a, b, dy)
    a32, b32, dy32 = (np.asarray(v, np.float32) for v in (a, b, dy))
    tol = 1e-5 if dtype == jnp.float32 else 3e-2
    for got, want in ((fwd(a, b), a32 @ b32), (out, a32 @ b32), (da, dy32 @ b32.T),
                      (db, np.stack([a32[i:i + 8].T @ dy32[i:i + 8] for i in range(0, 32, 8)]))):
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=tol, atol=tol * 10)


def test_dense_transposed_tiles_drhs_is_exact_on_many_tiles():
    rng = np.random.default_rng(3)
    a = jnp.asarray(rng.standard_normal((2048, 16)), jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((2048, 8)), jnp.bfloat16)
    got = jax.jit(dense._transposed_tiles_drhs)(a, dy)
    want = np.asarray(a, np.float32).T @ np.asarray(dy, np.float32)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-3)


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch


TORCH = _torch()
needs_torch = pytest.mark.skipif(
    TORCH is None, reason="torch not installed (optional: pip install 'dropless[bench-torch]')")


def test_require_torch_names_the_extra_when_torch_is_absent(monkeypatch):
    import sys
    from dropless.bench import moe_torch
    monkeypatch.setitem(sys.modules, "torch", None)   # `import torch` raises ImportError
    with pytest.raises(ValueError, match=r"dropless\[bench-torch\]"):
        moe_torch.require_torch()


@needs_torch
def test_hf_mixtral_block_in_torch_equals_the_dropless_layer():
    # the same weights give the same routing, output and every gradient: the peer runs the
    # layer we run, not a different one
    from dropless import moe
    from dropless.config import MoEConfig
    from dropless.bench import moe_torch
    from dropless.moe.experts import expert_ffn
    torch = TORCH
    cfg = MoEConfig(num_experts=8, top_k=2, d_model=16, d_ff=12, score_func="softmax",
                    norm_topk_prob=True)
    p = moe.init_params(jax.random.key(0), cfg)
    p["router"]["bias_E"] = jnp.asarray(bench_moe._router_bias("zipf", 8, 8)) * 0.1
    x = jax.random.normal(jax.random.key(1), (64, 16))
    dy = jax.random.normal(jax.random.key(2), (64, 16))
    y, pullback = jax.vjp(lambda p, x: moe.apply(p, x, cfg)[0], p, x)
    gp, gx = pullback(dy)
    w = moe_torch.mixtral_weights(torch, jax.tree_util.tree_map(np.asarray, p))
    leaves = {k: v.clone().requires_grad_(True) for k, v in w.items() if k != "bias_E"}
    xt = torch.from_numpy(np.array(x)).requires_grad_(True)
    yt = moe_torch.mixtral_block(torch, dict(leaves, bias_E=w["bias_E"]), xt, 2)
    g_x, g_router, g_gu, g_down = torch.autograd.grad(yt, [xt, *leaves.values()],
                                                      torch.from_numpy(np.array(dy)))
    ex = gp["experts"]
    for got, want in ((yt.detach(), y), (g_x, gx), (g_router.T, gp["router"]["w_DE"]),
                      (g_gu.transpose(1, 2), np.concatenate([ex["w_gate_EDF"], ex["w_up_EDF"]],
                                                             -1)),
                      (g_down.transpose(1, 2), ex["w_down_EFD"])):
        np.testing.assert_allclose(got.numpy(), np.asarray(want), rtol=1e-4, atol=1e-5)
    # the raw grouped path: the expert FFN alone on expert-major rows
    sizes = np.array([5, 0, 9, 2, 0, 7, 4, 5], np.int32)
    xs = np.array(jax.random.normal(jax.random.key(3), (32, 16)))
    gu = torch.from_numpy(np.concatenate([np.asarray(p["experts"]["w_gate_EDF"]),
                                          np.asarray(p["experts"]["w_up_EDF"])], -1))
    got = moe_torch.grouped_ffn(torch, gu, torch.from_numpy(np.array(p["experts"]["w_down_EFD"])),
                                torch.from_numpy(xs), torch.from_numpy(np.cumsum(sizes)
                                                                       .astype(np.int32)))
    want = expert_ffn(jnp.asarray(xs), jnp.asarray(sizes), p["experts"], cfg)
    np.testing.assert_allclose(got.numpy(), np.asarray(want), rtol=1e-4, atol=1e-5)


@needs_torch
def test_bench_moe_vs_torch_writes_every_variant_against_its_own_dense(tmp_path):
    out = tmp_path / "peer.jsonl"
    args = bench_moe.MoEOptions(vs_torch=True, cases=((64, 4, 2, 16, 16),),
                                routings=("uniform",), repeats=1, out=str(out))
    assert bench_moe.run(args) == 0
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    by = {(r["mode"], r["variant"]): r for r in recs}
    for mode in ("fwd", "fwd+bwd"):
        for v in ("jax/dense", "dropless/auto", "jax/experts", "torch/dense", "torch/hf_mixtral",
                  "torch/grouped_mm"):
            assert by[(mode, v)]["median_ms"] > 0, (mode, v)
        assert by[(mode, "jax/dense")]["ratio_to_dense"] == 1.0
        assert by[(mode, "torch/dense")]["ratio_to_dense"] == 1.0
        layer = by[(mode, "dropless/auto")]
        assert layer["torch_over_dropless"] == pytest.approx(
            by[(mode, "torch/hf_mixtral")]["median_ms"] / layer["median_ms"])
        assert layer["bound_ms"] > 0 and layer["out_rel_diff_vs_torch"] < 1e-4
    assert all(r["torch_threads"] >= 1 and r["torch"] == TORCH.__version__ for r in recs)


@needs_torch
def test_bench_moe_vs_torch_in_bfloat16_runs_both_sides_in_it(tmp_path):
    out = tmp_path / "peer.jsonl"
    args = bench_moe.MoEOptions(vs_torch=True, cases=((64, 4, 2, 16, 16),), dtypes=("bfloat16",),
                                routings=("uniform",), repeats=1, out=str(out))
    assert bench_moe.run(args) == 0
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["dtype"] for r in recs} == {"bfloat16"} and len(recs) == 12
    layer = next(r for r in recs if r["variant"] == "dropless/auto" and r["mode"] == "fwd")
    # bfloat16 on both sides: the outputs differ by bfloat16's rounding (and, on another CPU, a
    # routing tie may fall the other way), so only that it was measured is checked here
    assert 1e-5 < layer["out_rel_diff_vs_torch"] < float("inf")
    assert "bound_ms" not in layer         # the modeled bound is float32's


def test_part_costs_add_up_to_the_layers_useful_flops():
    from dropless.bench import moe_profile
    t, d, f, e, k = 64, 16, 8, 4, 2
    costs = moe_profile.part_costs(t, d, f, e, k, shared_f=8)
    gmm = {ph: sum(fl for (p, nm), (fl, _) in costs.items() if p == ph and nm.startswith("gmm"))
           for ph in ("fwd", "bwd")}
    n = t * k
    assert gmm == {"fwd": 6.0 * n * d * f, "bwd": 12.0 * n * d * f}   # 3 matmuls; x2 backward
    assert costs[("bwd", "shared expert")][0] == 2 * costs[("fwd", "shared expert")][0]
    # the weight gradients write every expert's [D, F] once: bytes grow with E, FLOPs do not
    more = moe_profile.part_costs(t, d, f, 4 * e, k)
    fl, by = costs[("bwd", "gmm up drhs")], more[("bwd", "gmm up drhs")]
    assert by[0] == fl[0] and by[1] - fl[1] == 4 * 3 * e * d * f


def test_profile_times_every_part_against_its_limit():
    from dropless.bench import moe_profile
    rates = {"dense_flops": 1e10, "bandwidth": 1e10}
    recs = moe_profile.profile_case(32, 16, 8, 4, 2, shared_experts=1, repeats=1, rates=rates)
    parts = {(r["phase"], r["part"]) for r in recs if r["part"] != "(sum of parts)"}
    costs = moe_profile.part_costs(32, 16, 8, 4, 2, shared_f=8)
    fused = moe_profile.runs_fused("float32")
    assert parts == {key for key in costs if fused or key not in moe_profile.FUSED_PARTS}
    # the phase sums add what the layer runs: the fused kernels instead of what they replace
    replaced = {(ph, nm) for (ph, _), rs in moe_profile.FUSED_PARTS.items() for nm in rs}
    ran = [r for r in recs if r.get("in_layer")]
    assert {(r["phase"], r["part"]) for r in recs if r.get("in_layer") is False} == (
        replaced if fused else set())
    sums = {r["phase"]: r["median_ms"] for r in recs if r["part"] == "(sum of parts)"}
    assert sums["fwd"] == pytest.approx(sum(r["median_ms"] for r in ran if r["phase"] == "fwd"))
    assert sums["fwd+bwd"] == pytest.approx(sum(r["median_ms"] for r in ran))
    for r in recs:
        assert r["median_ms"] > 0 and r["limit_ms"] > 0 and r["x_limit"] > 0, r
    total = {r["phase"]: r for r in recs if r["part"] == "(sum of parts)"}
    assert total["fwd+bwd"]["layer_ms"] > 0 and total["fwd"]["layer_x_limit"] > 0


def test_a_rate_is_the_best_of_its_repeats_and_of_min_s_of_them():
    from dropless.bench import moe_profile
    calls, times = [], iter([0.03, 0.01, 0.02] + [0.005] * 1000)

    def fn():
        calls.append(1)
        import time
        time.sleep(next(times))
        return jnp.zeros(())
    best = moe_profile._best_s(fn, repeats=2, min_s=0.0)
    assert len(calls) == 3 and 0.01 <= best < 0.02   # one warm-up call, then the best of 2
    calls.clear()
    best = moe_profile._best_s(fn, repeats=1, min_s=0.1)
    assert len(calls) >= 10 and best < 0.01          # went on until 0.1 s of calls had run


def _tiles_by_brute_force(sizes, bm):
    """Row by row: the (tile, group) pairs the rows of one grid cover, unaligned and with each
    group's rows moved to start at the next multiple of bm."""
    owner = np.repeat(np.arange(len(sizes)), sizes)
    unaligned = {(r // bm, g) for r, g in enumerate(owner)}
    aligned, row = set(), 0
    for g, s in enumerate(sizes):
        aligned |= {((row + i) // bm, g) for i in range(s)}
        row += -(-s // bm) * bm
    return len(unaligned), len(aligned), row - int(np.sum(sizes))


@pytest.mark.parametrize("seed", range(4))
def test_row_tiles_against_brute_force(seed):
    rng = np.random.default_rng(seed)
    for bm in (1, 4, 16, 128):
        sizes = rng.integers(0, 300, int(rng.integers(1, 40)))
        sizes[rng.random(len(sizes)) < 0.2] = 0                # empty groups
        t = bench_gmm.row_tiles(sizes, bm)
        assert (t["tiles_unaligned"], t["tiles_aligned"], t["padded_rows"]) == \
            _tiles_by_brute_force(sizes, bm)
        assert t["tiles_unaligned"] <= t["tiles_bound"]
        assert t["tiles_aligned"] <= t["tiles_unaligned"]


def test_model_only_writes_the_alignment_model_at_the_shapes_table(tmp_path, capsys):
    from dropless.ops.gmm import shapes
    out = tmp_path / "m.jsonl"
    bench_gmm.run(bench_gmm.GmmOptions(groups=(8,), routings=("uniform",), dtypes=("float32",),
                                       model_only=True, out=str(out)))
    recs = [r for r in map(json.loads, out.read_text().splitlines())
            if r["mode"] == "align_model"]
    models = {s.model for s in shapes.SHAPES if s.model != "small"}
    assert {r["shape"] for r in recs} >= models and len(recs) == 2 * (len(models) + 3)
    for r in recs:
        sizes = shapes.group_sizes(r["routing"], r["m"], r["groups"], 0)
        assert _tiles_by_brute_force(sizes, r["block_m"])[:2] == (r["tiles_unaligned"],
                                                                 r["tiles_aligned"])
    assert "rows_per_row_aligned" in capsys.readouterr().out
