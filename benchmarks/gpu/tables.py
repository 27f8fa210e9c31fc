"""Markdown tables of one device check: python benchmarks/gpu/tables.py [GPU_BENCH_JSONL];
its winner table: python benchmarks/gpu/tables.py winners GPU_BENCH_JSONL [--out PATH].

Legend: M routed rows, K contraction dim, N output dim, G groups (experts).

Prints what docs/gpu.md "Measured on one H200" shows, from the records `dropless bench gpu`
wrote (default benchmarks/results/gpu_h200.jsonl), never typed by hand: per shape of the shapes
table the records hold, the grouped-matmul times of every backend they hold (an aligned
variant as its own column) with each one's fraction of the same-process dense matmul (the one
measured with it, and the fastest dense of the same M x K x N in the run), the torch peer, the
targets, the MoE layer, the training run and MaxText's beside it, the tests and the sections'
seconds against the plan.
The backends and shapes come from the records; the first check's records (shapes G8, G64)
print their targets as they did (the README's GPU table). `winners` builds the table `auto`
reads on CUDA (ops/gmm/winners.json) with `winners.from_records`.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODES = ("fwd", "fwd+bwd")
# the grouped-matmul rows' order: both modes, then the backward's directions timed alone
GMM_MODES = MODES + ("dlhs", "drhs")
DENSE = "dense_xla"
PEERS = ("torch_grouped_mm", "torch_dense")
# fwd+bwd targets, as a fraction of the same run's dense (docs/gpu.md, "Targets"): per model of
# the shapes table, per shape label; the first check's shapes (G8, G64) had their own
TARGET_BY_MODEL = {"deepseek_v3_ep8": 0.85, "qwen3_30b_a3b": 0.85}
TARGET_BY_SHAPE = {"small/G64": 0.6, "G8": 0.7, "G64": 0.5}


def load(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def column(r: dict) -> str:
    """A grouped-matmul record's column: its backend, "aligned" added for aligned segments."""
    return r["backend"] + (" aligned" if r.get("aligned") else "")


def _gmm(recs: list[dict]) -> dict:
    """(shape, routing, mode, column) -> record, for every grouped-matmul record at a routing
    and mode: timed ("median_ms"), failed ("error") or skipped ("skipped")."""
    return {(r["shape"], r["routing"], r["mode"], column(r)): r for r in recs
            if r["section"] == "gmm" and "routing" in r and "mode" in r}


def gmm_columns(recs: list[dict]) -> list[str]:
    """The grouped-matmul columns the records hold (every backend the section measured, and
    its aligned variant where recorded), in the order the section ran them; dense and the torch
    peer apart."""
    cols: list[str] = []
    for r in recs:
        if r["section"] == "gmm" and "mode" in r and r["backend"] not in (DENSE, *PEERS) \
                and column(r) not in cols:
            cols.append(column(r))
    return cols


def gmm_shapes(recs: list[dict]) -> list[dict]:
    """The shapes the gmm section recorded at a routing, {"shape", "model", "m", "k", "n",
    "groups"}, in the shapes table's order (ops/gmm/shapes.py), then any other as recorded."""
    from dropless.ops.gmm import shapes as table
    seen: dict[str, dict] = {}
    for r in recs:
        if r["section"] == "gmm" and "routing" in r and r["shape"] not in seen:
            seen[r["shape"]] = {k: r.get(k) for k in ("shape", "model", "m", "k", "n", "groups")}
    order = [s.label for s in table.SHAPES]
    return sorted(seen.values(), key=lambda s: (order.index(s["shape"]) if s["shape"] in order
                                                else len(order)))


def _first_check(labels) -> bool:
    """The first device check's records: shapes G8, G64 (M=8192, K=N=1024), printed as then."""
    return all(re.fullmatch(r"G\d+", s) for s in labels)


def _ms(r: dict | None, dense: float | None, best: float | None) -> str:
    if r is None:
        return "-"
    if "median_ms" not in r:
        return "error" if "error" in r else "skipped"
    ms = r["median_ms"]
    ratios = "; ".join("?" if d is None else f"{d / ms:.2f}" for d in (dense, best))
    ran = f" ran {r['ran']}" if r.get("ran") not in (None, r["backend"]) else ""
    return f"{ms:.4f} ({ratios}){ran}"


def gmm_table(recs: list[dict]) -> str:
    """Per shape of the shapes table (a heading with its M, K, N, G, and the backends the
    section could not run there), per routing and mode: XLA's dense ms, each grouped-matmul
    column's ms with its fraction of that dense and of the fastest dense of the same M x K x N
    in the run ("error", "skipped", "-": not measured), and the torch peer's ms."""
    g, cols = _gmm(recs), gmm_columns(recs)
    dims = {s["shape"]: s for s in gmm_shapes(recs)}
    best: dict = {}
    for (shape, _, mode, col), r in g.items():
        if col == DENSE and "median_ms" in r:
            s = dims[shape]
            key = (s["m"], s["k"], s["n"], mode)
            best[key] = min(best.get(key, r["median_ms"]), r["median_ms"])
    out = []
    for s in dims.values():
        shape = s["shape"]
        out.append(f"{shape} (M={s['m']}, K={s['k']}, N={s['n']}, G={s['groups']})\n")
        gone = list(dict.fromkeys(  # one line a backend and reason, whatever the modes
            f"{r['backend']} ({r['skipped']})" for r in recs if r["section"] == "gmm"
            and r.get("shape") == shape and "skipped" in r and "routing" not in r))
        if gone:
            out.append("not measured: " + "; ".join(gone) + "\n")
        lines = ["| routing | mode | XLA dense ms | "
                 + "".join(f"{c} ms (of dense; of fastest dense) | " for c in cols)
                 + "torch._grouped_mm ms | torch.mm ms |", "|---" * (len(cols) + 5) + "|"]
        for routing, mode in sorted({k[1:3] for k in g if k[0] == shape},
                                    key=lambda k: (k[0], GMM_MODES.index(k[1]))):
            d = g.get((shape, routing, mode, DENSE), {})
            dense = d.get("median_ms")
            fastest = best.get((s["m"], s["k"], s["n"], mode))
            cells = [_ms(g.get((shape, routing, mode, c)), dense, fastest) for c in cols]
            peer = [g.get((shape, routing, mode, p)) for p in PEERS]
            cells += ["-" if r is None or "median_ms" not in r else f"{r['median_ms']:.4f}"
                      for r in peer]
            lines.append(f"| {routing} | {mode} | "
                         + ("-" if dense is None else f"{dense:.4f}") + " | "
                         + " | ".join(cells) + " |")
        out.append("\n".join(lines) + "\n")
    return "\n".join(out).rstrip("\n")


def target(shape: dict) -> float | None:
    """The fwd+bwd fraction of dense a shape's grouped matmul should reach (None: no target)."""
    return TARGET_BY_SHAPE.get(shape["shape"], TARGET_BY_MODEL.get(shape.get("model")))


def targets_table(recs: list[dict]) -> str:
    """fwd+bwd against the targets, every column at every shape that has a target: its
    fraction of the same-run dense, its speed against torch._grouped_mm (its forward alone
    beside it: torch's fwd+bwd carries autograd's overhead)."""
    g, cols, shapes = _gmm(recs), gmm_columns(recs), gmm_shapes(recs)
    first = _first_check(s["shape"] for s in shapes)
    lines = [f"| {'G' if first else 'shape'} | routing | backend | fraction of dense (target) | "
             "met | speed vs torch._grouped_mm (>= 1) | met | fwd alone: speed vs "
             "torch._grouped_mm |", "|---" * 8 + "|"]

    def ms(*key):
        r = g.get(key)
        return None if r is None else r.get("median_ms")
    for s in shapes:
        goal = target(s)
        if goal is None:
            continue
        shape = s["shape"]
        name = shape[1:] if first else shape
        for routing in sorted({k[1] for k in g if k[0] == shape}):
            dense = ms(shape, routing, "fwd+bwd", DENSE)
            peer = ms(shape, routing, "fwd+bwd", "torch_grouped_mm")
            peer_fwd = ms(shape, routing, "fwd", "torch_grouped_mm")
            for c in cols:
                t = ms(shape, routing, "fwd+bwd", c)
                if t is None:
                    continue
                frac = None if dense is None else dense / t
                speed = None if peer is None else peer / t
                fwd = ms(shape, routing, "fwd", c)
                lines.append(
                    f"| {name} | {routing} | {c} | "
                    + ("-" if frac is None else f"{frac:.2f}") + f" (>= {goal:.2f}) | "
                    + ("-" if frac is None else "yes" if frac >= goal else "no") + " | "
                    + ("-" if speed is None else f"{speed:.2f}") + " | "
                    + ("-" if speed is None else "yes" if speed >= 1 else "no") + " | "
                    + ("-" if peer_fwd is None or fwd is None else f"{peer_fwd / fwd:.2f}")
                    + " |")
    return "\n".join(lines)


def moe_table(recs: list[dict]) -> str:
    """The MoE layer (and, where recorded, with aligned segments) against the dense SwiGLU of
    the same rows, per case and mode; skipped units; units the first check did not reach."""
    lines = ["| E:K | routing | mode | dense SwiGLU ms | layer ms (ran) | layer / dense | "
             "compile s: dense, layer |", "|---" * 7 + "|"]
    moe = [r for r in recs if r["section"] == "moe"]

    def case(r):
        return (f"{r['experts']}:{r['top_k']}" + (f" {r['model']}" if r.get("model") else "")
                + (" aligned" if r.get("aligned") else ""))

    def same(x, r):
        return all(x.get(k) == r.get(k) for k in ("model", "experts", "top_k", "routing",
                                                   "mode", "aligned"))
    for r in moe:
        if r.get("variant") != "dropless/auto":
            continue
        d = next(x for x in moe if x.get("variant") == "dense" and same(x, r))
        lines.append(f"| {case(r)} | {r['routing']} | {r['mode']} | "
                     f"{d['median_ms']:.3f} | {r['median_ms']:.3f} ({r['ran']}) | "
                     f"{r['ratio_to_dense']:.3f} | {d['compile_ms'] / 1e3:.2f}, "
                     f"{r['compile_ms'] / 1e3:.1f} |")
    for r in moe:
        if "skipped" in r or "error" in r:
            what = f"skipped: {r['skipped']}" if "skipped" in r else f"error: {r['error']}"
            lines.append(f"| {case(r)} | {r['routing']} | {r['mode']} | {what} | | | |")
    end = next((r for r in recs if r.get("event") == "section_end" and r["section"] == "moe"),
               None)
    if end is not None and end["status"] != "ok" and not any("model" in r for r in moe):
        # the first check's two cases, by hand: its records do not name the planned units
        done = {(r["experts"], r["mode"]) for r in moe if "variant" in r or "skipped" in r}
        for e, k, routing in ((8, 2, "uniform"), (64, 8, "zipf")):
            for mode in MODES[::-1]:
                if (e, mode) not in done:
                    lines.append(f"| {e}:{k} | {routing} | {mode} | not reached: the section "
                                 f"hit its {end['timeout_s']} s cap | | | |")
    elif end is not None and end["status"] != "ok":
        lines.append(f"| the section ended {end['status']} after {end['seconds']:.0f} s | | | "
                     f"| | | |")
    return "\n".join(lines)


def train_line(recs: list[dict]) -> str:
    steps = [r for r in recs if r["section"] == "train" and r.get("event") == "step"]
    s = next(r for r in recs if r["section"] == "train" and r.get("event") == "summary")
    return (f"`{s['preset']}`, {s['steps']} steps on {s['device']}: ran {s['ran']} "
            f"({s['ran_because']}); median step {s['median_step_time_s'] * 1e3:.1f} ms, "
            f"{s['median_tflops_per_device']:.3f} TFLOPS, MFU {s['median_mfu'] * 100:.2f}%, "
            f"peak device memory {s['peak_bytes_in_use'] / 2**20:.0f} MiB; loss "
            f"{steps[0]['loss']:.2f} at step 1, {s['final_loss']:.2f} at step {steps[-1]['step']}")


def _fmt(v, spec: str, scale: float = 1.0) -> str:
    return "-" if v is None else format(v * scale, spec)


def maxtext_table(recs: list[dict]) -> str:
    """The maxtext section's summary beside the train section's (same model, batch, sequence
    and GPU; TFLOPS and MFU by dropless's FLOP count for both), and dropless's tokens/s over
    MaxText's; or the reason it was skipped or failed."""
    mine = [r for r in recs if r["section"] == "maxtext"]
    skip = next((r for r in mine if r.get("event") == "skipped"), None)
    m = next((r for r in mine if r.get("event") == "summary"), None)
    if skip is not None:
        return f"MaxText: not run ({skip['skipped']}); fetch it with `{skip['fetch']}`"
    if m is None or "median_step_time_s" not in m:
        end = next((r for r in mine if r.get("event") == "section_end"), {})
        tail = " / ".join((m or end).get("tail", [])[-2:])
        return (f"MaxText: no timed step (section {end.get('status', '?')}, exit "
                f"{(m or end).get('returncode')}): {tail}")
    t = next((r for r in recs if r["section"] == "train" and r.get("event") == "summary"), {})
    rows = [("MoE grouped matmul", t.get("ran", "-"), m["moe_kernel"].split(":")[0]),
            ("steps (timed)", f"{t.get('steps', '-')} ({t.get('timed_steps', '-')})",
             f"{m['steps']} ({m['timed_steps']})"),
            ("median step (ms)", _fmt(t.get("median_step_time_s"), ".1f", 1e3),
             _fmt(m["median_step_time_s"], ".1f", 1e3)),
            ("tokens/s", _fmt(t.get("median_tokens_per_s"), ".0f"),
             _fmt(m["median_tokens_per_s"], ".0f")),
            ("TFLOPS (dropless's count)", _fmt(t.get("median_tflops_per_device"), ".1f"),
             _fmt(m["median_tflops_per_device"], ".1f")),
            ("MFU (%)", _fmt(t.get("median_mfu"), ".1f", 100), _fmt(m["median_mfu"], ".1f", 100)),
            ("compile / first step (s)", _fmt(t.get("compile_s"), ".0f"),
             _fmt(m["first_step_s"], ".0f"))]
    lines = ["| | dropless (train) | MaxText |", "|---|---|---|",
             *[f"| {a} | {b} | {c} |" for a, b, c in rows]]
    ratio = m.get("tokens_per_s_ratio")
    lines.append("\n" + (f"dropless / MaxText tokens/s: {ratio:.2f}" if ratio else
                         "dropless / MaxText tokens/s: - (no train summary in this run)")
                 + f"; MaxText's own TFLOP/s {m['median_maxtext_tflops_per_device']:.1f} "
                 f"({m['maxtext_tflop_per_step']} TFLOP a step by its count, "
                 f"{m['dropless_tflop_per_step']:.2f} by dropless's)")
    return "\n".join(lines)


def sections_table(recs: list[dict]) -> str:
    plan = next(r for r in recs if r["section"] == "plan")["estimate_h200"]
    lines = ["| section | status | seconds | estimated | cap | measurements | units skipped "
             "by the plan | tests |", "|---" * 8 + "|"]
    rows = next(r for r in recs if r["section"] == "summary")["rows"]
    for row in rows:
        name = row["section"]
        dropped = plan.get(name, {}).get("dropped")
        lines.append(f"| {name} | {row['status']} | {row['seconds']:.1f} | "
                     f"{row['estimated_h200_s']:g} | {row['cap_s']:g} | {row['measurements']} | "
                     f"{'-' if dropped is None else len(dropped)} | {row.get('tests', '')} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv[:1] == ["winners"]:
        return winners_main(argv[1:])
    recs = load(Path(argv[0]) if argv else ROOT / "benchmarks/results/gpu_h200.jsonl")
    info = next(r for r in recs if r["section"] == "info" and "jax" in r)
    print(f"{info['device_kind']} ({info['nvidia_smi']}); jax {info['jax']}, torch "
          f"{info['torch']}, triton {info['triton']}, tokamax {info['tokamax']}, commit "
          f"{info['git_commit']}; auto -> {info['auto_on_this_platform']}\n")
    has = {r["section"] for r in recs}
    title = ("grouped matmul, bf16, M=8192, K=N=1024"
             if _first_check(s["shape"] for s in gmm_shapes(recs)) else
             "grouped matmul, bf16, per shape of the shapes table")
    for title, table, section in ((title, gmm_table, "gmm"),
                                  ("targets (fwd+bwd)", targets_table, "gmm"),
                                  ("MoE layer", moe_table, "moe"),
                                  ("sections", sections_table, "summary")):
        if section in has:
            print(f"{title}\n\n{table(recs)}\n")
    if any(r["section"] == "train" and r.get("event") == "summary" for r in recs):
        print(train_line(recs))
    if "maxtext" in has:
        print(f"\nthe same model in MaxText\n\n{maxtext_table(recs)}")
    return 0


def winners_main(argv: list[str]) -> int:
    """`tables.py winners GPU_BENCH_JSONL [--date YYYY-MM-DD] [--out PATH]`: the winner table
    `auto` reads (ops/gmm/winners.json) built from a device check's records by
    `winners.from_records`, printed, or written whole to PATH. A bad input: one line, exit 2."""
    import argparse
    import datetime

    from dropless.ops.gmm import winners
    from dropless.runtime import files
    ap = argparse.ArgumentParser(prog="tables.py winners", description=winners_main.__doc__)
    ap.add_argument("jsonl", type=Path)
    ap.add_argument("--date", help="the run's date (default: the file's modification date, UTC)")
    ap.add_argument("--out", type=Path, help="write the table here (whole or not at all)")
    args = ap.parse_args(argv)
    def fail(msg: str) -> int:
        print(f"tables.py winners: {msg}", file=sys.stderr)
        return 2
    try:
        recs = load(args.jsonl)
        mtime = args.jsonl.stat().st_mtime
    except (OSError, ValueError) as e:   # json.JSONDecodeError is a ValueError
        return fail(f"{args.jsonl}: cannot read the records: {e}")
    date = args.date or datetime.datetime.fromtimestamp(
        mtime, datetime.timezone.utc).date().isoformat()
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", date):
        return fail(f"--date {date!r}: give the run's date as YYYY-MM-DD")
    path = args.jsonl.resolve()
    source = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(args.jsonl)
    try:
        tab = winners.from_records(recs, source=source, date=date)
    except ValueError as e:
        return fail(str(e))
    text = json.dumps(tab, indent=1) + "\n"
    if args.out is None:
        sys.stdout.write(text)
    else:
        try:
            files.write_text(args.out, text)
        except OSError as e:
            return fail(f"--out {args.out}: {e}")
        print(f"wrote {args.out}: {len(tab['rows'])} rows for {tab['provenance']['device']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
