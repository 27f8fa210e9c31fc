"""The README's performance section, from the committed result files, never typed by hand:
python benchmarks/readme_results.py [--write].

One current table per machine: each CPU (AMD EPYC, Intel Xeon) from its newest side-by-side with
PyTorch (`dropless bench moe --vs-torch`, every dtype it ran), the GPU from the newest device
check (`dropless bench gpu`).
Without arguments it prints the section; `--write` replaces the README's block between the
markers with it (tests/ci/test_readme_results.py fails when they differ).
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CPU_FILES = ("moe_vs_torch_chunks_reuse.jsonl", "moe_vs_torch_intel_mkl.jsonl")
GPU_FILE = "gpu_h200.jsonl"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
MODES = ("fwd", "fwd+bwd")


def _load(name: str) -> list[dict]:
    text = (RESULTS / name).read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _gpu_tables():
    spec = importlib.util.spec_from_file_location("gpu_tables", ROOT / "benchmarks/gpu/tables.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def cpu_section(recs: list[dict], name: str) -> str:
    """The MoE layer against Hugging Face's Mixtral block on torch._grouped_mm, per case and
    dtype, from the side-by-side records of result file `name`."""
    def key(r):
        return r["tokens"], r["experts"], r["top_k"], r.get("dtype", "float32"), r["mode"]
    layer = {key(r): r for r in recs if r.get("variant") == "dropless/auto"}
    hf = {key(r): r for r in recs if r.get("variant") == "torch/hf_mixtral"}
    first = next(iter(layer.values()))
    m = first["machine"]
    dtypes = sorted({k[3] for k in layer}, key=lambda d: d != "float32")
    head = (f"CPU: {m['cpu']}, {m['cores']} cores, commit {m['git_commit']}, jax {m['jax']}, "
            f"torch {first['torch']}, {', '.join(dtypes)}, host malloc `{m['host_malloc']}` "
            f"([{name}](benchmarks/results/{name})). The MoE layer against Hugging Face's "
            "Mixtral block on `torch._grouped_mm`, d_model "
            f"{first['d_model']}, one round-robin per case:")
    lines = [head, "", "| tokens:experts:top-k | dtype | mode | dropless ms | HF Mixtral ms | "
             "HF / dropless (> 1: dropless faster) | dropless / its dense SwiGLU |",
             "|---" * 7 + "|"]
    for k in sorted(layer, key=lambda k: (dtypes.index(k[3]), k[1], MODES.index(k[4]))):
        r, t = layer[k], hf.get(k)
        lines.append(f"| {k[0]}:{k[1]}:{k[2]} (F={r['d_ff']}) | {k[3]} | {k[4]} | "
                     f"{r['median_ms']:.1f} | " + ("-" if t is None else f"{t['median_ms']:.1f}")
                     + " | " + ("-" if t is None else f"{t['median_ms'] / r['median_ms']:.2f}")
                     + f" | {r['ratio_to_dense']:.2f} |")
    return "\n".join(lines)


def gpu_section(recs: list[dict]) -> str:
    """The grouped matmul's targets and the MoE layer of the newest device check."""
    tables = _gpu_tables()
    info = next(r for r in recs if r["section"] == "info" and "jax" in r)
    head = (f"GPU: {info['device_kind']}, commit {info['git_commit']}, jax {info['jax']}, "
            f"tokamax {info.get('tokamax')}, bf16, M=8192, K=N=1024 "
            f"([{GPU_FILE}](benchmarks/results/{GPU_FILE}); every table: `python "
            "benchmarks/gpu/tables.py`; the device check: [docs/gpu.md](docs/gpu.md)). "
            "Grouped matmul forward+backward against the same run's "
            "dense matmul and `torch._grouped_mm`:")
    return "\n".join([head, "", tables.targets_table(recs), "", "The MoE layer against a dense "
                      "SwiGLU over the same rows:", "", tables.moe_table(recs)])


def section() -> str:
    """The README block, markers included."""
    cpu = [part for name in CPU_FILES for part in (cpu_section(_load(name), name), "")]
    return "\n".join([BEGIN, "", *cpu, gpu_section(_load(GPU_FILE)),
                      "", "Every earlier run, with its commit and machine: "
                      "[benchmarks/results/HISTORY.md](benchmarks/results/HISTORY.md); what each "
                      "file holds: [benchmarks/results/README.md](benchmarks/results/README.md).",
                      "", END])


def readme_block(text: str) -> str:
    """The README's block between the markers, markers included (ValueError without them)."""
    if BEGIN not in text or END not in text:
        raise ValueError(f"README.md has no {BEGIN} ... {END} block")
    return text[text.index(BEGIN): text.index(END) + len(END)]


def main(argv: list[str]) -> int:
    if argv == ["--write"]:
        path = ROOT / "README.md"
        text = path.read_text()
        path.write_text(text.replace(readme_block(text), section()))
        print(f"wrote the results block of {path}")
    elif not argv:
        print(section())
    else:
        print("usage: python benchmarks/readme_results.py [--write]", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
