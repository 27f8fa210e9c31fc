"""`dropless bench moe --profile`: where the MoE layer's forward and backward spend their time on
CPU, each part against its own limit.

Legend: T tokens, D model dim, F expert hidden dim, E experts, K top-k, N = T*K routed rows,
Fs shared-expert hidden dim.

Op-level timing: every part of the dropless layer (unfused weights, the grouped-matmul kernels
that `auto` runs on CPU: `native` for float32 where it builds, else `tiled`) is jitted on its
own, on the intermediate values the layer itself computes, and all parts are timed in one round-robin together with the whole layer's forward and
forward+backward (so the parts' sum can be compared with the fused whole). Parts:
  router (logits, softmax, top-k), sort (argsort, inverse, group sizes), gather (x to
  expert-major rows), gmm gate / up / down forward, swiglu, combine (unsort, weight, sum over
  K), and in the backward: combine, gmm down dlhs and drhs, swiglu, gmm gate and up dlhs and
  drhs, gather (the scatter-add as a gather through inv + sum), router, each backward part
  run from the residuals its forward saved, as in the layer (its forward not recomputed); the
  shared expert (forward, backward) when the layer has one. Where the layer runs the fused SwiGLU
  FFN (`native.swiglu_ffn`: float32 on the `native` backend), its three kernels are timed as
  well (`FUSED_PARTS`: each with the unfused parts it stands in for) and the phase sums add what
  the layer runs: the fused kernels instead of the parts they replace (`in_layer`).

The model: each part's useful FLOPs and the bytes it must move at least (every operand read
once, every result written once, float32 or the case's dtype), and its limit
max(FLOPs / dense rate, bytes / bandwidth), both rates measured here: the dense rate is the
best of an [N, D] @ [D, F] matmul (the layer's own dense shape), the bandwidth the best of a
jitted streaming `x * 2 + 1` over 256 MB (read + write). `x_limit` = measured / limit is each
part's distance to its own limit; the whole layer's limit is the sum of its parts' limits.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

from dropless import machine, moe
from dropless.config import MoEConfig
from dropless.moe import permute as perm
from dropless.moe import router as rt
from dropless.moe.ffn import swiglu, swiglu_ffn
from dropless.bench import dense
from dropless.ops import native
from dropless.ops.gmm.registry import resolve_backend
from dropless.ops.gmm.tiled import tiled_dlhs, tiled_drhs, tiled_gmm


# the fused SwiGLU FFN's kernels and the unfused parts each one stands in for
FUSED_PARTS = {
    ("fwd", "fused gate+up+swiglu"): ("gmm gate", "gmm up", "swiglu"),
    ("bwd", "fused down dlhs+swiglu"): ("gmm down dlhs", "swiglu"),
    ("bwd", "fused gate+up dlhs"): ("gmm gate dlhs", "gmm up dlhs"),
}


def runs_fused(dtype) -> bool:
    """Whether the layer's expert FFN runs `native.swiglu_ffn` on CPU for `dtype`."""
    return cpu_kernels(dtype)[0] == "native"


def cpu_kernels(dtype) -> tuple[str, tuple[Callable, Callable, Callable]]:
    """The grouped-matmul backend `auto` runs on CPU for `dtype` operands, and its three
    products as `(forward(a, w, gs), dlhs(dy, w, gs), drhs(a, dy, gs))`, each jitted."""
    dt = jnp.dtype(dtype)
    name = resolve_backend("auto", "cpu")
    if name == "native" and dt == jnp.float32:
        return name, (jax.jit(native.gmm_forward), jax.jit(native.gmm_dlhs),
                      jax.jit(native.gmm_drhs))
    return "tiled", (jax.jit(lambda a, w, gs: tiled_gmm(a, w, gs, out_dtype=dt)),
                     jax.jit(lambda dy, w, gs: tiled_dlhs(dy, w, gs, out_dtype=dt)),
                     jax.jit(lambda a, dy, gs: tiled_drhs(a, dy, gs, out_dtype=dt)))


def _best_s(fn: Callable[[], Any], repeats: int, min_s: float = 0.0) -> float:
    """The fastest of at least `repeats` calls of fn, and of as many more as fit in `min_s`."""
    jax.block_until_ready(fn())
    best, done, start = float("inf"), 0, time.perf_counter()
    while done < repeats or time.perf_counter() - start < min_s:
        t = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t)
        done += 1
    return best


def measure_rates(n: int, d: int, f: int, dtype: str = "float32", repeats: int = 5,
                  stream_bytes: int = 256 * 2**20, min_s: float = 1.0) -> dict[str, float]:
    """{"dense_flops": FLOP/s of an [n, d] @ [d, f] matmul, the faster of XLA's jitted dot
    ("dense_flops_xla") and, in float32 where the `native` backend builds, one group on it
    ("dense_flops_openblas", a key kept from the backend's old name: whichever kernel the native
    library runs for that shape, see `native.describe`); "bandwidth": bytes/s of a jitted streaming elementwise pass (read +
    write) over `stream_bytes`}, each the best of at least `repeats` calls and `min_s` seconds
    of them. On a 2-core EPYC the best of 5 [8192, 512] @ [512, 128] products ranged over
    255-305 GFLOP/s from one run to the next and the best of 100 over 318-378: the limits are
    what the machine allows at its best, so the longer search."""
    dt = jnp.dtype(dtype)
    a = jnp.ones((n, d), dt)
    b = jnp.ones((d, f), dt)
    mm = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(dt))
    flops = 2.0 * n * d * f / _best_s(lambda: mm(a, b), repeats, min_s)
    rates = {"dense_flops_xla": flops}
    if dt == jnp.float32 and native.problem() is None:
        # the same product as a one-group grouped matmul on `native`: the faster of the two
        # is what this machine allows
        one = jax.jit(native.gmm_forward)
        b_1DF, gs_1 = b[None], jnp.array([n], jnp.int32)
        rates["dense_flops_openblas"] = 2.0 * n * d * f / _best_s(lambda: one(a, b_1DF, gs_1),
                                                                  repeats, min_s)
    # the output reuses the donated input's pages: a fresh buffer would time page faults
    stream = jax.jit(lambda x: x * 2 + 1, donate_argnums=0)
    box = [jnp.ones((stream_bytes // dt.itemsize,), dt)]

    def step():
        box[0] = stream(box[0])
        return box[0]
    bw = 2.0 * stream_bytes / _best_s(step, repeats, min_s)
    return dict(rates, dense_flops=max(rates.values()), bandwidth=bw)


def part_costs(t: int, d: int, f: int, e: int, k: int, itemsize: int = 4,
               shared_f: int = 0) -> dict[tuple[str, str], tuple[float, float]]:
    """{(phase, part): (useful FLOPs, compulsory bytes)} of the layer: each operand read once,
    each result written once (indices as int32), `itemsize` bytes a value; the fused kernels of
    `FUSED_PARTS` included (what they stand in for is in `FUSED_PARTS`)."""
    n, b = t * k, itemsize
    gmm_fwd = (2.0 * n * d * f, b * (n * d + e * d * f + n * f))     # [N,D] x [E,D,F] -> [N,F]
    dn_fwd = (2.0 * n * f * d, b * (n * f + e * f * d + n * d))
    drhs = (2.0 * n * d * f, b * (n * d + n * f + e * d * f))         # writes [E,D,F] once
    costs = {
        ("fwd", "router"): (2.0 * t * d * e, 4 * (t * d + d * e + t * e + 2 * t * k)),
        ("fwd", "sort"): (0.0, 4 * (n + 3 * n + e)),
        ("fwd", "gather"): (0.0, b * 2 * n * d + 4 * n),
        ("fwd", "gmm gate"): gmm_fwd,
        ("fwd", "gmm up"): gmm_fwd,
        ("fwd", "swiglu"): (4.0 * n * f, b * 3 * n * f),
        ("fwd", "gmm down"): dn_fwd,
        ("fwd", "combine"): (2.0 * n * d, b * (n * d + t * d) + 4 * (n + t * k)),
        ("bwd", "combine"): (4.0 * n * d, b * (2 * n * d + t * d) + 4 * (n + 2 * t * k)),
        ("bwd", "gmm down dlhs"): (2.0 * n * d * f, b * (n * d + e * f * d + n * f)),
        ("bwd", "gmm down drhs"): drhs,
        ("bwd", "swiglu"): (8.0 * n * f, b * 5 * n * f),
        ("bwd", "gmm gate dlhs"): (2.0 * n * f * d, b * (n * f + e * d * f + n * d)),
        ("bwd", "gmm gate drhs"): drhs,
        ("bwd", "gmm up dlhs"): (2.0 * n * f * d, b * (n * f + e * d * f + n * d)),
        ("bwd", "gmm up drhs"): drhs,
        ("bwd", "gather"): (1.0 * n * d, b * (n * d + t * d) + 4 * n),
        ("bwd", "router"): (4.0 * t * d * e, 4 * (2 * t * d + 2 * d * e + 2 * t * e)),
    }
    fused_bytes = {"fused gate+up+swiglu": n * d + 2 * e * d * f + 3 * n * f,
                   "fused down dlhs+swiglu": n * d + e * f * d + 4 * n * f,
                   "fused gate+up dlhs": 2 * n * f + 2 * e * d * f + n * d}
    for (ph, nm), replaced in FUSED_PARTS.items():
        costs[(ph, nm)] = (sum(costs[(ph, r)][0] for r in replaced), b * fused_bytes[nm])
    if shared_f:
        fl = 6.0 * t * d * shared_f
        by = b * (2 * t * d + 3 * d * shared_f + 3 * t * shared_f)
        costs[("fwd", "shared expert")] = (fl, by)
        costs[("bwd", "shared expert")] = (2 * fl, 2 * by + b * 3 * d * shared_f)
    return costs


def _parts(params, x_TD, dy_TD, cfg: MoEConfig) -> dict[tuple[str, str], Callable[[], Any]]:
    """{(phase, part): zero-argument jitted call} on the layer's own intermediate values."""
    e, k, dt = cfg.num_experts, cfg.top_k, jnp.dtype(cfg.dtype)
    r, ex = params["router"], params["experts"]
    w_g, w_u, w_d = (ex[n].astype(dt) for n in ("w_gate_EDF", "w_up_EDF", "w_down_EFD"))
    _, (gmm, dlhs, drhs) = cpu_kernels(dt)

    def route(x, w_DE, bias_E):
        rout = rt.route(rt.router_logits(x, w_DE), bias_E, cfg)
        return rout.weights_TK, rout.ids_TK

    def combine(y_ND, order, inv, w_TK):
        return perm.combine(y_ND, w_TK, order, inv)

    route_j = jax.jit(route)
    sort_j = jax.jit(lambda ids: perm.sort_by_expert(ids, e))
    gather_j = jax.jit(lambda x, o, i: perm.permute(x, o, i, k))
    swiglu_j = jax.jit(lambda g, u: swiglu(g, u, dt))
    combine_j = jax.jit(combine)
    w_TK, ids_TK = route_j(x_TD, r["w_DE"], r["bias_E"])
    p = sort_j(ids_TK)
    gs = p.group_sizes_E
    x_ND = gather_j(x_TD.astype(dt), p.order_N, p.inv_N)
    g_NF, u_NF = gmm(x_ND, w_g, gs), gmm(x_ND, w_u, gs)
    h_NF = swiglu_j(g_NF, u_NF)
    y_ND = gmm(h_NF, w_d, gs)

    def vjp_of(fn, *primals):
        # the backward alone, from the forward's residuals (as in the layer's backward): the
        # call's primal arguments are those residuals' source and are not recomputed
        _, pullback = jax.vjp(fn, *primals)
        backward = jax.jit(lambda pb, ct: pb(ct))
        return lambda *a: backward(pullback, a[-1])
    combine_b = vjp_of(lambda y, w: combine(y, p.order_N, p.inv_N, w), y_ND, w_TK)
    dy_ND = combine_b(y_ND, w_TK, dy_TD.astype(jnp.float32))[0].astype(dt)
    dh_NF = dlhs(dy_ND, w_d, gs)
    swiglu_b = vjp_of(lambda g, u: swiglu(g, u, dt), g_NF, u_NF)
    dg_NF, du_NF = swiglu_b(g_NF, u_NF, dh_NF)
    gather_b = vjp_of(lambda x: perm.permute(x, p.order_N, p.inv_N, k), x_TD.astype(dt))
    router_b = vjp_of(lambda x, w: route(x, w, r["bias_E"])[0], x_TD, r["w_DE"])
    calls = {
        ("fwd", "router"): lambda: route_j(x_TD, r["w_DE"], r["bias_E"]),
        ("fwd", "sort"): lambda: sort_j(ids_TK),
        ("fwd", "gather"): lambda: gather_j(x_TD.astype(dt), p.order_N, p.inv_N),
        ("fwd", "gmm gate"): lambda: gmm(x_ND, w_g, gs),
        ("fwd", "gmm up"): lambda: gmm(x_ND, w_u, gs),
        ("fwd", "swiglu"): lambda: swiglu_j(g_NF, u_NF),
        ("fwd", "gmm down"): lambda: gmm(h_NF, w_d, gs),
        ("fwd", "combine"): lambda: combine_j(y_ND, p.order_N, p.inv_N, w_TK),
        ("bwd", "combine"): lambda: combine_b(y_ND, w_TK, dy_TD.astype(jnp.float32)),
        ("bwd", "gmm down dlhs"): lambda: dlhs(dy_ND, w_d, gs),
        ("bwd", "gmm down drhs"): lambda: drhs(h_NF, dy_ND, gs),
        ("bwd", "swiglu"): lambda: swiglu_b(g_NF, u_NF, dh_NF),
        ("bwd", "gmm gate dlhs"): lambda: dlhs(dg_NF, w_g, gs),
        ("bwd", "gmm gate drhs"): lambda: drhs(x_ND, dg_NF, gs),
        ("bwd", "gmm up dlhs"): lambda: dlhs(du_NF, w_u, gs),
        ("bwd", "gmm up drhs"): lambda: drhs(x_ND, du_NF, gs),
        ("bwd", "gather"): lambda: gather_b(x_TD.astype(dt), x_ND),
        ("bwd", "router"): lambda: router_b(x_TD, r["w_DE"], w_TK),
    }
    if runs_fused(dt):
        gate_up_j, swiglu_dlhs_j, dual_dlhs_j = (jax.jit(fn) for fn in (
            native.gate_up_swiglu, native.swiglu_dlhs, native.dual_dlhs))
        calls[("fwd", "fused gate+up+swiglu")] = lambda: gate_up_j(x_ND, w_g, w_u, gs)
        calls[("bwd", "fused down dlhs+swiglu")] = lambda: swiglu_dlhs_j(dy_ND, w_d, g_NF,
                                                                         u_NF, gs)
        calls[("bwd", "fused gate+up dlhs")] = lambda: dual_dlhs_j(dg_NF, w_g, du_NF, w_u, gs)
    if cfg.num_shared_experts > 0:
        sh = params["shared"]
        sh_f = jax.jit(lambda s, x: swiglu_ffn(s, x, dt))
        sh_b = vjp_of(lambda s, x: swiglu_ffn(s, x, dt), sh, x_TD)
        calls[("fwd", "shared expert")] = lambda: sh_f(sh, x_TD)
        calls[("bwd", "shared expert")] = lambda: sh_b(sh, x_TD, dy_TD.astype(jnp.float32))
    return calls


def profile_case(t: int, d: int, f: int, e: int, k: int, *, dtype: str = "float32",
                 shared_experts: int = 0, repeats: int = 5, rates: dict[str, float] | None = None,
                 seed: int = 0) -> list[dict[str, Any]]:
    """Time every part of the dropless layer (`auto`'s CPU kernels, unfused weights) and the whole
    layer, interleaved; one record per part with its FLOPs, bytes, limit and `x_limit`, then
    one per phase with the parts' sum and the whole layer's time. `rates` (from
    `measure_rates`) are measured here when None."""
    cfg = MoEConfig(num_experts=e, top_k=k, d_model=d, d_ff=f, dtype=dtype, weight_dtype=dtype,
                    score_func="softmax", num_shared_experts=shared_experts, gmm_backend="auto")
    params = moe.init_params(jax.random.key(seed), cfg)
    x_TD = jax.random.normal(jax.random.key(seed + 1), (t, d), jnp.dtype(dtype))
    dy_TD = jax.random.normal(jax.random.key(seed + 2), (t, d), jnp.dtype(dtype))
    rates = rates or measure_rates(t * k, d, f, dtype)
    calls = _parts(params, x_TD, dy_TD, cfg)
    layer_f, layer_fb = (jax.jit(fn) for fn in
                         dense.fwd_and_fwd_bwd(lambda p, x: moe.apply(p, x, cfg)[0]))
    timed = {f"{ph}/{nm}": fn for (ph, nm), fn in calls.items()}
    timed["layer/fwd"] = lambda: layer_f(params, x_TD)
    timed["layer/fwd+bwd"] = lambda: layer_fb(params, x_TD, dy_TD)
    stats = machine.time_interleaved(timed, repeats=repeats)
    costs = {key: c for key, c in
             part_costs(t, d, f, e, k, jnp.dtype(dtype).itemsize, shared_experts * f).items()
             if key in calls}
    fused = runs_fused(dtype)
    replaced = {(ph, r) for (ph, _), rs in FUSED_PARTS.items() for r in rs} if fused else set()
    base = {"bench": "moe", "mode": "profile", "tokens": t, "d_model": d, "d_ff": f,
            "experts": e, "top_k": k, "dtype": dtype, "shared_experts": shared_experts,
            "gmm_backend": cpu_kernels(dtype)[0], "fused_ffn": fused,
            "dense_gflops": rates["dense_flops"] / 1e9,
            **{k.replace("flops", "gflops"): v / 1e9 for k, v in rates.items()
               if k.startswith("dense_flops_")},
            "bandwidth_gbs": rates["bandwidth"] / 1e9}
    records, limit_of, sum_of = [], {"fwd": 0.0, "bwd": 0.0}, {"fwd": 0.0, "bwd": 0.0}
    for (ph, nm), (fl, by) in costs.items():
        ms = stats[f"{ph}/{nm}"]["median_ms"]
        lim_ms = max(fl / rates["dense_flops"], by / rates["bandwidth"]) * 1e3
        in_layer = (ph, nm) not in replaced
        if in_layer:
            limit_of[ph] += lim_ms
            sum_of[ph] += ms
        records.append(dict(base, phase=ph, part=nm, median_ms=ms, in_layer=in_layer,
                            min_ms=stats[f"{ph}/{nm}"]["min_ms"], flops=fl, bytes=by,
                            limit_ms=lim_ms, x_limit=ms / lim_ms,
                            limited_by="flops" if fl / rates["dense_flops"] >=
                            by / rates["bandwidth"] else "bytes"))
    whole = {"fwd": stats["layer/fwd"]["median_ms"], "fwd+bwd": stats["layer/fwd+bwd"]["median_ms"]}
    for ph, parts_ms, lim in (("fwd", sum_of["fwd"], limit_of["fwd"]),
                              ("fwd+bwd", sum_of["fwd"] + sum_of["bwd"],
                               limit_of["fwd"] + limit_of["bwd"])):
        records.append(dict(base, phase=ph, part="(sum of parts)", median_ms=parts_ms,
                            limit_ms=lim, x_limit=parts_ms / lim, layer_ms=whole[ph],
                            layer_x_limit=whole[ph] / lim))
    return records


def layer_limit_ms(t: int, d: int, f: int, e: int, k: int, rates: dict[str, float],
                   itemsize: int = 4) -> dict[str, float]:
    """{"fwd", "fwd+bwd"}: the layer's modeled limit in ms, the sum of its unfused parts' limits
    (the same bound whichever kernels run: a fused kernel's FLOPs are its parts')."""
    out = {"fwd": 0.0, "bwd": 0.0}
    for (ph, nm), (fl, by) in part_costs(t, d, f, e, k, itemsize).items():
        if (ph, nm) in FUSED_PARTS:
            continue
        out[ph] += max(fl / rates["dense_flops"], by / rates["bandwidth"]) * 1e3
    return {"fwd": out["fwd"], "fwd+bwd": out["fwd"] + out["bwd"]}

