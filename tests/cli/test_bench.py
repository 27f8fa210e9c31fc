"""The benches' options and start-up: `dropless bench KIND`'s defaults are KIND's options'
defaults, its flags reach the options typed, `--quick` gives the smoke-run sizes, and every timed
bench starts with the same header line."""
import argparse
import dataclasses

import pytest

from dropless import machine
from dropless.bench import data, dispatch, gmm, gpu, harness, init_convergence, moe, prepare, quant
from dropless.cli import bench as bench_cli

OPTIONS = {"data": data.DataOptions, "dispatch": dispatch.DispatchOptions, "gmm": gmm.GmmOptions,
           "gpu": gpu.GpuOptions, "moe": moe.MoEOptions, "prepare": prepare.PrepareOptions,
           "quant": quant.QuantOptions, "init": init_convergence.InitOptions}


def _cli_options(kind: str, argv: list[str]):
    """What `dropless bench KIND ARGV` hands KIND's `run`."""
    parser = argparse.ArgumentParser()
    bench_cli.KINDS[kind].add_arguments(parser)
    args = parser.parse_args(argv)
    bench_cli.check_arguments(kind, args)
    return bench_cli.KINDS[kind].options(args)


@pytest.mark.parametrize("kind", sorted(bench_cli.KINDS))
def test_the_command_line_defaults_are_the_options_defaults(kind, monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    assert _cli_options(kind, []) == OPTIONS[kind]()


def test_flags_reach_the_options_typed():
    assert _cli_options("gmm", ["--groups", "8, 64", "--dtypes", "bfloat16", "--backends",
                                "tiled,loop", "--routings", "zipf", "--budget-s", "5"]) == \
        gmm.GmmOptions(groups=(8, 64), dtypes=("bfloat16",), backends=("tiled", "loop"),
                       routings=("zipf",), budget_s=5.0)
    assert _cli_options("moe", ["--experts", "8:2,16:4", "--capacity-factors", "",
                                "--no-fused"]) == \
        moe.MoEOptions(experts=((8, 2), (16, 4)), capacity_factors=(), fused=False)
    assert _cli_options("dispatch", ["--dispatchers", "a2a", "--routings", "zipf",
                                     "--rows-only"]) == \
        dispatch.DispatchOptions(dispatchers=("a2a",), routings=("zipf",), rows_only=True)
    assert _cli_options("gpu", ["--sections", "info,,gmm", "--shapes", "G8", "--cap", "gmm=3",
                                "--cap", "moe=4.5", "--inject-fault", "gmm=raise,moe:8:2=exit",
                                "--out-dir", "o"]) == \
        gpu.GpuOptions(sections=("info", "gmm"), shapes=("G8",), caps={"gmm": 3.0, "moe": 4.5},
                       faults={"gmm": "raise", "moe:8:2": "exit"}, out_dir="o")


@pytest.mark.parametrize("options,quick", [
    (gmm.GmmOptions(), dict(m=2048, k=256, n=256, repeats=3, groups=(8, 64),
                            routings=("uniform", "half"))),
    (moe.MoEOptions(), dict(rows=2048, d_model=256, d_ff=256, repeats=3, experts=((8, 2),),
                            routings=("uniform",), cases=((512, 8, 2, 128, 128),))),
    (dispatch.DispatchOptions(), dict(tokens=1024, d_model=128, d_ff=128, repeats=3,
                                      projection_tokens=1024)),
    (dispatch.DispatchOptions(projection_tokens=0), dict(tokens=1024, d_model=128, d_ff=128,
                                                         repeats=3, projection_tokens=0)),
])
def test_quick_is_the_smoke_run(options, quick, monkeypatch, capsys):
    monkeypatch.setattr(machine, "busy_fraction", lambda seconds=0.5: 0.25)
    got, _, _ = harness.start(dataclasses.replace(options, quick=True))
    assert got == dataclasses.replace(options, quick=True, **quick)
    capsys.readouterr()


def test_the_start_up_header_line(monkeypatch, capsys):
    info = {"cpu": "Some CPU", "cores": 2, "jax": "0.0", "platform": "cpu"}
    monkeypatch.setattr(machine, "machine_info", lambda: info)
    monkeypatch.setattr(machine, "busy_fraction", lambda seconds=0.5: 0.125)
    options = gmm.GmmOptions()
    assert harness.start(options) == (options, info, 0.125)
    assert capsys.readouterr().out == \
        "# Some CPU x2, jax 0.0, cpu; others' load before start: 0.125\n"
    harness.start(dispatch.DispatchOptions(), devices=8)
    assert capsys.readouterr().out == \
        "# Some CPU x2, jax 0.0, 8 cpu devices; others' load before start: 0.125\n"


def test_bench_init_flags_reach_its_options_and_a_bad_scheme_is_named():
    got = _cli_options("init", ["--seeds", "0, 3", "--schemes", "fan_in,maxtext",
                                "--set", "model.head_init_std=0.1", "--steps", "20"])
    assert got == init_convergence.InitOptions(seeds=(0, 3), schemes=("fan_in", "maxtext"),
                                               overrides=("model.head_init_std=0.1",), steps=20)
    with pytest.raises(ValueError, match="--schemes: 'xavier' is not one of"):
        _cli_options("init", ["--schemes", "xavier"])
    with pytest.raises(ValueError, match="--set: 'x' is not KEY=VALUE"):
        _cli_options("init", ["--set", "x"])
