"""Markdown tables from the committed bench JSON lines: python benchmarks/summarize.py [DIR].

The gmm.jsonl and moe.jsonl tables in benchmarks/results/README.md are printed by this script,
never typed by hand (tests/ci/test_readme_results.py checks they are current).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


ROUTING_ORDER = ("uniform", "zipf", "half", "quarter_empty")


def _routing_key(routing: str) -> int:
    return ROUTING_ORDER.index(routing) if routing in ROUTING_ORDER else len(ROUTING_ORDER)


def _load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _ratio(recs, **match) -> str:
    for r in recs:
        if all(r.get(k) == v for k, v in match.items()):
            if "ratio_to_dense" in r:
                return f"{r['ratio_to_dense']:.2f}"
            return "skip"
    return "-"


def gmm_table(recs: list[dict]) -> str:
    cols = [("auto", "fwd"), ("auto", "fwd+bwd"), ("split_floor", "fwd"),
            ("split_floor", "fwd+bwd"), ("ragged_dot", "fwd+bwd"), ("padded", "fwd+bwd"),
            ("loop", "fwd+bwd")]
    head = ("| dtype | G | routing | tiled fwd | tiled fwd+bwd | split_floor fwd | "
            "split_floor fwd+bwd | ragged_dot fwd+bwd | padded fwd+bwd | loop fwd+bwd |")
    lines = [head, "|---" * 10 + "|"]
    cases = sorted({(r["dtype"], r["groups"], r["routing"]) for r in recs},
                   key=lambda c: (c[0] != "float32", c[1], _routing_key(c[2])))
    for dtype, g, routing in cases:
        sub = [r for r in recs if (r["dtype"], r["groups"], r["routing"]) == (dtype, g, routing)]
        cells = [_ratio(sub, backend=b, mode=m) for b, m in cols]
        lines.append(f"| {dtype} | {g} | {routing} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def moe_table(recs: list[dict]) -> str:
    variants = sorted({r["variant"] for r in recs if r["variant"] != "dense"},
                      key=lambda v: (not v.startswith("dropless"), v))
    lines = ["| dtype | E:K | routing | mode | " + " | ".join(variants) + " |",
             "|---" * (4 + len(variants)) + "|"]
    cases = sorted({(r["dtype"], r["experts"], r["top_k"], r["routing"], r["mode"])
                    for r in recs},
                   key=lambda c: (c[0] != "float32", c[1], _routing_key(c[3]), c[4]))
    for dtype, e, k, routing, mode in cases:
        sub = [r for r in recs if (r["dtype"], r["experts"], r["top_k"], r["routing"],
                                   r["mode"]) == (dtype, e, k, routing, mode)]
        cells = []
        for v in variants:
            cell = _ratio(sub, variant=v)
            drop = [r for r in recs if r["variant"] == v and r["mode"] == "fwd" and
                    (r["dtype"], r["experts"], r["routing"]) == (dtype, e, routing)]
            if v.startswith("capacity") and mode == "fwd" and drop and "drop_rate" in drop[0]:
                cell += f" (drop {100 * drop[0]['drop_rate']:.1f}%)"
            cells.append(cell)
        lines.append(f"| {dtype} | {e}:{k} | {routing} | {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def tables(d: Path) -> str:
    """The gmm.jsonl and moe.jsonl sections (heading with commits and load, then the table)."""
    parts = []
    for name, table in (("gmm.jsonl", gmm_table), ("moe.jsonl", moe_table)):
        recs = _load(d / name)
        busy = sorted({r.get("busy_before") for r in recs} | {r.get("busy_after") for r in recs},
                      key=lambda v: -1 if v is None else v)
        commits = sorted({r["machine"]["git_commit"] for r in recs})
        parts.append(f"## {name} (commits {', '.join(commits)}; others' load {busy})\n")
        parts.append(table(recs) + "\n")
    return "\n".join(parts)


def main(argv: list[str]) -> int:
    d = Path(argv[1]) if len(argv) > 1 else Path(__file__).parent / "results"
    print(tables(d))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
