"""benchmarks/gpu/tables.py on the records a device check writes: every backend and every shape
the records hold, driven by them (no list of backends or shapes in the script).

Legend: M routed rows, K contraction dim, N output dim, G groups.

One real dry run (`dropless bench gpu --dry-run`, sections info and gmm at dry/G2) gives the
records' shapes: the synthetic records of tests/bench/gpu_records.py must have its keys, and
the tables are printed from it, then from it with records of the backends a device measures
(mosaic_gpu, tokamax, cudnn_ragged_dot, pallas_gpu on aligned segments) and of shapes-table
shapes added, whose cells are computed here by hand.
"""
import contextlib
import importlib.util
import io

import pytest

from dropless.bench import gpu as bench_gpu
from tests._support.paths import ROOT
from tests.bench import gpu_records as gr

spec = importlib.util.spec_from_file_location("gpu_tables", ROOT / "benchmarks/gpu/tables.py")
tables = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tables)


@pytest.fixture(scope="module")
def dry_records(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_tables_dry")
    mp = pytest.MonkeyPatch()
    mp.setenv("XLA_FLAGS", "")       # the section processes on one CPU device: faster compiles
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            rc = bench_gpu.run(bench_gpu.GpuOptions(
                dry_run=True, out_dir=str(out), sections=("info", "gmm"), shapes=("dry/G2",)))
    finally:
        mp.undo()
    assert rc == 0
    return tables.load(out / "gpu_bench.jsonl")


def test_synthetic_records_have_the_keys_of_a_dry_run(dry_records):
    def one(pred):
        return next(r for r in dry_records if pred(r))
    real = {
        "info": one(lambda r: r["section"] == "info" and "jax" in r),
        "kernel": one(lambda r: r.get("backend") == "pallas_gpu" and "median_ms" in r),
        "aligned": one(lambda r: r.get("aligned") and "median_ms" in r),
        "dlhs": one(lambda r: r.get("mode") == "dlhs" and r["backend"] == "pallas_gpu"),
        "dense": one(lambda r: r.get("backend") == "dense_xla" and "median_ms" in r),
        "skipped": one(lambda r: r.get("skipped") and "routing" not in r),
        "plan": one(lambda r: r["section"] == "plan"),
        "summary_row": one(lambda r: r["section"] == "summary")["rows"][0],
    }
    run = gr.run([])
    made = {
        "info": gr.info(), "kernel": gr.gmm("dry/G2", "uniform", "fwd", "pallas_gpu", 1.0),
        "aligned": gr.gmm("dry/G2", "uniform", "fwd", "pallas_gpu", 1.0, aligned=True),
        "dlhs": gr.gmm("dry/G2", "uniform", "dlhs", "pallas_gpu", 1.0),
        "dense": gr.gmm("dry/G2", "uniform", "fwd", "dense_xla", 1.0),
        "skipped": gr.skipped("dry/G2", "tokamax"), "plan": run[0],
        "summary_row": run[-1]["rows"][0],
    }
    # where a version cannot be read here (no torch in the venv, as in CI's; the CUDA plugin's
    # libraries absent) the info record says why in a `*_error` key; every other key is there
    # either way
    for kind in real:
        keys = {k for k in real[kind] if not (kind == "info" and k.endswith("_error"))}
        assert set(made[kind]) == keys, kind
    # the aligned layout's rows, its useful FLOPs those of the unaligned rows (dry/G2: 64 rows
    # in 2 groups -> 64 + 2 x 127 rounded up to 128 = 384)
    assert (real["aligned"]["aligned_rows"], real["aligned"]["group_alignment"]) == (384, 128)
    for kind in ("aligned", "dlhs"):
        assert real[kind]["useful_flops"] == made[kind]["useful_flops"] == 2 * 64 * 32 * 32
    assert set(run[-1]) == set(one(lambda r: r["section"] == "summary"))


def test_tables_of_a_dry_run_name_what_it_measured(dry_records, capsys):
    assert tables.gmm_columns(dry_records) == ["pallas_gpu", "ragged_dot", "pallas_gpu aligned"]
    # every mode the section timed: both, then the backward's directions alone
    assert [r["mode"] for r in dry_records if r.get("backend") == "dense_xla"
            and r["routing"] == "uniform"] == ["fwd", "fwd+bwd", "dlhs", "drhs"]
    text = tables.gmm_table(dry_records)
    assert text.startswith("dry/G2 (M=64, K=32, N=32, G=2)\n")
    assert "not measured: tokamax (not usable here: tokamax is not installed)" in text
    dense = {(r["routing"], r["mode"]): r["median_ms"] for r in dry_records
             if r.get("backend") == "dense_xla" and "median_ms" in r}
    r = next(r for r in dry_records if r.get("backend") == "ragged_dot"
             and r["routing"] == "zipf" and r["mode"] == "fwd+bwd")
    d = dense[("zipf", "fwd+bwd")]
    best = min(v for (_, mode), v in dense.items() if mode == "fwd+bwd")
    assert (f"| zipf | fwd+bwd | {d:.4f} | " in text
            and f" | {r['median_ms']:.4f} ({d / r['median_ms']:.2f}; "
                f"{best / r['median_ms']:.2f}) | " in text)
    rows = [ln.split(" | ")[:2] for ln in text.splitlines() if ln.startswith("| uniform")]
    assert rows == [["| uniform", m] for m in ("fwd", "fwd+bwd", "dlhs", "drhs")]
    # a backend the section could not run is named once, whatever the modes it was planned in
    assert text.count("tokamax (not usable here") == 1
    assert tables.main([]) == 0          # the committed first check still prints
    capsys.readouterr()


def test_every_backend_and_shape_the_records_hold(dry_records):
    extra = []
    for b, ms in (("mosaic_gpu", 0.5), ("tokamax", 0.25), ("cudnn_ragged_dot", 0.2)):
        extra += [gr.gmm("dry/G2", "uniform", "fwd", b, ms)]
    extra += [gr.gmm("dry/G2", "uniform", "fwd", "pallas_gpu", 0.4, aligned=True),
              gr.gmm("dry/G2", "uniform", "fwd", "tokamax", 0.1, ran="pallas_gpu")]
    # shapes-table shapes, given in reverse order: Qwen3's gate_up (target 0.85 of dense) and
    # small/G64 (0.6), each with dense, the peer and two kernels at fwd+bwd and fwd
    for shape, dense, peer, fast, slow in (("small/G64", 0.1, 0.25, 0.15, 0.3),
                                           ("qwen3_30b_a3b/gate_up", 3.0, 4.0, 3.4, 5.0)):
        for mode, scale in (("fwd+bwd", 1.0), ("fwd", 0.5)):
            extra += [gr.gmm(shape, "zipf", mode, "dense_xla", dense * scale),
                      gr.gmm(shape, "zipf", mode, "torch_grouped_mm", peer * scale),
                      gr.gmm(shape, "zipf", mode, "mosaic_gpu", fast * scale),
                      gr.gmm(shape, "zipf", mode, "pallas_gpu", slow * scale, aligned=True)]
    recs = dry_records + extra
    cols = tables.gmm_columns(recs)
    assert cols == ["pallas_gpu", "ragged_dot", "pallas_gpu aligned", "mosaic_gpu", "tokamax",
                    "cudnn_ragged_dot"]
    text = tables.gmm_table(recs)
    heads = [ln for ln in text.splitlines() if " (M=" in ln]
    assert heads == ["qwen3_30b_a3b/gate_up (M=262144, K=2048, N=1536, G=128)",
                     "small/G64 (M=8192, K=1024, N=1024, G=64)",
                     "dry/G2 (M=64, K=32, N=32, G=2)"]         # the shapes table's order
    assert "| " + " | ".join(f"{c} ms (of dense; of fastest dense)" for c in cols) in text
    # a record where another backend ran says so
    assert "ran pallas_gpu" in text
    targets = tables.targets_table(recs).splitlines()
    assert targets[0].startswith("| shape | routing | backend |")
    # (the dry run's aligned column comes first: the records' order)
    want = [("qwen3_30b_a3b/gate_up", "pallas_gpu aligned", 3.0 / 5.0, 0.85, 4.0 / 5.0,
             2.0 / 2.5),
            ("qwen3_30b_a3b/gate_up", "mosaic_gpu", 3.0 / 3.4, 0.85, 4.0 / 3.4, 2.0 / 1.7),
            ("small/G64", "pallas_gpu aligned", 0.1 / 0.3, 0.6, 0.25 / 0.3, 0.125 / 0.15),
            ("small/G64", "mosaic_gpu", 0.1 / 0.15, 0.6, 0.25 / 0.15, 0.125 / 0.075)]
    assert targets[2:] == [
        f"| {s} | zipf | {b} | {f:.2f} (>= {goal:.2f}) | {'yes' if f >= goal else 'no'} | "
        f"{v:.2f} | {'yes' if v >= 1 else 'no'} | {fw:.2f} |" for s, b, f, goal, v, fw in want]


def test_the_winner_table_of_a_dry_runs_records_takes_each_direction_from_its_own_mode(
        dry_records):
    # the records as a device run writes them (not a dry run's, a commit named): dlhs and drhs
    # rows come from those directions timed alone, never from fwd+bwd; the aligned records and
    # the dense baselines never win
    from dropless.ops.gmm import winners
    recs = [dict(r, dry_run=False) for r in dry_records]
    recs = [dict(r, git_commit="abc1234") if r["section"] == "info" and "jax" in r else r
            for r in recs]
    tab = winners.from_records(recs, source="dry.jsonl", date="2026-12-06")
    timed = {(r["mode"], r["backend"], r["routing"]): r["median_ms"] for r in recs
             if r["section"] == "gmm" and "median_ms" in r and not r.get("aligned")
             and r["backend"] in ("pallas_gpu", "ragged_dot")}
    want = {}
    for direction in ("fwd", "dlhs", "drhs"):
        per = {b: [round(timed[(direction, b, rt)], 4) for rt in ("uniform", "zipf")]
               for b in ("pallas_gpu", "ragged_dot")}
        best = [b for b in sorted(per) if all(per[b][i] == min(p[i] for p in per.values())
                                              for i in range(2))]
        if best:
            want[direction] = (best[0], direction)
    assert {r["direction"]: (r["backend"], r["mode"]) for r in tab["rows"]} == want
    assert "Timed alone: dlhs, drhs." in tab["provenance"]["note"]
