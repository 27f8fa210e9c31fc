"""The trainer compiles its step once (train/loop.py `_compile`), on abstract arguments, before
anything is allocated, and the memory pre-flight reads that executable where it reads a compiled
step (train/preflight.py `reads_compiled`: a GPU, one device or a mesh). Here on a CPU with
"cpu" added to `preflight.COMPILED_PLATFORMS`, so the GPU's path runs: one compile of the train
step (counted at `jax.stages.Lowered.compile` and as traces of `step.train_step`), its memory
analysis is the pre-flight's figure (checked against the arithmetic written out here), and a
step that does not fit is refused before the state is initialised or a checkpoint restored,
leaving no new run directory and a resumed one byte-identical."""
from __future__ import annotations

import functools
import json
import math
import shutil

import jax
import jax.numpy as jnp
import pytest

from dropless import checkpoint as ckpt
from dropless.train import preflight
from dropless.train import step as step_lib
from dropless.train.loop import train

from tests._support.train_mini import mini, shared_compilation_cache, snapshot

QUIET = dict(echo=lambda s: None)
SMALL = 64 * 2 ** 10    # bytes: less than the mini model's state alone (~430 KiB)


@pytest.fixture(scope="module", autouse=True)
def compilation_cache(tmp_path_factory):
    """Runs of one config share XLA's compile (a cache hit is still a Lowered.compile call,
    which is what is counted here)."""
    yield from shared_compilation_cache(tmp_path_factory)


@pytest.fixture
def gpu_path(monkeypatch):
    """The pre-flight reads the compiled step on this CPU, as it does on a GPU."""
    monkeypatch.setattr(preflight, "COMPILED_PLATFORMS", preflight.COMPILED_PLATFORMS + ("cpu",))


@pytest.fixture
def compiles(monkeypatch):
    """{"compiled": [the train step's executables, one per Lowered.compile of a function whose
    first argument is a train state], "traces": n (of step.train_step)}."""
    seen = {"compiled": [], "traces": 0}
    real_compile, real_step = jax.stages.Lowered.compile, step_lib.train_step

    def compile_(self, *args, **kwargs):
        out = real_compile(self, *args, **kwargs)
        first = self.args_info[0][0]
        if isinstance(first, dict) and "opt_state" in first:
            seen["compiled"].append(out)
        return out

    @functools.wraps(real_step)
    def traced(*args, **kwargs):
        seen["traces"] += 1
        return real_step(*args, **kwargs)

    monkeypatch.setattr(jax.stages.Lowered, "compile", compile_)
    monkeypatch.setattr(step_lib, "train_step", traced)
    return seen


@pytest.fixture
def allocations(monkeypatch):
    """What the trainer allocated: "init_state" when it built a concrete state (its abstract
    shapes, under jax.eval_shape, are not an allocation), "restore" per checkpoint read."""
    seen = []
    real_init, real_restore = step_lib.init_state, ckpt.restore

    def init_state(cfg):
        out = real_init(cfg)
        if not isinstance(out[0]["step"], jax.core.Tracer):
            seen.append("init_state")
        return out

    def restore(*args, **kwargs):
        seen.append("restore")
        return real_restore(*args, **kwargs)

    monkeypatch.setattr(step_lib, "init_state", init_state)
    monkeypatch.setattr(ckpt, "restore", restore)
    return seen


def _start(run_dir) -> dict:
    recs = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in recs if r["event"] == "start")


@pytest.mark.parametrize("guards", [{}, {"check_nan": True, "model.moe.overflow": "error"}],
                         ids=["plain", "guarded"])   # guarded: the overflow record in the state
def test_the_step_is_compiled_once_and_the_preflight_reads_it(tmp_path, gpu_path, compiles,
                                                              guards):
    lines = []
    res = train(mini(tmp_path, steps=2, checkpoint_every=0, eval_every=10, **guards),
                echo=lines.append)
    assert sorted(res.losses) == [1, 2]
    assert compiles["traces"] == 1 and len(compiles["compiled"]) == 1, compiles
    (executable,) = compiles["compiled"]
    fit = res.preflight
    assert fit["method"] == "compiled"
    # the reference: XLA's memory analysis of the executable that ran, added up here
    ma = executable.memory_analysis()
    want = (ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
            + ma.temp_size_in_bytes + ma.generated_code_size_in_bytes)
    assert fit["total"] == want and fit["compiled"]["total"] == want
    assert ma.alias_size_in_bytes > 0        # the state is donated: the step the trainer runs
    # compile_s is the one compile's, in the pre-flight and in the "start" record alike
    assert fit["compiled"]["compile_s"] == _start(res.run_dir)["compile_s"] > 0
    memory = [i for i, ln in enumerate(lines) if ln.startswith("  memory: ")]
    assert len(memory) == 1 and "by the compiled step's memory analysis" in lines[memory[0]]
    assert lines[memory[0] - 2] == "compiling (first step)..."   # read from that compile


def test_on_a_mesh_the_preflight_reads_one_devices_share(tmp_path, gpu_path, compiles):
    """On fsdp 2 x expert 2 the compiled step's arguments are one device's shards: XLA's
    argument bytes equal the shard shapes of the executable's own input shardings, summed
    here, and are less than half the whole state and batch."""
    mesh = {"mesh.data": 1, "mesh.fsdp": 2, "mesh.expert": 2}
    res = train(mini(tmp_path, steps=1, checkpoint_every=0, eval_every=10, **mesh), **QUIET)
    (executable,) = compiles["compiled"]
    fit = res.preflight
    assert fit["method"] == "compiled" and res.losses
    infos = jax.tree.leaves(executable.args_info)
    shardings = jax.tree.leaves(executable.input_shardings)
    assert len(infos) == len(shardings)
    nbytes = lambda shape, dtype: math.prod(shape) * jnp.dtype(dtype).itemsize  # noqa: E731
    shard = sum(nbytes(s.shard_shape(a.shape), a.dtype) for a, s in zip(infos, shardings))
    whole = sum(nbytes(a.shape, a.dtype) for a in infos)
    assert {len(s.device_set) for s in shardings} == {4}
    assert fit["compiled"]["arguments"] == shard < whole / 2
    ma = executable.memory_analysis()
    assert fit["total"] == (ma.argument_size_in_bytes + ma.output_size_in_bytes
                            - ma.alias_size_in_bytes + ma.temp_size_in_bytes
                            + ma.generated_code_size_in_bytes)


@pytest.mark.parametrize("how", ["model", "skipped"])
def test_every_other_path_compiles_it_once_too(tmp_path, monkeypatch, compiles, how):
    if how == "skipped":
        monkeypatch.setattr(preflight, "COMPILED_PLATFORMS",
                            preflight.COMPILED_PLATFORMS + ("cpu",))
        monkeypatch.setenv("DROPLESS_NO_PREFLIGHT", "1")
    lines = []
    res = train(mini(tmp_path, steps=1, checkpoint_every=0, eval_every=10), echo=lines.append)
    assert res.preflight["method"] == how and "compiled" not in res.preflight
    assert compiles["traces"] == 1 and len(compiles["compiled"]) == 1, compiles
    assert _start(res.run_dir)["compile_s"] > 0
    words = {"model": "by the planner's memory model", "skipped": "skipped"}[how]
    assert sum(ln.startswith("  memory") and words in ln for ln in lines) == 1, lines


def test_a_new_run_that_does_not_fit_is_refused_before_allocation(tmp_path, monkeypatch,
                                                                   gpu_path, compiles,
                                                                   allocations):
    monkeypatch.setattr(preflight, "device_memory", lambda cfg: (SMALL, "a 64 KiB test device"))
    with pytest.raises(preflight.DoesNotFit, match=r"per_device_batch_size=4 x seq_len=32 "
                       r"\(remat=none\) does not fit: .* per device by the compiled step, "
                       r"0\.00 GiB available \(a 64 KiB test device\)"):
        train(mini(tmp_path, steps=2, run_name="big"), **QUIET)
    assert len(compiles["compiled"]) == 1 and allocations == []
    assert not (tmp_path / "runs").exists()          # the new run's directory is removed


def test_a_resume_that_does_not_fit_changes_nothing(tmp_path, monkeypatch, gpu_path,
                                                    allocations):
    base = train(mini(tmp_path, steps=2, run_name="base", time_kernels=False), **QUIET)
    run = tmp_path / "runs" / "again"
    shutil.copytree(base.run_dir, run)
    before = snapshot(run)
    allocations.clear()
    device_memory = preflight.device_memory
    monkeypatch.setattr(preflight, "device_memory", lambda cfg: (SMALL, "a 64 KiB test device"))
    with pytest.raises(preflight.DoesNotFit, match=r"by the compiled step"):
        train(mini(tmp_path, steps=4, run_name="again"), **QUIET)
    assert allocations == []                          # no state built, no checkpoint read
    assert snapshot(run) == before
    monkeypatch.setattr(preflight, "device_memory", device_memory)   # the host's memory: fits
    res = train(mini(tmp_path, steps=4, run_name="again", time_kernels=False), **QUIET)
    assert res.start_step == 2 and sorted(res.losses) == [3, 4]
