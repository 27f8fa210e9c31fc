"""Argument checks of `plan` and `bench`: every default and --quick set passes, so
the checks refuse only what is wrong (the refusals are rows of tests/_support/faults_cli.py)."""
import pytest

from dropless.cli import bench as bench_cli
from dropless.cli import build_parser


@pytest.mark.parametrize("kind", sorted(bench_cli.KINDS))
@pytest.mark.parametrize("extra", [[], ["--quick"]])
def test_bench_defaults_pass_the_checks(kind, extra):
    if extra and kind in ("quant", "gpu"):
        extra = ["--dry-run"] if kind == "gpu" else []
    args = build_parser().parse_args(["bench", kind, *extra])
    bench_cli.check_arguments(kind, args)


@pytest.mark.parametrize("argv,ok", [
    (["bench", "gmm", "--groups", "8, 64", "--dtypes", "bfloat16,float16"], True),
    (["bench", "gmm", "--groups", "8,,64"], False),
    (["bench", "moe", "--experts", "8:8,64:1", "--capacity-factors", "0.5"], True),
    (["bench", "moe", "--experts", "8:0"], False),
    (["bench", "dispatch", "--ep", "4", "--host-devices", "8", "--projection-tokens", "0"],
     True),
    (["bench", "dispatch", "--top-k", "65"], False),
    (["bench", "dispatch", "--buffer-factor", "0.9"], False),
    (["bench", "quant", "--backend", "nosuch"], False)])
def test_bench_checks(argv, ok):
    args = build_parser().parse_args(argv)
    if ok:
        bench_cli.check_arguments(argv[1], args)
    else:
        with pytest.raises(ValueError, match="--"):
            bench_cli.check_arguments(argv[1], args)


def test_plan_defaults_pass_and_sweep_sizes_parse():
    from dropless.cli import plan as plan_cli
    plan_cli.check_arguments(build_parser().parse_args(["plan"]))
    assert plan_cli._sweep_sizes("8, 16,32,") == [8, 16, 32]
    with pytest.raises(ValueError, match="names no cluster size"):
        plan_cli._sweep_sizes(",")
