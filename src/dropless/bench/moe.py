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

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from dropless import machine, moe, text_table
from dropless.config import MoEConfig
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEOptions:
    """What `dropless bench moe` runs: routed rows N = T*K, D and F, the cases (every (E, K)
    pair x routing x dtype), the grouped-matmul backends of the dropless layer (the first shares
    dense's round-robin), the capacity baseline's factors (empty: none), `fused` (also the
    prefuse_moe_weights rows, fused/<backend>), timed runs per function, the budget in seconds
    past which a variant is skipped, `quick` (the smoke-run sizes, `quick_sized`) and the
    JSON-lines file appended to (None: none)."""
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
    out: str | None = None

    def quick_sized(self) -> "MoEOptions":
        """The smoke run: 2048 rows, D=F=256, E:K=8:2, uniform, 3 repeats."""
        return dataclasses.replace(self, rows=2048, d_model=256, d_ff=256, repeats=3,
                                   experts=((8, 2),), routings=("uniform",))


def run(args: MoEOptions) -> int:
    """Time every case of `args`, printing a table per case and appending the records to
    `args.out`. Returns 0."""
    args, info, busy = harness.start(args)
    for dtype in args.dtypes:
        for e, k in args.experts:
            for routing in args.routings:
                t = math.ceil(args.rows / k)
                recs = _case(t, args.d_model, args.d_ff, e, k, routing, dtype,
                             list(args.backends), list(args.capacity_factors), args.repeats,
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
