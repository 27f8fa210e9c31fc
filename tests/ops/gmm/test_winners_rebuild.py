"""The winner table rebuilt from a device check's records: `winners.from_records` and its
command, `python benchmarks/gpu/tables.py winners GPU_BENCH_JSONL [--out PATH]`.

Legend: M rows (sorted by group), K contraction dim, N output dim, G groups.

The records are shaped as `dropless bench gpu` writes them (tests/bench/gpu_records.py, whose
keys tests/bench/test_gpu_tables.py checks against a real dry run), with chosen medians, so
each winner is known by construction: the fastest backend at every routing of a bucket,
never a baseline, never a record where another backend ran.
"""
import json
import re
import subprocess
import sys

import pytest

from dropless.ops.gmm import winners
from tests._support.paths import ROOT
from tests.bench import gpu_records as gr

H200 = "NVIDIA H200"
G8, QWEN = "small/G8", "qwen3_30b_a3b/gate_up"
ROUTINGS = ("uniform", "zipf")


def timings(shape, mode, per_backend, **kw):
    """Records of `per_backend` ({backend: (uniform ms, zipf ms)}) at one shape and mode."""
    return [gr.gmm(shape, r, mode, b, ms[i], **kw)
            for b, ms in per_backend.items() for i, r in enumerate(ROUTINGS)]


def device_run():
    """small/G8: tokamax the fastest forward at both routings, fwd+bwd split (pallas_gpu at
    uniform, tokamax at zipf: no dlhs/drhs row). Qwen3 gate_up: mosaic_gpu the fastest in both
    modes; a faster tokamax record that ran pallas_gpu (a fallback), a faster aligned record
    and a faster dense and torch peer, none of which may win; cudnn_ragged_dot measured at one
    routing only (not compared)."""
    recs = timings(G8, "fwd", {"dense_xla": (0.01, 0.01), "tokamax": (0.09, 0.07),
                               "pallas_gpu": (0.24, 0.18), "torch_grouped_mm": (0.04, 0.04)})
    recs += timings(G8, "fwd+bwd", {"tokamax": (0.30, 0.16), "pallas_gpu": (0.25, 0.20)})
    recs += [gr.skipped(G8, "mosaic_gpu", "not usable here: not a Hopper GPU")]
    for mode in ("fwd", "fwd+bwd"):
        recs += timings(QWEN, mode, {"mosaic_gpu": (5.0, 6.0), "pallas_gpu": (9.0, 9.5),
                                     "dense_xla": (1.0, 1.0), "torch_grouped_mm": (2.0, 2.0)})
        recs += timings(QWEN, mode, {"tokamax": (0.5, 0.5)}, ran="pallas_gpu")
        recs += timings(QWEN, mode, {"pallas_gpu": (0.7, 0.7)}, aligned=True)
        recs += [gr.gmm(QWEN, "uniform", mode, "cudnn_ragged_dot", 0.1)]
    return gr.run(recs)


def test_winners_from_a_device_run():
    tab = winners.from_records(device_run(), source="benchmarks/results/gpu_h200.jsonl",
                               date="2026-12-06")
    winners.check_table(tab)
    prov = tab["provenance"]
    assert prov["commit"] == "abc1234" and prov["date"] == "2026-12-06"
    assert prov["device"] == "one NVIDIA H200 (nvidia-smi: NVIDIA H200, 143771 MiB, 1980 MHz, " \
                             "580.159.04)"
    assert prov["jax"] == "0.11.2 (tokamax 0.0.17, triton 3.6.0)" and prov["dtype"] == "bfloat16"
    assert prov["source"] == "benchmarks/results/gpu_h200.jsonl"
    assert "not timed alone" in prov["note"] and "r1k_k1k_n1k dlhs" in prov["note"]
    got = {(r["bucket"], r["direction"]): (r["backend"], r["mode"]) for r in tab["rows"]}
    g8, qwen = winners.bucket(8192, 1024, 1024, 8), winners.bucket(262144, 2048, 1536, 128)
    assert got == {(g8, "fwd"): ("tokamax", "fwd"),
                   (qwen, "fwd"): ("mosaic_gpu", "fwd"),
                   (qwen, "dlhs"): ("mosaic_gpu", "fwd+bwd"),
                   (qwen, "drhs"): ("mosaic_gpu", "fwd+bwd")}
    for r in tab["rows"]:
        assert r["device_kind"] == H200
        # only backends measured at every routing, as they ran, unaligned, no baseline
        assert set(r["times_ms"]) == ({"tokamax", "pallas_gpu"} if r["bucket"] == g8
                                      else {"mosaic_gpu", "pallas_gpu"})
        times = r["times_ms"]   # the committed table's rule (test_winners.py)
        for routing in times[r["backend"]]:
            assert times[r["backend"]][routing] == min(t[routing] for t in times.values())
    assert tab["rows"][1]["times_ms"]["mosaic_gpu"] == {"uniform": 5.0, "zipf": 6.0}
    # the table drives auto's lookup
    assert winners.winner(H200, 262144, 2048, 1536, 128, "drhs", tab) == "mosaic_gpu"
    assert winners.winner(H200, 8192, 1024, 1024, 8, "dlhs", tab) is None


def test_the_committed_table_is_what_its_records_give():
    # the committed table rebuilt from the records its provenance names: the same rows (the
    # first check's table was made by hand from its run by the same rule, its records label
    # the shapes "G8" and "G64", the table "small/G8" and "small/G64")
    committed = json.loads((ROOT / "src/dropless/ops/gmm/winners.json").read_text())
    prov = committed["provenance"]
    source = prov["source"].split()[0]
    recs = [json.loads(ln) for ln in (ROOT / source).read_text().splitlines() if ln.strip()]
    tab = winners.from_records(recs, source=source, date=prov["date"])
    assert tab["provenance"]["commit"] == prov["commit"]
    rows = [dict(r, shape=re.sub(r"^(G\d+)$", r"small/\1", r["shape"])) for r in tab["rows"]]
    assert rows == committed["rows"]


def test_directions_timed_alone_are_used():
    recs = timings(G8, "fwd", {"tokamax": (1.0, 1.0), "pallas_gpu": (2.0, 2.0)})
    recs += timings(G8, "fwd+bwd", {"tokamax": (3.0, 3.0), "pallas_gpu": (4.0, 4.0)})
    recs += timings(G8, "drhs", {"tokamax": (2.0, 2.0), "pallas_gpu": (1.0, 1.5)})
    tab = winners.from_records(gr.run(recs), source="x.jsonl", date="2026-12-06")
    got = {r["direction"]: (r["backend"], r["mode"]) for r in tab["rows"]}
    assert got == {"fwd": ("tokamax", "fwd"), "dlhs": ("tokamax", "fwd+bwd"),
                   "drhs": ("pallas_gpu", "drhs")}
    assert "Timed alone: drhs" in tab["provenance"]["note"]


def test_shapes_sharing_a_bucket_are_compared_together():
    # the dry run's shapes (64 rows in 2 or 4 groups) fall in one bucket: a backend wins only
    # where it is the fastest at both shapes and routings
    recs = timings("dry/G2", "fwd", {"pallas_gpu": (1.0, 1.0), "ragged_dot": (2.0, 2.0)})
    recs += timings("dry/G4", "fwd", {"pallas_gpu": (1.0, 1.0), "ragged_dot": (2.0, 2.0)})
    recs += timings("dry/G2", "fwd+bwd", {"pallas_gpu": (1.0, 1.0), "ragged_dot": (2.0, 2.0)})
    recs += timings("dry/G4", "fwd+bwd", {"pallas_gpu": (3.0, 1.0), "ragged_dot": (2.0, 2.0)})
    tab = winners.from_records(gr.run(recs), source="x.jsonl", date="2026-12-06")
    (row,) = tab["rows"]
    assert (row["bucket"], row["direction"], row["backend"]) == ("r64_k64_n64", "fwd",
                                                                 "pallas_gpu")
    assert row["shape"] == "dry/G2, dry/G4"
    assert set(row["times_ms"]["ragged_dot"]) == {"dry/G2 uniform", "dry/G2 zipf",
                                                  "dry/G4 uniform", "dry/G4 zipf"}
    assert "r64_k64_n64 dlhs; r64_k64_n64 drhs" in tab["provenance"]["note"]


@pytest.mark.parametrize("recs,match", [
    (gr.run(timings(G8, "fwd", {"tokamax": (1.0, 1.0)}, dry_run=True), dry_run=True),
     "x.jsonl: the records of a dry run"),
    ([r for r in gr.run(timings(G8, "fwd", {"tokamax": (1.0, 1.0)})) if r["section"] != "info"],
     "x.jsonl: no info record"),
    (gr.run(timings(G8, "fwd", {"dense_xla": (1.0, 1.0), "torch_dense": (1.0, 1.0)})
            + [gr.skipped(G8, "tokamax")]),
     "x.jsonl: no grouped-matmul timing"),
    (gr.run(timings(G8, "fwd", {"tokamax": (1.0, 1.0)}, ran="pallas_gpu")),
     "x.jsonl: no grouped-matmul timing"),
])
def test_records_that_cannot_make_a_table_are_refused_in_one_line(recs, match):
    with pytest.raises(ValueError, match=match) as e:
        winners.from_records(recs, source="x.jsonl", date="2026-12-06")
    assert "\n" not in str(e.value)


def tables(*argv, **kw):
    return subprocess.run([sys.executable, str(ROOT / "benchmarks/gpu/tables.py"), "winners",
                           *map(str, argv)], capture_output=True, text=True, cwd=ROOT, **kw)


def test_the_command_writes_the_table_whole(tmp_path):
    runs = tmp_path / "gpu_bench.jsonl"
    runs.write_text("".join(json.dumps(r) + "\n" for r in device_run()))
    out = tmp_path / "winners.json"
    done = tables(runs, "--date", "2026-12-06", "--out", out)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"wrote {out}: 4 rows for one NVIDIA H200 (nvidia-smi: NVIDIA " \
                          f"H200, 143771 MiB, 1980 MHz, 580.159.04)\n"
    tab = winners.check_table(json.loads(out.read_text()))
    assert tab == winners.from_records(device_run(), source=str(runs), date="2026-12-06")
    # without --out it prints the table (the date: the file's, UTC, when not given)
    printed = tables(runs)
    assert printed.returncode == 0 and json.loads(printed.stdout)["rows"] == tab["rows"]
    assert json.loads(printed.stdout)["provenance"]["date"][:2] == "20"


def test_the_command_refuses_bad_input_in_one_line_and_writes_nothing(tmp_path):
    runs = tmp_path / "dry.jsonl"
    runs.write_text("".join(json.dumps(r) + "\n" for r in gr.run(
        timings(G8, "fwd", {"pallas_gpu": (1.0, 1.0)}, dry_run=True), dry_run=True)))
    out = tmp_path / "winners.json"
    out.write_text("the table before")
    for argv, message in (
            ((runs, "--out", out), f"{runs}: the records of a dry run"),
            ((tmp_path / "missing.jsonl", "--out", out), "missing.jsonl: cannot read the records"),
            ((runs, "--date", "yesterday", "--out", out), "--date 'yesterday': give the run's "
                                                          "date as YYYY-MM-DD")):
        done = tables(*argv)
        assert done.returncode == 2 and done.stdout == ""
        assert done.stderr.count("\n") == 1 and done.stderr.startswith("tables.py winners: ")
        assert message in done.stderr, done.stderr
    assert out.read_text() == "the table before"


def test_a_device_run_with_every_direction_gives_rows_from_their_own_times(tmp_path):
    # what the gmm section writes at a target shape: both modes and dlhs, drhs alone, every
    # backend, pallas_gpu on aligned segments too (faster here, and never a winner: another
    # layout than auto's callers pass). dlhs and drhs winners differ from fwd+bwd's.
    recs = []
    for mode, per in (("fwd", {"mosaic_gpu": (5.0, 6.0), "tokamax": (5.5, 6.5)}),
                      ("fwd+bwd", {"mosaic_gpu": (15.0, 18.0), "tokamax": (16.0, 19.0)}),
                      ("dlhs", {"mosaic_gpu": (5.0, 6.0), "tokamax": (4.0, 5.0)}),
                      ("drhs", {"mosaic_gpu": (7.0, 8.0), "tokamax": (9.0, 9.5)})):
        recs += timings(QWEN, mode, dict(per, dense_xla=(1.0, 1.0)))
        recs += timings(QWEN, mode, {"pallas_gpu": (0.5, 0.5)}, aligned=True)
    runs = tmp_path / "gpu_bench.jsonl"
    runs.write_text("".join(json.dumps(r) + "\n" for r in gr.run(recs)))
    out = tmp_path / "winners.json"
    done = tables(runs, "--date", "2026-12-06", "--out", out)
    assert done.returncode == 0, done.stderr
    tab = winners.check_table(json.loads(out.read_text()))
    got = {r["direction"]: (r["backend"], r["mode"], r["times_ms"]) for r in tab["rows"]}
    assert got == {
        "fwd": ("mosaic_gpu", "fwd", {"mosaic_gpu": {"uniform": 5.0, "zipf": 6.0},
                                      "tokamax": {"uniform": 5.5, "zipf": 6.5}}),
        "dlhs": ("tokamax", "dlhs", {"mosaic_gpu": {"uniform": 5.0, "zipf": 6.0},
                                     "tokamax": {"uniform": 4.0, "zipf": 5.0}}),
        "drhs": ("mosaic_gpu", "drhs", {"mosaic_gpu": {"uniform": 7.0, "zipf": 8.0},
                                        "tokamax": {"uniform": 9.0, "zipf": 9.5}})}
    assert "Timed alone: dlhs, drhs." in tab["provenance"]["note"]
    assert "not timed alone" not in tab["provenance"]["note"]
