"""Markdown tables of one device check: python benchmarks/gpu/tables.py [GPU_BENCH_JSONL].

Legend: M routed rows, K contraction dim, N output dim, G groups (experts).

Prints what docs/gpu.md "Measured on one H200" shows, from the records `dropless bench gpu`
wrote (default benchmarks/results/gpu_h200.jsonl), never typed by hand: the grouped-matmul
times with each backend's fraction of the same-process dense matmul (the one measured with it,
and the fastest dense of the run: the dense product is the same M x K x N at every G and
routing), the torch peer, the targets, the MoE layer, the training run, the tests and the
sections' seconds against the plan.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GMM_BACKENDS = ("pallas_gpu", "tokamax")
MODES = ("fwd", "fwd+bwd")


def load(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def _gmm(recs: list[dict]) -> dict:
    """(shape, routing, mode, backend) -> record, for every timed grouped-matmul record."""
    return {(r["shape"], r["routing"], r["mode"], r["backend"]): r for r in recs
            if r["section"] == "gmm" and "median_ms" in r}


def gmm_table(recs: list[dict]) -> str:
    g = _gmm(recs)
    best = {m: min(r["median_ms"] for k, r in g.items() if k[2] == m and k[3] == "dense_xla")
            for m in MODES}
    lines = ["| G | routing | mode | XLA dense ms | "
             + " | ".join(f"{b} ms (of dense; of fastest dense)" for b in GMM_BACKENDS)
             + " | torch._grouped_mm ms | torch.mm ms |", "|---" * 8 + "|"]
    for shape, routing, mode in sorted({k[:3] for k in g}, key=lambda k: (
            int(k[0][1:]), k[1], MODES.index(k[2]))):
        dense = g[(shape, routing, mode, "dense_xla")]["median_ms"]
        cells = []
        for b in GMM_BACKENDS:
            r = g.get((shape, routing, mode, b))
            cells.append("-" if r is None else
                         f"{r['median_ms']:.4f} ({dense / r['median_ms']:.2f}; "
                         f"{best[mode] / r['median_ms']:.2f})")
        peer = [g.get((shape, routing, mode, p)) for p in ("torch_grouped_mm", "torch_dense")]
        cells += ["-" if r is None else f"{r['median_ms']:.4f}" for r in peer]
        lines.append(f"| {shape[1:]} | {routing} | {mode} | {dense:.4f} | " + " | ".join(cells)
                     + " |")
    return "\n".join(lines)


def targets_table(recs: list[dict]) -> str:
    """bf16 fwd+bwd: >= 70% of dense at G8, >= 50% at G64, at least torch._grouped_mm's speed
    (its forward alone beside it: torch's fwd+bwd carries autograd's overhead)."""
    g = _gmm(recs)
    lines = ["| G | routing | backend | fraction of dense (target) | met | speed vs "
             "torch._grouped_mm (>= 1) | met | fwd alone: speed vs torch._grouped_mm |",
             "|---" * 8 + "|"]
    for shape, routing in sorted({k[:2] for k in g}, key=lambda k: (int(k[0][1:]), k[1])):
        goal = 0.7 if shape == "G8" else 0.5
        dense = g[(shape, routing, "fwd+bwd", "dense_xla")]["median_ms"]
        peer = g[(shape, routing, "fwd+bwd", "torch_grouped_mm")]["median_ms"]
        for b in GMM_BACKENDS:
            r = g.get((shape, routing, "fwd+bwd", b))
            if r is None:
                continue
            frac, speed = dense / r["median_ms"], peer / r["median_ms"]
            fwd = (g[(shape, routing, "fwd", "torch_grouped_mm")]["median_ms"]
                   / g[(shape, routing, "fwd", b)]["median_ms"])
            lines.append(f"| {shape[1:]} | {routing} | {b} | {frac:.2f} (>= {goal:.2f}) | "
                         f"{'yes' if frac >= goal else 'no'} | {speed:.2f} | "
                         f"{'yes' if speed >= 1 else 'no'} | {fwd:.2f} |")
    return "\n".join(lines)


def moe_table(recs: list[dict]) -> str:
    lines = ["| E:K | routing | mode | dense SwiGLU ms | layer ms (ran) | layer / dense | "
             "compile s: dense, layer |", "|---" * 7 + "|"]
    moe = [r for r in recs if r["section"] == "moe"]
    for r in moe:
        if r.get("variant") != "dropless/auto":
            continue
        d = next(x for x in moe if x.get("variant") == "dense" and x["mode"] == r["mode"]
                 and x["experts"] == r["experts"] and x["routing"] == r["routing"])
        lines.append(f"| {r['experts']}:{r['top_k']} | {r['routing']} | {r['mode']} | "
                     f"{d['median_ms']:.3f} | {r['median_ms']:.3f} ({r['ran']}) | "
                     f"{r['ratio_to_dense']:.3f} | {d['compile_ms'] / 1e3:.2f}, "
                     f"{r['compile_ms'] / 1e3:.1f} |")
    for r in moe:
        if "skipped" in r:
            lines.append(f"| {r['experts']}:{r['top_k']} | {r['routing']} | {r['mode']} | "
                         f"skipped: {r['skipped']} | | | |")
    end = next(r for r in recs if r.get("event") == "section_end" and r["section"] == "moe")
    if end["status"] != "ok":
        done = {(r["experts"], r["mode"]) for r in moe if "variant" in r or "skipped" in r}
        for e, k, routing in ((8, 2, "uniform"), (64, 8, "zipf")):
            for mode in MODES[::-1]:
                if (e, mode) not in done:
                    lines.append(f"| {e}:{k} | {routing} | {mode} | not reached: the section "
                                 f"hit its {end['timeout_s']} s cap | | | |")
    return "\n".join(lines)


def train_line(recs: list[dict]) -> str:
    steps = [r for r in recs if r["section"] == "train" and r.get("event") == "step"]
    s = next(r for r in recs if r["section"] == "train" and r.get("event") == "summary")
    return (f"`{s['preset']}`, {s['steps']} steps on {s['device']}: ran {s['ran']} "
            f"({s['ran_because']}); median step {s['median_step_time_s'] * 1e3:.1f} ms, "
            f"{s['median_tflops_per_device']:.3f} TFLOPS, MFU {s['median_mfu'] * 100:.2f}%, "
            f"peak device memory {s['peak_bytes_in_use'] / 2**20:.0f} MiB; loss "
            f"{steps[0]['loss']:.2f} at step 1, {s['final_loss']:.2f} at step {steps[-1]['step']}")


def sections_table(recs: list[dict]) -> str:
    plan = next(r for r in recs if r["section"] == "plan")["estimate_h200"]
    lines = ["| section | status | seconds | estimated | cap | measurements | units skipped "
             "by the plan | tests |", "|---" * 8 + "|"]
    rows = next(r for r in recs if r["section"] == "summary")["rows"]
    for row in rows:
        name = row["section"]
        dropped = len(plan[name].get("dropped", []))
        lines.append(f"| {name} | {row['status']} | {row['seconds']:.1f} | "
                     f"{row['estimated_h200_s']:g} | {row['cap_s']:g} | {row['measurements']} | "
                     f"{dropped if 'dropped' in plan[name] else '-'} | {row.get('tests', '')} |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    recs = load(Path(argv[0]) if argv else ROOT / "benchmarks/results/gpu_h200.jsonl")
    info = next(r for r in recs if r["section"] == "info" and "jax" in r)
    print(f"{info['device_kind']} ({info['nvidia_smi']}); jax {info['jax']}, torch "
          f"{info['torch']}, triton {info['triton']}, tokamax {info['tokamax']}, commit "
          f"{info['git_commit']}; auto -> {info['auto_on_this_platform']}\n")
    for title, table in (("grouped matmul, bf16, M=8192, K=N=1024", gmm_table(recs)),
                         ("targets (fwd+bwd)", targets_table(recs)), ("MoE layer", moe_table(recs)),
                         ("sections", sections_table(recs))):
        print(f"{title}\n\n{table}\n")
    print(train_line(recs))


if __name__ == "__main__":
    main(sys.argv[1:])
