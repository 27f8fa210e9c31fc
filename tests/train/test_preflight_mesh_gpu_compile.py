"""The memory pre-flight of a mesh, as XLA:GPU compiles it: `dropless plan --gpus 4 --fsdp 2
--ep 2 --compile-for h100` compiles the trainer's step for four compile-only H100s on one host
(train/compile_only.py, topology 1x1x4; `preflight.target_devices`), with the state and the batch
placed as the trainer places them, and prints one device's bytes beside the planner's; a config
that does not fit a device is refused in one line naming the bytes per device and the mesh.

deepseek3-test cut to two layers (one dense, one MoE), no MTP, sequence 256, remat=minimal:
one compile, about 20 s on an idle 2-core machine. The compiled step is checked against
what this project does not write: the arguments XLA's memory analysis counts on one device are
the state's bytes as a hand count shards them (below), and the HLO holds the GPU's
grouped-matmul kernels inside the dispatcher's shard_map and the ragged all-to-all that `auto`
dispatch runs on a GPU (a context mesh that broke its probe would have given plain
all-to-alls: preflight._gpu_target), and its weights' all-gathers and reduce-scatters over the
groups the planner charges. The one-device path: test_preflight_gpu_compile.py.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import re

import pytest

from dropless.cli import main
from dropless.cli.plan import add_arguments, settings
from dropless.plan.from_train import build_plan
from dropless.runtime import hlo_kernels
from dropless.train import preflight
from tests._support import cuda_compile
from tests._support.param_count import param_counts
from tests.train.test_step_accumulation_gpu_compile import _shape_bytes

cuda_compile.require_plugin()

TRITON, MOSAIC = "__gpu$xla.gpu.triton", "mosaic_gpu_v2"
ARGV = ["--preset", "deepseek3-test", "--hardware", "h100", "--gpus", "4", "--fsdp", "2",
        "--ep", "2", "--seq", "256", "--per-device-batch", "2", "--remat", "minimal",
        "model.num_layers=2", "model.mtp_depth=0"]


@pytest.fixture(scope="module")
def compiles() -> list:
    """Every `preflight.compiled` call of this module: (config, devices, its optimized HLO)."""
    real, seen = preflight.compiled, []

    def recorded(cfg, device, *, on_compiled=None):
        def keep(exe):
            seen.append((cfg, device, exe.as_text()))
            if on_compiled is not None:
                on_compiled(exe)
        return real(cfg, device, on_compiled=keep)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(preflight, "compiled", recorded)
        yield seen


@pytest.fixture(scope="module")
def planned(compiles, tmp_path_factory) -> tuple[int, str, dict, object, str]:
    """One `dropless plan ... --compile-for h100`: its status, text and --out JSON, the run the
    planner built from the same flags, and the HLO of the step it compiled."""
    out = tmp_path_factory.mktemp("plan") / "plan.json"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["plan", *ARGV, "--compile-for", "h100", "--out", str(out)])
    p = argparse.ArgumentParser()
    add_arguments(p)
    run = build_plan(settings(p.parse_args(ARGV))).plan.run
    (cfg, devs, hlo), = compiles
    assert cfg == run
    assert len(devs) == 4 and {d.device_kind for d in devs} == {"NVIDIA H100 80GB HBM3"}
    return rc, buf.getvalue(), json.loads(out.read_text()), run, hlo


def test_the_plan_prints_one_devices_compiled_bytes_of_the_mesh(planned):
    rc, text, result, run, _ = planned
    assert rc == 0
    assert (run.mesh.data, run.mesh.fsdp, run.mesh.expert) == (1, 2, 2)
    got = result["compiled_memory"]
    assert got["method"] == "compiled" and got["target"] == "h100" and got["devices"] == 4
    c = got["compiled"]
    assert got["total"] == c["arguments"] + c["outputs"] - c["aliased"] + c["temp"] + c["code"]
    assert got["limit"] == cuda_compile.MEMORY_BYTES["h100"] * 0.92 and got["total"] < got["limit"]
    lines = text.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith("  verdict:"))
    assert lines[at + 1].startswith(f"  compiled for 4 x h100 (jax {got['jax']}): "
                                    f"{got['total'] / 2 ** 30:.2f} GiB per device of ")


def test_the_arguments_are_one_devices_shard_of_the_state(planned):
    """Counted by hand from the parameters the model creates (tests/_support/param_count):
    routed experts [E, D, F] split over expert (2) and their model dim over fsdp (2); the
    router and the norms whole on every device; every other weight split over fsdp x expert
    (4) on its model, vocabulary or latent dim (ZeRO-3, MaxText's rule; all of
    deepseek3-test's divide by 4). Each float32 parameter
    comes with two float32 Adam moments (12 bytes); the batch is split over the 4 devices
    ([global 8 rows, S + 1] int32); the step counter, the key and the router-bias counters
    are a few hundred bytes."""
    _, _, result, run, _ = planned
    n = param_counts(run.model)
    whole = n["router"] + n["norms"]
    rest = n["total"] - n["routed_experts"] - whole
    per_device = 12 * (n["routed_experts"] / 4 + rest / 4 + whole)
    batch = (8 // 4) * (256 + 1) * 4
    args = result["compiled_memory"]["compiled"]["arguments"]
    assert per_device + batch <= args <= per_device + batch + 4096, (args, per_device + batch)


def test_the_step_runs_the_gpus_grouped_matmuls_and_ragged_all_to_all(planned):
    """One MoE layer: the forward's three grouped matmuls (gate, up, down), their dlhs and
    drhs, nine (remat=minimal keeps the forward's outputs), as the GPU's Pallas/Mosaic
    kernels lowered for the H100 inside the shard_map, not XLA's ragged_dot; the tokens travel
    by ragged all-to-all (`auto` dispatch on a GPU: ragged_a2a)."""
    hlo = planned[4]
    assert "ragged-dot" not in hlo
    gmm = [r for r in hlo_kernels.kernels(hlo) if r["group"] == "moe_gmm"
           and r["kind"] in (TRITON, MOSAIC)]
    assert len(gmm) == 9, gmm
    assert " ragged-all-to-all" in hlo


def _group_size(groups: str, devices: int) -> int:
    """Devices in one replica group of an HLO collective, as XLA spells it: named
    (`mesh['data'=1,'fsdp'=2,'expert'=2] {'fsdp','expert'}`), iota (`[1,4]<=[4]`) or listed
    (`{{0,1},{2,3}}`; `{}`: every device)."""
    if m := re.match(r"mesh\[([^\]]*)\] \{([^}]*)\}", groups):
        sizes = dict(p.split("=") for p in m.group(1).replace("'", "").split(","))
        return math.prod(int(sizes[a]) for a in m.group(2).replace("'", "").split(","))
    if m := re.match(r"\[(\d+),(\d+)\]<=", groups):
        return int(m.group(2))
    if m := re.match(r"\{\{([0-9,]*)\}", groups):
        return len(m.group(1).split(","))
    return devices


def _bytes_by_group(hlo: str, op: str, devices: int) -> dict[int, int]:
    """Result bytes of every `op` in `hlo`, by the size of its replica groups."""
    out: dict[int, int] = {}
    for m in re.finditer(rf"= (\S+|\(.*?\)) {op}(?:-start)?\((.*)", hlo):
        groups = re.search(r"replica_groups=(mesh\[[^\]]*\] \{[^}]*\}|[^ ]*)", m.group(2))
        size = _group_size(groups.group(1).rstrip(","), devices)
        out[size] = out.get(size, 0) + _shape_bytes(m.group(1))
    return out


def test_the_weights_gather_and_reduce_scatter_over_the_groups_the_planner_charges(planned):
    """The collective groups the planner charges (plan.layout.groups, from the placement), as
    XLA:GPU compiled them: the non-expert matrices are all-gathered, and their gradients
    reduce-scattered, over all four devices (fsdp 2 x expert 2); the routed experts' model dim
    is gathered over fsdp's two and their gradients reduce-scattered there (gathered inside
    the dispatcher's shard_map: taken whole at its boundary, they were all-reduced over fsdp,
    twice the bytes, then sliced). No gradient is all-reduced over two devices (data is 1).
    (`rest` counts the attention's norm vectors, 128 parameters that stay whole: hence 0.99.)"""
    _, _, _, run, hlo = planned
    n = param_counts(run.model)
    rest = n["total"] - n["routed_experts"] - n["router"] - n["norms"]
    scattered = _bytes_by_group(hlo, "reduce-scatter", 4)
    gathered = _bytes_by_group(hlo, "all-gather", 4)
    reduced = _bytes_by_group(hlo, "all-reduce", 4)
    # a float32 gradient shard of every non-expert matrix, a quarter of each: `rest` bytes
    assert scattered.get(4, 0) >= 0.99 * rest, (scattered, rest)
    # a float32 shard of the routed experts' gradient: half of one expert rank's half
    assert scattered.get(2, 0) >= n["routed_experts"], (scattered, n["routed_experts"])
    assert 2 not in reduced, reduced
    assert gathered.get(4, 0) >= 0.99 * 4 * rest, (gathered, rest)   # whole again, float32
    assert gathered.get(2, 0) >= 4 * n["routed_experts"] // 2, (gathered, n["routed_experts"])


def test_a_config_that_cannot_fit_a_device_of_the_mesh_is_refused_in_one_line(
        planned, capsys, monkeypatch):
    """The same plan against a device with half the bytes its compiled step needs: refused in
    one line naming one device's compiled bytes and the mesh. The step is the one `planned`
    compiled (its figures handed back, not compiled again: the refusal is about the limit);
    a config refused by a real device's memory: test_plan_gpu_compile.py."""
    _, _, result, run, _ = planned
    got = result["compiled_memory"]
    monkeypatch.setattr(preflight, "compiled", lambda cfg, device, **_: (
        dict(got["compiled"]) if cfg == run else pytest.fail("another step was compiled")))
    monkeypatch.setattr(preflight, "target_limit", lambda kind: (got["total"] / 2, "half"))
    assert main(["plan", *ARGV, "--compile-for", "h100"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    # "(modified)": the model's layers and MTP are not the preset's
    assert err.startswith("dropless: error: --compile-for h100: deepseek3-test (modified): "
                          "per_device_batch_size=2 x seq_len=256 (remat=minimal, mesh data=1 x "
                          "fsdp=2 x expert=2) does not fit: "
                          f"{got['total'] / 2 ** 30:.2f} GiB per device by the compiled step, "
                          f"{got['total'] / 2 ** 31:.2f} GiB available (half); "), err
