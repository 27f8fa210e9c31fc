"""`dropless bench gmm`: every grouped-matmul backend as a ratio to a dense matmul of equal FLOPs.

Legend: M routed rows, K contraction dim, N output dim, G groups (experts).

The dense equivalent of a grouped matmul over M rows is one [M, K] @ [K, N] matmul: the same
useful FLOPs. Each case times the dense matmul and every backend alternately in one process,
forward and forward+backward (the output and the gradients of lhs and rhs), and reports median
ratios. The dense matmul's backward is written out on the input dtype (see bench/dense.py).
On uniform routing a `split_floor` row times the grouped problem's dot shapes alone (equal
chunks, one weight in cache, nothing ragged): what a kernel made of one XLA dot per group
cannot beat. Baselines that do G times the work (ragged_dot on CPU, padding to capacity) are
skipped when their estimated time exceeds `--budget-s`, and the skip is reported, not hidden.

Each case also prints (and writes, as a `mode: "model"` record) `pallas_gpu`'s cost model from
`ops/gpu/pallas_plan.py`, computed from the case's own group sizes: rows computed per useful
row, modeled HBM bytes per useful FLOP and lhs reads of the forward, drhs bytes per FLOP and
its makespan against a perfect split, before (bm-aligned tiles, bm=128, work items fastest,
drhs groups fastest) and after (this kernel). A model, not a measurement; `--model-only`
prints it (and writes it to `--out`) without timing anything; timed runs print it only.

`--model-only` also counts the row tiles of aligned expert segments at the shapes table
(`ops.gmm.shapes`, each shape x routing): a kernel whose tiles lie on one grid over the rows
(tokamax's and jax's ragged_dot_mgpu, pallas_gpu) computes every tile each group touches, at
most cdiv(M, bm) + G - 1; with each segment starting at a multiple of bm
(`MoEConfig.align_expert_rows`) it computes sum_g cdiv(s_g, bm), at the cost of the zero rows
that pad each segment (`mode: "align_model"` records). Beside them, `pallas_gpu`'s grid as it
runs (`pallas_plan.row_tiles_as_run`): rows launched per useful row by its work list over the M
rows, and by its aligned grid over the aligned layout's P rows (`permute.aligned_rows`).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from dropless import machine, text_table
from dropless.bench import dense, harness
from dropless.moe.permute import aligned_rows
from dropless.ops import grouped_matmul, native, padding_stats, resolve_backend
from dropless.ops.gmm import shapes
from dropless.ops.gmm.aliases import canonical_backend
from dropless.ops.gpu import pallas_plan

ROUTINGS = shapes.ROUTING_PATTERNS
PADDED_MEMORY_LIMIT = 6 * 2**30  # bytes of padded operands we allow the padded baseline


def group_sizes_for(routing: str, m: int, g: int, seed: int = 0) -> np.ndarray:
    """Rows per group for a named routing pattern (host-side; the kernels never see this):
    `ops.gmm.shapes.group_sizes`."""
    return shapes.group_sizes(routing, m, g, seed)


def split_backend(name: str) -> tuple[str, str | None]:
    """A --backends entry as (registry backend, native kernel or None): "native:own" and
    "native:openblas" run the `native` backend on that kernel of its library
    (`native.use_kernel`), so both are timed in one process (an old backend name, such as
    "openblas:own", is its new one). Raises ValueError naming the entry for a suffix on another
    backend or an unknown kernel."""
    base, colon, kernel = name.partition(":")
    if not colon:
        return name, None
    if resolve_backend(base) != "native" or kernel not in native.KERNEL_CHOICES:
        raise ValueError(f"--backends {name!r}: a ':kernel' suffix goes on native only, one of "
                         f"{', '.join('native:' + c for c in native.KERNEL_CHOICES)}")
    return canonical_backend(base), kernel


def canonical_entry(name: str) -> str:
    """A --backends entry with its backend under its current name ("openblas:own" ->
    "native:own"; others unchanged): what the records and tables show."""
    base, colon, kernel = name.partition(":")
    return canonical_backend(base) + colon + kernel


def _with_kernel(fn, kernel: str):
    """fn run to completion on the native library's `kernel` (the library reads its choice when
    a call runs, so the result is waited for before the choice is put back)."""
    def run(*args):
        with native.use_kernel(kernel):
            return jax.block_until_ready(fn(*args))
    return run


def _case(m, k, n, g, routing, dtype, backends, repeats, budget_s, seed):
    rng = np.random.default_rng(seed)
    dt = jnp.dtype(dtype)
    lhs = jnp.asarray(rng.standard_normal((m, k)), dt)
    rhs = jnp.asarray(rng.standard_normal((g, k, n)) / math.sqrt(k), dt)
    dy = jnp.asarray(rng.standard_normal((m, n)), dt)
    sizes = group_sizes_for(routing, m, g, seed)
    gs = jnp.asarray(sizes)
    cap = int(sizes.max())

    dense_fwd, dense_fb = dense.fwd_and_fwd_bwd(dense.matmul)
    dense_fwd, dense_fb = jax.jit(dense_fwd), jax.jit(dense_fb)
    w0 = rhs[0]
    fns_f = {"dense": lambda: dense_fwd(lhs, w0)}
    fns_b = {"dense": lambda: dense_fb(lhs, w0, dy)}
    # estimated cost relative to dense, to budget the slow baselines. 'loop' dispatches G eager
    # matmuls (forward: about G/32 dense calls here) and differentiates them eagerly, compiling
    # per group shape (measured fwd+bwd: 3x dense at G=8, 35-53x at G=64, 470-670x at G=256)
    work = {"ragged_dot": float(g) if jax.default_backend() == "cpu" else 1.0,
            "padded": g * cap / m, "reference": float(g), "loop": max(1.0, g / 32)}
    work_fb = dict(work, loop=max(1.0, g * g / 100))
    resolved_of = {}
    for name in backends:
        base, kernel = split_backend(name)
        resolved = resolve_backend(base)
        opts = {"capacity": cap} if resolved == "padded" else {}
        f = lambda a, b, resolved=resolved, opts=opts: grouped_matmul(
            a, b, gs, backend=resolved, preferred_element_type=dt, **opts)
        fwd, fb = dense.fwd_and_fwd_bwd(f)
        if resolved != "loop":
            fwd, fb = jax.jit(fwd), jax.jit(fb)
        if kernel is not None:
            fwd, fb = _with_kernel(fwd, kernel), _with_kernel(fb, kernel)
        fns_f[name] = lambda fwd=fwd: fwd(lhs, rhs)
        fns_b[name] = lambda fb=fb: fb(lhs, rhs, dy)
        resolved_of[name] = resolved
    if routing == "uniform" and m % g == 0:  # the shapes' own cost: see dense.split_floor
        floor_f, floor_fb = (jax.jit(f) for f in dense.split_floor(g))
        fns_f["split_floor"] = lambda: floor_f(lhs, w0)
        fns_b["split_floor"] = lambda: floor_fb(lhs, w0, dy)
    # estimate from one dense call: skip baselines whose G-fold work would blow the budget
    dense_s = machine.time_interleaved({"d": fns_b["dense"]}, repeats=1)["d"]["median_ms"] / 1e3
    records = []
    for mode, fns in (("fwd", fns_f), ("fwd+bwd", fns_b)):
        est = work_fb if mode == "fwd+bwd" else work
        est_s = {nm: est.get(resolved_of.get(nm, nm), 1.0) * dense_s
                 for nm in fns}
        cheap = {nm: f for nm, f in fns.items() if est_s[nm] * (repeats + 1) <= budget_s}
        if g * cap * (k + n) * lhs.dtype.itemsize * 3 > PADDED_MEMORY_LIMIT:
            est_s["padded"] = float("inf")  # [G, C, K] operands would not fit in memory here
            cheap.pop("padded", None)
        # the kernel under test (the first backend named) and the floor share a round-robin with
        # dense; every other baseline gets its own (dense, baseline) round-robin
        core = [nm for nm in ("dense", backends[0], "split_floor") if nm in cheap]
        stats, base_of = harness.time_against_baseline(cheap, core, repeats=repeats)
        base_of = {nm: base_of.get(nm, stats["dense"]["median_ms"]) for nm in fns}
        for nm, fn in fns.items():  # G-fold baselines: as many runs as the budget allows
            if nm not in cheap and 2 * est_s[nm] <= budget_s:
                n_runs = max(1, min(repeats, int(budget_s / est_s[nm]) - 1))
                stats[nm] = machine.time_interleaved({nm: fn}, repeats=n_runs)[nm]
                stats[nm].update(interleaved=False, runs=n_runs)
        for name in fns:
            rec = {"bench": "gmm", "mode": mode, "backend": name,
                   "resolved": resolved_of.get(name, name),
                   "m": m, "k": k, "n": n, "groups": g, "routing": routing, "dtype": dtype,
                   "max_group": cap, "empty_groups": int((sizes == 0).sum())}
            if name in stats:
                rec.update(stats[name], dense_ms=base_of[name],
                           ratio_to_dense=stats[name]["median_ms"] / base_of[name])
            else:
                rec.update(skipped="padded operands exceed memory limit" if est_s[name] ==
                           float("inf") else f"estimated {est_s[name]:.0f}s/call > budget/2")
            if rec["resolved"] == "padded":
                rec["padding"] = padding_stats(sizes, cap)
            records.append(rec)
    return records


MODEL_COLUMNS = ["dtype", "groups", "routing", "block_m", "rows_before", "rows_after",
                 "fwd_B_per_flop_before", "fwd_B_per_flop_after", "lhs_reads_before",
                 "lhs_reads_after", "drhs_B_per_flop_before", "drhs_B_per_flop_after",
                 "drhs_makespan_before", "drhs_makespan_after"]


def model_record(m: int, k: int, n: int, g: int, routing: str, dtype: str, seed: int) -> dict:
    """pallas_gpu's modeled figures for one case (host-side, from the case's group sizes)."""
    sizes = group_sizes_for(routing, m, g, seed)
    fig = pallas_plan.model_figures(sizes, m, k, n, dtype)
    rec = {"bench": "gmm", "mode": "model", "backend": "pallas_gpu", "m": m, "k": k, "n": n,
           "groups": g, "routing": routing, "dtype": dtype, "block_m": fig["block_m"]}
    for key, short in (("rows_per_useful_row", "rows"), ("fwd_bytes_per_flop", "fwd_B_per_flop"),
                       ("fwd_lhs_reads", "lhs_reads"), ("drhs_bytes_per_flop", "drhs_B_per_flop"),
                       ("drhs_makespan_vs_ideal", "drhs_makespan")):
        rec[f"{short}_before"], rec[f"{short}_after"] = fig[key]["before"], fig[key]["after"]
    return rec


ALIGN_BLOCK_M = 128   # the row block of the Hopper tile kernels (bm of tokamax's sm90 configs)
ALIGN_COLUMNS = ["shape", "routing", "m", "groups", "block_m", "tiles_unaligned",
                 "tiles_bound", "tiles_aligned", "rows_per_row_unaligned",
                 "rows_per_row_aligned", "padded_rows", "padded_row_fraction",
                 "pallas_launched_per_row_unaligned", "pallas_launched_per_row_aligned"]


def row_tiles(sizes_G, bm: int) -> dict:
    """Row tiles of one grouped product: unaligned (one grid over the sorted rows; a tile is
    computed once for each group it touches), its bound cdiv(M, bm) + G - 1, and aligned
    (segments start at multiples of bm: sum_g cdiv(s_g, bm)), with the zero rows aligning adds."""
    s = np.asarray(sizes_G, np.int64)
    ends = np.cumsum(s)
    starts = ends - s
    touched = np.where(s > 0, (ends - 1) // bm - starts // bm + 1, 0)
    aligned = -(-s // bm)
    m = int(s.sum())
    return {"tiles_unaligned": int(touched.sum()), "tiles_bound": -(-m // bm) + len(s) - 1,
            "tiles_aligned": int(aligned.sum()), "padded_rows": int((aligned * bm - s).sum())}


def align_records(block_m: int = ALIGN_BLOCK_M, seed: int = 0) -> list[dict]:
    """`row_tiles` at every shape of the table (one record per distinct (model, M, G) and
    routing: the products of one model share their rows), with the rows the tiles compute per
    useful row (tiles x bm / M) and the zero rows aligning adds per useful row."""
    out, seen = [], set()
    for sh in shapes.SHAPES:
        for routing in shapes.ROUTINGS:
            if (sh.model, sh.m, sh.g, routing) in seen:
                continue
            seen.add((sh.model, sh.m, sh.g, routing))
            sizes = shapes.group_sizes(routing, sh.m, sh.g, seed)
            t = row_tiles(sizes, block_m)
            rec = {"bench": "gmm", "mode": "align_model", "shape": sh.model if sh.model != "small"
                   else sh.label, "routing": routing, "m": sh.m, "groups": sh.g,
                   "block_m": block_m, **t,
                   "rows_per_row_unaligned": t["tiles_unaligned"] * block_m / sh.m,
                   "rows_per_row_aligned": t["tiles_aligned"] * block_m / sh.m,
                   "padded_row_fraction": t["padded_rows"] / sh.m}
            plain = pallas_plan.row_tiles_as_run(sizes, sh.m, "bfloat16")
            lay = pallas_plan.row_tiles_as_run(
                -(-sizes // block_m) * block_m, aligned_rows(sh.m, sh.g, block_m), "bfloat16",
                align=block_m)
            for name, fig in (("unaligned", plain), ("aligned", lay)):
                rec[f"pallas_launched_per_row_{name}"] = \
                    fig["tiles_launched"] * fig["block_m"] / sh.m
            out.append(rec)
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class GmmOptions:
    """What `dropless bench gmm` runs: the problem (M, K, N), the cases (every G x routing x
    dtype), the backends timed beside dense (the first is the kernel under test), timed runs per
    function, the time budget per baseline and case in seconds, `quick` (the smoke-run sizes,
    `quick_sized`), `model_only` (pallas_gpu's cost model, nothing timed) and the JSON-lines
    file appended to (None: none)."""
    m: int = 8192
    k: int = 1024
    n: int = 1024
    groups: tuple[int, ...] = (8, 64, 256)
    routings: tuple[str, ...] = ROUTINGS
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    backends: tuple[str, ...] = ("auto", "ragged_dot", "padded", "loop")
    repeats: int = 5
    budget_s: float = 40.0
    quick: bool = False
    model_only: bool = False
    out: str | None = None

    def quick_sized(self) -> "GmmOptions":
        """The smoke run: M=2048, K=N=256, G=8,64, uniform+half, 3 repeats."""
        return dataclasses.replace(self, m=2048, k=256, n=256, repeats=3, groups=(8, 64),
                                   routings=("uniform", "half"))


def run(args: GmmOptions) -> int:
    """Time every case of `args` (or, with `model_only`, only model it), printing a table per
    case and appending the records to `args.out`. Returns 0."""
    bases = [split_backend(name)[0] for name in args.backends]   # a bad entry fails first
    args = dataclasses.replace(args, backends=tuple(map(canonical_entry, args.backends)))
    library = (native.describe() if "native" in map(resolve_backend, bases)
               and not args.model_only else {})
    args, info, busy = harness.start(args)
    rows = []
    for dtype in args.dtypes:
        for g in args.groups:
            for routing in args.routings:
                model = model_record(args.m, args.k, args.n, g, routing, dtype, seed=g)
                if args.model_only:   # one table at the end
                    model.update(machine=info)
                    harness.write_jsonl(args.out, [model])
                    rows.append(model)
                    continue
                print(text_table.format_table([model], MODEL_COLUMNS), flush=True)
                recs = _case(args.m, args.k, args.n, g, routing, dtype,
                             list(args.backends), args.repeats, args.budget_s, seed=g)
                after = machine.busy_fraction(0.2)
                for r in recs:
                    r.update(machine=info, busy_before=busy, busy_after=after, **library)
                harness.write_jsonl(args.out, recs)
                rows += recs
                busy = after
                print(text_table.format_table(
                    [r for r in recs if r["backend"] != "dense"],
                    ["dtype", "groups", "routing", "mode", "backend", "resolved",
                     "median_ms", "ratio_to_dense", "skipped"]), flush=True)
    if args.model_only:
        print(text_table.format_table(rows, MODEL_COLUMNS))
        aligned = [dict(r, machine=info) for r in align_records()]
        harness.write_jsonl(args.out, aligned)
        print(text_table.format_table(aligned, ALIGN_COLUMNS))
    return 0
