"""`dropless bench quant`: the error metrics, the per-tensor baseline and the CLI wiring."""
import argparse
import json

import numpy as np
import pytest

from dropless.cli import bench as bench_cli
from dropless.bench import quant, quant_convergence


def test_quant_errors_by_hand():
    x = np.ones((1, 64), np.float32)
    xq = x.copy()
    xq[0, 40] = 1.5  # one error of 0.5 in the second block only
    e = quant.quant_errors(x, xq)
    assert e["rel_frobenius"] == pytest.approx(0.5 / 8.0)
    assert e["worst_block_rel"] == pytest.approx(0.5 / np.sqrt(32))


def test_per_tensor_fp8_is_exact_on_e4m3_values_and_loses_small_ones():
    x = np.array([[448.0, 1.0, -2.0, 0.5]], np.float32)
    np.testing.assert_array_equal(np.asarray(quant.per_tensor_fp8(x)), x)
    x = np.array([[448.0, 1e-4]], np.float32)  # below the smallest subnormal 2**-9 at scale 1
    assert np.asarray(quant.per_tensor_fp8(x))[0, 1] == 0.0


def test_error_rows_tell_the_methods_apart():
    rows = {r["data"] + "/" + r["method"]: r for r in quant.error_rows(shape=(16, 256))}
    # rows 2**24 apart: one tensor-wide scale flushes the small rows, per-block scales do not
    assert rows["wide_rows/per_tensor_e4m3"]["worst_block_rel"] > 0.9
    assert rows["wide_rows/mxfp8_e4m3_floor"]["worst_block_rel"] < 0.15
    # floor scales saturate block maxima (up to 1/8 of the largest element), round-up never
    for data in ("normal", "heavy_tailed"):
        up, floor = rows[f"{data}/mxfp8_e4m3_up"], rows[f"{data}/mxfp8_e4m3_floor"]
        assert up["worst_block_rel"] < floor["worst_block_rel"]
        assert up["rel_frobenius"] < 0.05


def test_sample_rejects_unknown_kind():
    with pytest.raises(ValueError, match="kind='cauchy'"):
        quant.sample("cauchy", (2, 2))


def test_cli_runs_accuracy_parts(tmp_path, capsys):
    out = tmp_path / "q.jsonl"
    # the quant kind's own parser: the flags as `dropless bench quant` parses them
    kind = bench_cli.KINDS["quant"]
    assert kind.module == "dropless.bench.quant"
    parser = argparse.ArgumentParser()
    kind.add_arguments(parser)
    args = kind.options(parser.parse_args([
        "--shape", "64", "32", "32", "2", "--backend", "ragged_dot", "--skip-cost",
        "--error-shape", "8", "64", "--out", str(out)]))
    assert args == quant.QuantOptions(shape=(64, 32, 32, 2), error_shape=(8, 64),
                                      backend="ragged_dot", skip_cost=True, out=str(out))
    assert quant.run(args) == 0
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["part"] for r in recs} == {"error", "gmm"}
    gmm = {r["method"]: r["rel_frobenius"] for r in recs if r["part"] == "gmm"}
    assert gmm["mxfp8"] < 0.05 and gmm["bf16"] < gmm["mxfp8"]
    assert "mxfp8_e4m3_up" in capsys.readouterr().out


def test_task_config_validation():
    with pytest.raises(ValueError, match="TaskConfig.tokens=0"):
        quant_convergence.TaskConfig(tokens=0)
    with pytest.raises(ValueError, match="steps=3"):
        quant_convergence.compare(steps=3)
