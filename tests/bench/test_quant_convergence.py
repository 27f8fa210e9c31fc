"""The preset convergence comparison: its loss-gap arithmetic, its config, its flags."""
import argparse

import pytest

from dropless.bench import quant_convergence as qc
from dropless.cli import bench as bench_cli


def test_loss_gaps_by_hand():
    # 20 steps compared (the shorter run): the final window is the last 2 of them
    runs = [{"quantization": "none", "steps": 20, "losses": [9.0] * 18 + [2.0, 2.0],
             "final_eval_loss": 1.0},
            {"quantization": "nvfp4", "steps": 21, "losses": [9.0] * 18 + [2.0, 2.2, 0.0],
             "final_eval_loss": 1.25}]
    rec = qc.loss_gaps(runs)
    assert rec["steps_compared"] == 20 and rec["final_window"] == 2
    assert rec["final"] == pytest.approx({"none": 2.0, "nvfp4": 2.1})
    assert rec["final_gap_rel"] == pytest.approx({"nvfp4": 0.05})
    assert rec["eval_gap_rel"] == pytest.approx({"nvfp4": 0.25})


def test_preset_config_changes_only_the_expert_precision(tmp_path):
    a, b = (qc.preset_config("tiny", q, steps=30, run_dir=str(tmp_path), batch=4, seq_len=32)
            for q in ("none", "nvfp4"))
    assert (a.model.moe.gmm_quantization, b.model.moe.gmm_quantization) == ("none", "nvfp4")
    assert a.model.moe.dtype == b.model.moe.dtype == "bfloat16"
    assert a.model.replace(moe=b.model.moe) == b.model
    assert a.checkpoint_every == 0 and a.eval_every == 30


def test_bad_quantizations_and_steps_are_refused():
    kind = bench_cli.KINDS["quant"]
    parser = argparse.ArgumentParser()
    kind.add_arguments(parser)
    args = parser.parse_args(["--convergence", "--preset", "tiny", "--quantizations",
                              "none,fp4"])
    with pytest.raises(ValueError, match="--quantizations: 'fp4'"):
        kind.options(args)
    with pytest.raises(ValueError, match="steps=5"):
        qc.compare_preset(steps=5)
