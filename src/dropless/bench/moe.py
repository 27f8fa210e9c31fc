"""`dropless bench moe`: the MoE layer as a ratio to a dense SwiGLU FFN over the same rows.

Legend: T tokens, D model dim, F expert hidden dim, E experts, K top-k, N = T*K routed rows.

The dense equivalent of an MoE layer is one SwiGLU FFN of width F over all N = T*K routed rows:
the same useful FLOPs. The layer (router, sort, three grouped matmuls, unsort, combine) is timed
alternately with it, forward and forward+backward, dropless with each backend and the capacity
baseline at several capacity factors (reporting how many rows it dropped). Forward+backward
returns the output and every gradient; the dense FFN's backward runs on the input dtype
(bench/dense.py), as the grouped kernels' does.

`vs_torch` runs the side-by-side instead (`run_peer`): per case (T, E, K, D, F) the dropless layer,
its expert FFN alone on expert-major rows (`jax/experts`) and JAX's dense SwiGLU over the same
rows, beside PyTorch's Hugging Face Mixtral block on `_grouped_mm`, the raw `_grouped_mm` FFN
and torch's dense SwiGLU (bench/moe_torch.py), all six in ONE round-robin, forward and
forward+backward. Each side is reported as a ratio to its own dense, and the sides as
`torch_over_dropless` (> 1: dropless is faster); each layer record carries the modeled limit
(`bound_ms`, bench/moe_profile.py) and how far the layer is from it. `profile` adds the
per-part profile of every case (moe_profile.profile_case).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from dropless import machine, moe, text_table
from dropless.config import MoEConfig
from dropless.moe.experts import expert_ffn
from dropless.bench import dense, harness, moe_profile
from dropless.ops import native, resolve_backend
from dropless.ops.gmm.aliases import canonical_backend


def _router_bias(routing: str, e: int, seed: int) -> np.ndarray:
    """A selection bias that makes the learned-looking router uniform or Zipf-skewed."""
    if routing == "uniform":
        return np.zeros(e, np.float32)
    if routing == "zipf":
        p = 1.0 / np.arange(1, e + 1) ** 1.2
        return np.random.default_rng(seed).permutation(np.log(p / p.sum())).astype(np.float32)
    raise ValueError(f"routing={routing!r} is not one of ('uniform', 'zipf')")


def _case(t, d, f, e, k, routing, dtype, backends, cfs, repeats, budget_s, fused=True):
    cfg = MoEConfig(num_experts=e, top_k=k, d_model=d, d_ff=f, dtype=dtype, weight_dtype=dtype,
                    score_func="softmax")
    params = moe.init_params(jax.random.key(e), cfg)
    # a selection bias big enough to dominate random logits gives the named skew
    params["router"]["bias_E"] = jnp.asarray(_router_bias(routing, e, e)) * 0.1
    dt = jnp.dtype(dtype)
    x = jax.random.normal(jax.random.key(1), (t, d), dt)
    dy = jax.random.normal(jax.random.key(2), (t, d), dt)
    n = t * k
    xd = jax.random.normal(jax.random.key(3), (n, d), dt)
    dyd = jax.random.normal(jax.random.key(4), (n, d), dt)
    ex = params["experts"]
    wd = (ex["w_gate_EDF"][0], ex["w_up_EDF"][0], ex["w_down_EFD"][0])

    dense_f, dense_b = (jax.jit(f) for f in dense.fwd_and_fwd_bwd(dense.swiglu))
    fns_f = {"dense": lambda: dense_f(xd, *wd)}
    fns_b = {"dense": lambda: dense_b(xd, *wd, dyd)}
    variants = {}
    for b in backends:
        variants[f"dropless/{b}"] = cfg.replace(gmm_backend=b)
        if fused:   # prefuse_moe_weights: one [E, D, 2F] gate+up grouped matmul
            variants[f"fused/{b}"] = cfg.replace(gmm_backend=b, prefuse_moe_weights=True)
    for cf in cfs:
        variants[f"capacity/{cf:g}"] = cfg.replace(capacity_factor=cf)
    fused_params = moe.fuse_expert_weights(params)
    params_of = {nm: fused_params if c.prefuse_moe_weights else params
                 for nm, c in variants.items()}
    fwd_of = {}
    for name, c in variants.items():
        fwd = fwd_of[name] = jax.jit(lambda p, x, c=c: moe.apply(p, x, c))
        fb = jax.jit(dense.fwd_and_fwd_bwd(lambda p, x, c=c: moe.apply(p, x, c)[0])[1])
        fns_f[name] = lambda fwd=fwd, p=params_of[name]: fwd(p, x)
        fns_b[name] = lambda fb=fb, p=params_of[name]: fb(p, x, dy)

    dense_s = machine.time_interleaved({"d": fns_b["dense"]}, repeats=1)["d"]["median_ms"] / 1e3
    records = []
    for mode, fns in (("fwd", fns_f), ("fwd+bwd", fns_b)):
        work = {nm: (e if nm.endswith("ragged_dot") and jax.default_backend() == "cpu" else 1)
                for nm in fns}
        run_now = {nm: fn for nm, fn in fns.items()
                   if work[nm] * dense_s * (repeats + 1) <= budget_s or nm == "dense"}
        # dense and the first variant in one round-robin; every other variant in its own
        # (dense, variant) round-robin
        core = [nm for nm in ("dense", f"dropless/{backends[0]}") if nm in run_now]
        stats, base_of = harness.time_against_baseline(run_now, core, repeats=repeats)
        for nm in fns:
            rec = {"bench": "moe", "mode": mode, "variant": nm, "tokens": t, "d_model": d,
                   "d_ff": f, "experts": e, "top_k": k, "routed_rows": n, "routing": routing,
                   "dtype": dtype}
            if nm in stats:
                rec.update(stats[nm], dense_ms=base_of[nm],
                           ratio_to_dense=stats[nm]["median_ms"] / base_of[nm])
            else:
                rec["skipped"] = f"estimated {work[nm] * dense_s:.1f}s/call > budget"
            if nm in variants and mode == "fwd":
                # the timed (compiled) forward's aux: an eager apply would compile op by op
                _, aux = fwd_of[nm](params_of[nm], x)
                rec["dropped_rows"] = int(aux["dropped_tokens"])
                rec["drop_rate"] = int(aux["dropped_tokens"]) / n
                load = np.asarray(aux["tokens_per_expert"])
                rec["max_over_mean_load"] = float(load.max() / load.mean())
            if nm.startswith(("dropless/", "fused/")):
                rec["resolved"] = resolve_backend(nm.split("/", 1)[1])
            records.append(rec)
    return records


# the side-by-side's cases (tokens, experts, top_k, d_model, d_ff): three shapes of 8 to 64
# experts, then DeepSeek-V3's 256 experts top-8 at a small width, 32 rows an expert
# (bytes-limited)
PEER_CASES = ((4096, 8, 2, 512, 1024), (4096, 16, 2, 512, 1024), (2048, 64, 8, 512, 1024),
              (1024, 256, 8, 512, 128))


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEOptions:
    """What `dropless bench moe` runs: routed rows N = T*K, D and F, the cases (every (E, K)
    pair x routing x dtype), the grouped-matmul backends of the dropless layer (the first shares
    dense's round-robin), the capacity baseline's factors (empty: none), `fused` (also the
    prefuse_moe_weights rows, fused/<backend>), timed runs per function, the budget in seconds
    past which a variant is skipped, `quick` (the smoke-run sizes, `quick_sized`), `vs_torch`
    (the side-by-side with PyTorch over `cases`, (T, E, K, D, F) each, torch on
    `torch_threads` threads, None: every usable core), `profile` (the per-part profile of
    each case) and the JSON-lines file appended to (None: none)."""
    rows: int = 8192
    d_model: int = 1024
    d_ff: int = 1024
    experts: tuple[tuple[int, int], ...] = ((8, 2), (64, 8))
    routings: tuple[str, ...] = ("uniform", "zipf")
    dtypes: tuple[str, ...] = ("float32",)
    backends: tuple[str, ...] = ("auto", "ragged_dot")
    capacity_factors: tuple[float, ...] = (1.0, 1.25, 2.0)
    fused: bool = True
    repeats: int = 5
    budget_s: float = 60.0
    quick: bool = False
    vs_torch: bool = False
    profile: bool = False
    cases: tuple[tuple[int, int, int, int, int], ...] = PEER_CASES
    torch_threads: int | None = None
    out: str | None = None

    def quick_sized(self) -> "MoEOptions":
        """The smoke run: 2048 rows, D=F=256, E:K=8:2, uniform, 3 repeats (side by side: one
        512-token 8:2 case at D=F=128)."""
        return dataclasses.replace(self, rows=2048, d_model=256, d_ff=256, repeats=3,
                                   experts=((8, 2),), routings=("uniform",),
                                   cases=((512, 8, 2, 128, 128),))


def run(args: MoEOptions) -> int:
    """Time every case of `args`, printing a table per case and appending the records to
    `args.out`. Returns 0."""
    if args.vs_torch or args.profile:
        return run_peer(args)
    args, info, busy = harness.start(args)
    for dtype in args.dtypes:
        for e, k in args.experts:
            for routing in args.routings:
                t = math.ceil(args.rows / k)
                recs = _case(t, args.d_model, args.d_ff, e, k, routing, dtype,
                             [canonical_backend(b) for b in args.backends],
                             list(args.capacity_factors), args.repeats,
                             args.budget_s, fused=args.fused)
                after = machine.busy_fraction(0.2)
                for r in recs:
                    r.update(machine=info, busy_before=busy, busy_after=after)
                harness.write_jsonl(args.out, recs)
                busy = after
                print(text_table.format_table(recs, ["dtype", "experts", "top_k", "routing", "mode",
                                                  "variant", "median_ms", "ratio_to_dense",
                                                  "drop_rate", "skipped"]), flush=True)
    return 0


PEER_COLUMNS = ["tokens", "experts", "top_k", "dtype", "mode", "variant", "median_ms",
                "ratio_to_dense", "torch_over_dropless", "bound_ms", "x_bound"]
PROFILE_COLUMNS = ["phase", "part", "in_layer", "median_ms", "limit_ms", "x_limit", "limited_by",
                   "layer_ms"]


def _peer_case(torch, t, e, k, d, f, routing, dtype, repeats, rates):
    """One side-by-side case: the six functions in one round-robin, per mode, every operand
    (weights, activations, cotangents) in `dtype` on both sides. The layer's modeled bound
    (`bound_ms`) is given in float32 only: the measured rates are float32's."""
    from dropless.bench import moe_torch
    cfg = MoEConfig(num_experts=e, top_k=k, d_model=d, d_ff=f, dtype=dtype,
                    weight_dtype=dtype, score_func="softmax", norm_topk_prob=True)
    params = moe.init_params(jax.random.key(e), cfg)
    params["router"]["bias_E"] = jnp.asarray(_router_bias(routing, e, e)) * 0.1
    n = t * k
    x, dy = (jax.random.normal(jax.random.key(i), (t, d), dtype) for i in (1, 2))
    xd, dyd = (jax.random.normal(jax.random.key(i), (n, d), dtype) for i in (3, 4))
    layer = lambda p, x: moe.apply(p, x, cfg)[0]
    layer_f, layer_b = (jax.jit(fn) for fn in dense.fwd_and_fwd_bwd(layer))
    sizes_E = np.asarray(jax.jit(lambda p, x: moe.apply(p, x, cfg)[1])(params, x)
                         ["tokens_per_expert"])
    gs = jnp.asarray(sizes_E)
    ex = params["experts"]
    ffn = lambda ex, x: expert_ffn(x, gs, ex, cfg)
    ffn_f, ffn_b = (jax.jit(fn) for fn in dense.fwd_and_fwd_bwd(ffn))
    wd = (ex["w_gate_EDF"][0], ex["w_up_EDF"][0], ex["w_down_EFD"][0])
    dense_f, dense_b = (jax.jit(fn) for fn in dense.fwd_and_fwd_bwd(dense.swiglu))
    host = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float32), params)
    t_f, t_b = moe_torch.timed_fns(torch, host, *(np.asarray(a, np.float32)
                                                  for a in (x, dy, xd, dyd)), sizes_E, k, dtype)
    fns = {"fwd": {"jax/dense": lambda: dense_f(xd, *wd),
                   "dropless/auto": lambda: layer_f(params, x),
                   "jax/experts": lambda: ffn_f(ex, xd), **t_f},
           "fwd+bwd": {"jax/dense": lambda: dense_b(xd, *wd, dyd),
                       "dropless/auto": lambda: layer_b(params, x, dy),
                       "jax/experts": lambda: ffn_b(ex, xd, dyd), **t_b}}
    y_jax = np.asarray(layer_f(params, x), np.float32)
    y_torch = t_f["torch/hf_mixtral"]().float().numpy()
    out_diff = float(np.abs(y_jax - y_torch).max() / np.abs(y_jax).max())
    bound = moe_profile.layer_limit_ms(t, d, f, e, k, rates)
    records = []
    for mode, group in fns.items():
        st = machine.time_interleaved(group, repeats=repeats)
        med = {nm: s["median_ms"] for nm, s in st.items()}
        for nm, s in st.items():
            own_dense = med["torch/dense" if nm.startswith("torch/") else "jax/dense"]
            rec = {"bench": "moe", "mode": mode, "variant": nm, "tokens": t, "d_model": d,
                   "d_ff": f, "experts": e, "top_k": k, "routed_rows": n, "routing": routing,
                   "dtype": dtype, "max_over_mean_load": float(sizes_E.max() / sizes_E.mean()),
                   **s, "ratio_to_dense": s["median_ms"] / own_dense}
            peer = {"dropless/auto": "torch/hf_mixtral", "jax/experts": "torch/grouped_mm",
                    "jax/dense": "torch/dense"}.get(nm)
            if peer:
                rec["torch_over_dropless"] = med[peer] / s["median_ms"]
            if nm == "dropless/auto":
                rec["out_rel_diff_vs_torch"] = out_diff
                if dtype == "float32":
                    rec.update(bound_ms=bound[mode], x_bound=s["median_ms"] / bound[mode])
            records.append(rec)
    return records


def run_peer(args: MoEOptions) -> int:
    """The side-by-side with PyTorch (`args.vs_torch`) and/or the per-part profile
    (`args.profile`) of every case in `args.cases`; records appended to `args.out`, a table
    per case printed. Raises ValueError naming the extra when torch is asked for and absent."""
    torch = None
    if args.vs_torch:
        from dropless.bench import moe_torch
        torch = moe_torch.require_torch()
    args, info, busy = harness.start(args)
    extra = dict(native.describe())
    if torch is not None:
        extra.update(torch=torch.__version__,
                     torch_threads=moe_torch.set_threads(torch, args.torch_threads))
    for t, e, k, d, f in args.cases:
        rates = moe_profile.measure_rates(t * k, d, f)
        rate_rec = {k.replace("flops", "gflops"): v / 1e9 for k, v in rates.items()
                    if k.startswith("dense_flops")}
        rate_rec["bandwidth_gbs"] = rates["bandwidth"] / 1e9
        recs = []
        if torch is not None:
            for dtype in args.dtypes:
                for routing in args.routings:
                    recs += _peer_case(torch, t, e, k, d, f, routing, dtype, args.repeats,
                                       rates)
        if args.profile:
            recs += moe_profile.profile_case(t, d, f, e, k, repeats=args.repeats, rates=rates)
        after = machine.busy_fraction(0.2)
        for r in recs:
            r.update(machine=info, busy_before=busy, busy_after=after, **rate_rec, **extra)
        harness.write_jsonl(args.out, recs)
        busy = after
        print(f"# {t} tokens, {e} experts top-{k}, D={d} F={f}: dense "
              f"{rate_rec['dense_gflops']:.0f} GFLOP/s, {rate_rec['bandwidth_gbs']:.1f} GB/s; "
              f"others' load after: {after}", flush=True)
        for cols, kind in ((PEER_COLUMNS, lambda r: r["mode"] != "profile"),
                           (PROFILE_COLUMNS, lambda r: r["mode"] == "profile")):
            rows = [r for r in recs if kind(r)]
            if rows:
                print(text_table.format_table(rows, cols), flush=True)
    return 0
