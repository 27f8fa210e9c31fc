"""`dropless bench moe`: the MoE layer as a ratio to a dense SwiGLU FFN over the same rows.

Legend: T tokens, D model dim, F expert hidden dim, E experts, K top-k, N = T*K routed rows.

The dense equivalent of an MoE layer is one SwiGLU FFN of width F over all N = T*K routed rows:
the same useful FLOPs. The layer (router, sort, three grouped matmuls, unsort, combine) is timed
alternately with it, forward and forward+backward, dropless with each backend and the capacity
baseline at several capacity factors (reporting how many rows it dropped). Forward+backward
returns the output and every gradient; the dense FFN's backward runs on the input dtype
(bench/dense.py), as the grouped kernels' does.
"""
from __future__ import annotations

import argparse
import math

import jax
import jax.numpy as jnp
import numpy as np

from dropless import MoEConfig, machine, moe, text_table
from dropless.bench import dense, harness
from dropless.ops import resolve_backend


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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", type=int, default=8192, help="routed rows N = T*K (default 8192)")
    p.add_argument("--d-model", type=int, default=1024, help="D (default 1024)")
    p.add_argument("--d-ff", type=int, default=1024, help="expert hidden F (default 1024)")
    p.add_argument("--experts", default="8:2,64:8",
                   help="comma list of E:K pairs (default 8:2,64:8)")
    p.add_argument("--routings", default="uniform,zipf", help="uniform and/or zipf")
    p.add_argument("--dtypes", default="float32", help="comma list of dtypes")
    p.add_argument("--backends", default="auto,ragged_dot",
                   help="grouped-matmul backends for the dropless layer (default auto,ragged_dot)")
    p.add_argument("--capacity-factors", default="1.0,1.25,2.0",
                   help="capacity baseline factors (default 1.0,1.25,2.0; empty for none)")
    p.add_argument("--no-fused", action="store_true",
                   help="skip the prefuse_moe_weights rows (fused/<backend>)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--budget-s", type=float, default=60.0,
                   help="skip a variant whose estimated total time exceeds this (default 60)")
    p.add_argument("--quick", action="store_true",
                   help="small smoke run: 2048 rows, D=F=256, E:K=8:2, uniform, 3 repeats")
    p.add_argument("--out", default=None, help="append JSON lines here")


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.rows, args.d_model, args.d_ff, args.repeats = 2048, 256, 256, 3
        args.experts, args.routings = "8:2", "uniform"
    info = machine.machine_info()
    busy = machine.busy_fraction()
    print(f"# {info['cpu']} x{info['cores']}, jax {info['jax']}, {info['platform']}; "
          f"others' load before start: {busy}")
    cfs = [float(v) for v in args.capacity_factors.split(",") if v]
    for dtype in args.dtypes.split(","):
        for ek in args.experts.split(","):
            e, k = (int(v) for v in ek.split(":"))
            for routing in args.routings.split(","):
                t = math.ceil(args.rows / k)
                recs = _case(t, args.d_model, args.d_ff, e, k, routing, dtype,
                             args.backends.split(","), cfs, args.repeats, args.budget_s,
                             fused=not args.no_fused)
                after = machine.busy_fraction(0.2)
                for r in recs:
                    r.update(machine=info, busy_before=busy, busy_after=after)
                harness.write_jsonl(args.out, recs)
                busy = after
                print(text_table.format_table(recs, ["dtype", "experts", "top_k", "routing", "mode",
                                                  "variant", "median_ms", "ratio_to_dense",
                                                  "drop_rate", "skipped"]), flush=True)
    return 0
