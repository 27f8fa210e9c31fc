"""The training loop: data -> jitted step -> metrics (JSON lines, terminal) -> checkpoints.

One function, `train(cfg)`, used by `dropless train`; everything it computes is also written to
RUN_DIR/metrics.jsonl (one JSON object per line: a "start" record, "step" records, "eval"
records and an "end" record, or a "stopped" record when a signal ended the run early).

Order of work, so that a refused run changes nothing: the memory pre-flight by the planner's
model (preflight.py; on a CPU), the run directory (rundir.py:
unique, locked), the resume decision (resume.py: nothing to do, other data, LR schedule), the
step's one compile (on abstract arguments, nothing allocated) with the memory pre-flight by its
memory analysis (on a GPU), then the state's allocation and the checkpoint's shapes
(checkpoint.check_compatible) all come before the first write; the step compiled there is the
step that runs; a new run that fails before its first step removes its directory; a resumed run
rewrites config.json only once its first step is done. A checkpoint that fails to restore or
verify (integrity.py) is skipped for the newest intact one, and only once that one is restored
are the damaged steps moved aside, a torn metrics.jsonl healed and the fall-back recorded.
SIGTERM/SIGINT stop the loop at the next step boundary with a checkpoint (signals.py), or,
before the first step, exit at once; a failed asynchronous save stops it at the next step
boundary (checkpoint.Saver). Batches come from data.loader (the run's packing, this process's
rows, `prefetch` ahead on a thread); a data file that changed underneath (data.shards.DataChanged)
stops the loop after the step in flight, with a checkpoint of that step and one error.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

import jax
import numpy as np

from dropless import machine
from dropless.config import TrainConfig
from dropless.models.arithmetic import flops_per_token, format_counts, param_counts
from dropless.ops.gmm.fallback import compile_auto
from dropless.parallel.mesh import batch_sharding, train_mesh
from dropless.parallel.sharding import state_shardings
from dropless import checkpoint as ckpt
from dropless.data import corpus as data_lib
from dropless.data.batch import from_windows
from dropless.data import loader as loader_lib
from dropless.data import sft as sft_lib
from dropless.data.shards import DataChanged
from dropless.train import guards as guards_lib
from dropless.train import preflight
from dropless.train import profile as profile_lib
from dropless.train.nonfinite import NonFiniteGuard
from dropless.train.outputs import Evaluator, MetricsWriter, Scalars
from dropless.train.overflow import OverflowGuard
from dropless.train import step as step_lib
from dropless.train.progress import Progress, Timed
from dropless.train.resume import plan_resume, position, restore_newest
from dropless.train.rundir import RunDir, heal_metrics, open_run_dir
from dropless.train.signals import StopRequest, stop_on_signals
from dropless.train.step_metrics import step_line, step_metrics


@dataclasses.dataclass
class RunResult:
    run_dir: Path
    losses: dict[int, float]          # step number (1-based, after the update) -> loss
    eval_losses: dict[int, float]
    start_step: int
    stopped_by: str = ""              # "SIGTERM"/"SIGINT" when a signal ended the run early
    nothing_to_do: bool = False       # the checkpoint was already at or past the last step
    preflight: dict = dataclasses.field(default_factory=dict)   # train/preflight.check's


def train(cfg: TrainConfig, *, echo: Callable[[str], Any] = print,
          stop_at: int | None = None, progress: Progress | None = None, resume: bool = False,
          strict_resume: bool = False, stop: StopRequest | None = None) -> RunResult:
    """Train (or resume, when the run directory holds checkpoints) until cfg.steps.

    `stop_at` ends early after that step (tests use it to simulate an interrupted run).
    `progress` defaults to a progress bar on a terminal (when `echo` is print), plain lines
    otherwise. A first SIGTERM/SIGINT stops after the step in flight with a checkpoint
    (`RunResult.stopped_by` names the signal); a second one exits the process at once; one
    before the first step exits at once with EXIT_PREEMPTED, removing a new run's directory
    (signals.py; `stop`: a request the command line installed already). `resume`: a resume
    was asked for (--resume), so a run without an intact checkpoint is refused;
    `strict_resume`: a damaged newest checkpoint refuses the resume instead of falling back.
    Raises ValueError for a config that cannot run (does not fit in memory, other data or other
    shapes than the checkpoint, damaged checkpoints with `strict_resume`),
    checkpoint.CheckpointError when a save fails, and rundir.RunDirInUse when another process
    holds the run directory.
    """
    step_lib.attention_kernel(cfg)   # one asked for that cannot run here: refused before all
    # the planner's model is checked now, before anything; the compiled step where the step
    # is compiled, before anything is allocated (_compile)
    fit = None if preflight.reads_compiled(cfg) else preflight.check(cfg)
    with stop_on_signals(stop) as stop:
        run = stop.open_undoable(functools.partial(open_run_dir, cfg), _startup_exit_words)
        prog = progress or Progress(echo)
        try:
            with ckpt.quiet_orbax_errors():
                return _run(cfg, run, prog, stop, stop_at, fit, resume=resume,
                            strict=strict_resume)
        except BaseException:
            if run.steps_done == 0:
                run.discard()            # removes only a directory this call created
            raise
        finally:
            prog.close()
            run.release()


def _startup_exit_words(run: RunDir, name: str) -> str:
    """Clean up for a signal before the first step (called from the signal watcher thread);
    the words that end its one line."""
    undone = run.undo()
    if undone:
        return f"; {undone}"
    return f"; {run.path} keeps its checkpoints (resume with: dropless train --resume {run.path})"


def _header(ctx: _Ctx, start: int) -> str:
    cfg, corpus = ctx.cfg, ctx.corpus
    return (f"dropless train: {ctx.out_dir}\n  model: {format_counts(ctx.counts)}; "
            f"{ctx.fpt['model'] / 1e6:.2f} MFLOPs/token (training)\n  data: {corpus.source} "
            f"({_data_words(corpus)}); "
            f"batch {cfg.global_batch_size} x {cfg.seq_len}"
            + (f" ({cfg.gradient_accumulation_steps} micro-batches of {cfg.micro_batch_size})"
               if cfg.gradient_accumulation_steps > 1 else "")
            + (f"; resuming at step {start}" if start else ""))


def _data_words(corpus) -> str:
    if isinstance(corpus, sft_lib.SftCorpus):
        return corpus.describe()
    return f"{corpus.train_TOK.size:,} train / {corpus.eval_TOK.size:,} eval tokens"


def _run(cfg: TrainConfig, run: RunDir, prog: Progress, stop: StopRequest,
         stop_at: int | None, fit: dict, *, resume: bool = False,
         strict: bool = False) -> RunResult:
    from dropless.model_dir import to_dict
    out_dir = run.path
    load = functools.partial(data_lib.load_corpus, tokenizer=cfg.tokenizer,
                             eval_fraction=cfg.eval_fraction, bin_dtype=cfg.bin_dtype,
                             vocab_size=cfg.model.vocab_size, seq_len=cfg.seq_len)
    if cfg.sft:
        corpus = sft_lib.load_sft(cfg.data, tokenizer=cfg.tokenizer,
                                  eval_fraction=cfg.eval_fraction, seq_len=cfg.seq_len,
                                  seed=cfg.seed, packing=cfg.packing)
    else:
        # with eval_data=, data='s held-out split is not read; eval_data= is held out whole
        corpus = load(cfg.data, splits=("train",) if cfg.eval_data else ("train", "eval"))
    if cfg.eval_data:
        if cfg.sft:
            raise ValueError(f"eval_data={cfg.eval_data!r}: with sft=true the held-out "
                             "examples come from data= (eval_fraction); leave eval_data unset")
        corpus = data_lib.with_eval_split(corpus, load(cfg.eval_data, key="eval_data",
                                                       splits=("eval",), held_out=True))
    if corpus.vocab_size > cfg.model.vocab_size:
        raise ValueError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the "
                         f"tokenizer's vocabulary ({corpus.vocab_size}); raise it or use "
                         "another tokenizer")
    for note in corpus.notes:
        prog.line(note)
    replan = functools.partial(plan_resume, cfg, out_dir, corpus.fingerprint(), stop_at=stop_at,
                               echo=prog.line, resume=resume, strict=strict)
    plan = replan()
    if plan.nothing_to_do:   # (says that alone, compiles nothing)
        return RunResult(out_dir, {}, {}, plan.start, nothing_to_do=True, preflight=fit or {})
    cfg, start = plan.cfg, plan.start
    mesh = train_mesh(cfg.mesh)   # the MoE layer sees any mesh of > 1 device (see train_mesh)
    writer = MetricsWriter(out_dir / "metrics.jsonl", prog.line)   # (refuses a bad path)
    # the one compile, on abstract arguments: before anything is allocated or written (a
    # resumed run's directory too), so the memory pre-flight can still refuse the run
    step_fn, gmm, compile_s, fit, opt, guards = _compile(cfg, mesh, prog, fit)
    prog.line(preflight.summary(fit))
    if run.created:
        run.write_json("config.json", to_dict(cfg))
    moe = cfg.model.moe
    fpt = flops_per_token(cfg.model, cfg.seq_len,
                          capacity_factor=moe.capacity_factor if moe else None)
    counts = param_counts(cfg.model)
    state, _ = step_lib.init_state(cfg)   # (its optimizer is `opt`: make_optimizer of cfg)
    if cfg.init_from:   # fine-tuning: start from existing weights (see train/init_from.py)
        from dropless.train.init_from import initial_params
        state["params"] = initial_params(cfg, announce=prog.line)
    saver = ckpt.Saver(ckpt.manager(out_dir / "checkpoints", keep=cfg.keep_checkpoints,
                                    async_save=cfg.async_checkpoints))
    batches = None
    try:
        if plan.latest is not None:
            state, plan = _restore_intact(plan, replan, saver, state, to_dict(cfg)["model"],
                                          out_dir, strict)
            start = plan.start            # an older step when the newest was damaged
        if not run.created:           # a resume: heal what a killed run left, then announce
            run.mark()                # (a run made before the run marker existed gets it)
            torn = heal_metrics(out_dir / "metrics.jsonl")
            if torn:
                prog.line(f"  {torn}")
        if plan.damaged:
            _set_aside(plan, saver, out_dir, prog)
        for note in plan.notes:
            prog.line(note)
        # placed as the step was compiled for (_abstract_inputs): committed on one device
        shard = state_shardings(state, mesh)
        state = jax.device_put(state, jax.devices()[0] if shard is None else shard)
        state = guards_lib.attach_all(guards, state)
        peak, peak_source = machine.peak_flops_per_device(cfg.model.dtype)
        ctx = _Ctx(cfg=cfg, opt=opt, mesh=mesh, out_dir=out_dir, corpus=corpus, counts=counts,
                   fpt=fpt, peak=peak, peak_source=peak_source, bshard=batch_sharding(mesh),
                   prog=prog, stop=stop, saver=saver, run=run, guards=guards,
                   writer=writer, evaluator=Evaluator(cfg, corpus, mesh, prog),
                   tb=Scalars(out_dir, start), config_json=to_dict(cfg),
                   loader=(batches := _loader(cfg, corpus, batch_sharding(mesh), start,
                                              plan.first_sample)))
        prog.line(_header(ctx, start))
        batch0 = ctx.loader.next()
        ctx.writer.record(*_start_record(ctx, compile_s, start, gmm))
        stop.begin_steps()        # start-up is over: a signal now stops after a step
        result = _loop(ctx, state, step_fn, batch0, start, stop_at)
        result.preflight = fit
        return result
    except BaseException:
        saver.close()
        raise
    finally:
        if batches is not None:
            batches.close()


def _restore_intact(plan, replan, saver: ckpt.Saver, like, model: dict, out_dir: Path,
                    strict: bool):
    """(restored state, plan) from the newest checkpoint that restores and verifies, through
    the one checkpoint reader (resume.restore_newest). Damaged data is never returned."""
    def read(step: int):
        ckpt.check_compatible(saver.mngr, step, like, model=model,
                              saved_model=(plan.saved or {}).get("model"), run_dir=out_dir)
        return ckpt.restore(saver.mngr, step, like)[0]
    return restore_newest(plan, replan, read, run_dir=out_dir, strict=strict)


def _set_aside(plan, saver: ckpt.Saver, out_dir: Path, prog: Progress) -> None:
    """Move the damaged steps newer than the restored one aside (never deleted), say so in one
    line each and in a "fallback" record of metrics.jsonl."""
    moved = []
    for d, dest in ckpt.set_aside(out_dir / "checkpoints", plan.damaged):
        moved.append({"step": d.step, "reason": d.reason, "detail": d.detail,
                      "moved_to": dest and str(dest.relative_to(out_dir))})
        prog.line(f"{d.text()}; resuming from step {plan.latest}, the newest intact checkpoint "
                  f"(the damaged step was {f'moved to {dest}' if dest else 'left in place'})")
    saver.mngr.reload()               # orbax lists the steps left in place
    MetricsWriter(out_dir / "metrics.jsonl", prog.line).record(
        {"event": "fallback", "resumed_from": plan.latest, "damaged": moved})


def _compile(cfg: TrainConfig, mesh, prog: Progress, fit: dict | None):
    """The run's step, compiled once on abstract arguments (`_abstract_inputs`: nothing is
    allocated) and checked against the device's memory: (the compiled step, wrapped by the
    guards, its state donated; what its grouped matmuls ran as (a kernel `auto` chose that
    fails to compile or run falls back, ops/gmm/fallback.py); compile seconds; the memory
    pre-flight: `fit` (the planner's model, checked already) or, where it is None, the
    compiled step's memory analysis (preflight.check(executable=...)); the optimizer; the
    guards). Raises preflight.DoesNotFit for a step that cannot fit."""
    like = jax.eval_shape(lambda: step_lib.init_state(cfg)[0])
    opt = step_lib.make_optimizer(cfg, like["params"])   # the one init_state makes
    # never apply a non-finite step (check_nan) nor an overflowing one (overflow="error");
    # the first guard wraps the step, the next wraps that
    guards = (NonFiniteGuard(cfg, opt=opt, mesh=mesh), OverflowGuard(cfg))
    fn = functools.partial(step_lib.train_step, cfg=cfg, opt=opt, mesh=mesh)
    fn = guards_lib.wrap_all(guards, fn)
    with Timed(prog, "compiling (first step)", "compiled") as t:
        step_fn, gmm = compile_auto(fn, *_abstract_inputs(cfg, like, guards, mesh),
                                    what="train step", jit_kwargs={"donate_argnums": 0})
    if fit is None:
        fit = preflight.check(cfg, executable=step_fn, compile_s=t.seconds)
    return step_fn, gmm, t.seconds, fit, opt, guards


def _abstract_inputs(cfg: TrainConfig, like, guards, mesh):
    """(state, batch) as ShapeDtypeStructs placed as the run places them: the state (`like`,
    init_state's shapes) committed to the first device, or on `state_shardings` over a mesh
    (a fresh and a restored state alike, so both lower to the same step), plus the guards'
    entries as `attach_all` adds them (uncommitted); the batch as the loader hands it, a
    data.batch.Batch of [B, S] (host arrays on one device, `batch_sharding` over a mesh)."""
    shard = state_shardings(like, mesh)
    if shard is None:
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shard = jax.tree.map(lambda _: one, like)
    placed = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          like, shard)
    guarded = jax.eval_shape(lambda s: guards_lib.attach_all(guards, s), like)
    state = {k: placed.get(k, v) for k, v in guarded.items()}
    bshard = batch_sharding(mesh)
    rows = from_windows(np.zeros((cfg.global_batch_size, cfg.seq_len + 1), np.int32))
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=bshard),
                         rows)
    return state, batch


def _peak_words(peak: float | None, source: str) -> str:
    """The start-up line of the peak MFU is measured against; where a measured CPU peak is
    cached (machine.cpu_peak_flops) is left to metrics.jsonl's "peak_source"."""
    return f"  peak {(peak or 0) / 1e12:.3f} TFLOPS/device ({source.split(', cached in ')[0]})"


def _start_record(ctx: _Ctx, compile_s: float, start: int, gmm=None) -> tuple[dict, str]:
    """The "start" record of metrics.jsonl and its line for the terminal."""
    cfg, peak, peak_src = ctx.cfg, ctx.peak, ctx.peak_source
    kernels = {}
    if cfg.time_kernels and cfg.model.moe is not None:
        from dropless.train.kernel_timing import time_moe_kernels
        kernels = time_moe_kernels(cfg)
    rec = {"event": "start", "resumed_from": start, "preset": cfg.preset,
           "params": ctx.counts, "flops_per_token": ctx.fpt, "peak_flops_per_device": peak,
           "peak_source": peak_src, "compile_s": compile_s, "devices": jax.device_count(),
           "corpus": ctx.corpus.fingerprint(), "busy_fraction": machine.busy_fraction(0.2),
           "moe_kernels": kernels, **(gmm.record() if gmm else {}),
           "attention_kernel": step_lib.attention_kernel(cfg), "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "machine": machine.machine_info()}
    line = (_peak_words(peak, peak_src)
            + (f"\n  MoE layer at this shape ({kernels['rows']} routed rows): grouped matmul "
               f"{kernels['gmm_ms']:.2f} ms, dispatch {kernels['dispatch_ms']:.2f} ms, "
               f"combine {kernels['combine_ms']:.2f} ms" if kernels else ""))
    return rec, line


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Ctx:
    """What the loop reads besides the state: config, optimizer, mesh, run directory, outputs,
    stop request; built once, after the step is compiled and the state placed."""

    cfg: TrainConfig
    opt: Any                          # the optimizer (train/step.make_optimizer)
    mesh: Any                         # the training mesh (parallel/mesh.train_mesh)
    out_dir: Path
    corpus: Any                       # data.Corpus
    counts: dict                      # models.arithmetic.param_counts
    fpt: dict                         # flops_per_token: {"model", "executed"}
    peak: float | None                # peak FLOP/s per device (None: no MFU)
    peak_source: str                  # where `peak` comes from (machine.peak_flops_per_device)
    bshard: Any                       # the batch sharding (None on one device)
    prog: Progress
    stop: StopRequest
    saver: ckpt.Saver
    run: RunDir
    guards: tuple[guards_lib.Guard, ...]   # the compiled step's guards, in wrapping order
    writer: MetricsWriter
    evaluator: Evaluator
    tb: Scalars
    config_json: dict
    loader: loader_lib.Loader         # the run's batches, from `start` on, built ahead

    def meta(self, step: int) -> dict:
        """The record saved beside checkpoint `step`: the data position and the corpus."""
        return {**position(self.cfg, step, self.loader.sample_of(step)),
                "corpus": self.corpus.fingerprint()}


def _loop(ctx: _Ctx, state, step_fn, batch0, start: int, stop_at: int | None) -> RunResult:
    """Steps start+1..end with one step in flight (as nanodo and MaxText do): step n+1 is
    dispatched, and step n+2's batch built on the host, before step n's metrics are read, so the
    device never waits for the host between steps. A step whose state the host needs (a
    checkpoint, an eval, the overflow or check_nan checks, the profiler's last step, a stop
    request, the last step; and the step before the profiler's first, so the trace starts
    clean) is read before the next one is dispatched: the step donates its
    input state, so step n's state is gone once step n+1 has it. Step time is the time between
    two completed steps (the reads), less eval and checkpoint time."""
    cfg, prog = ctx.cfg, ctx.prog
    result = RunResult(ctx.out_dir, {}, {}, start)
    end = cfg.steps if stop_at is None else min(cfg.steps, stop_at)
    profile = profile_lib.window(start, end, cfg.profile_steps)
    prog.start(first=start, total=end)
    clock = _Clock(time.perf_counter(), start)
    inflight = None                       # (n, batch, metrics) of a dispatched, unread step
    batch = batch0
    for i in range(start, end):
        if ctx.stop.requested:            # arrived during compilation or the previous save
            break
        if profile and i == profile.start:
            jax.profiler.start_trace(str(ctx.out_dir / "profile"))
        state, m = step_fn(state, batch)  # step i+1 is dispatched (its input state donated)
        if inflight is not None:          # step i: its metrics only, its state is step i+1's
            _finish(ctx, result, clock, *inflight, state=None, end=end, profile=profile)
        inflight = (i + 1, batch, m)
        if i + 1 < end:                   # host work while step i+1 runs
            try:
                batch = ctx.loader.next()
            except DataChanged as e:      # stop with step i+1 saved, never on a torn read
                _finish(ctx, result, clock, *inflight, state=state, end=end, profile=profile)
                raise _data_changed(ctx, state, i + 1, e) from None
        if _needs_state(ctx, i + 1, end, profile):
            _finish(ctx, result, clock, *inflight, state=state, end=end, profile=profile)
            inflight = None
    if inflight is not None:              # a signal came after the last check: stop there
        _finish(ctx, result, clock, *inflight, state=state, end=end, profile=profile)
    if ctx.stop.requested:
        return _stopped(ctx, result, state, clock.done)
    ctx.saver.finish()
    ctx.writer.record({"event": "end", "step": end, "final_loss": result.losses.get(end)})
    return result


@dataclasses.dataclass
class _Clock:
    last: float                           # when the last completed step was read
    done: int                             # the last completed (read and recorded) step


def _read_metrics(m: dict) -> dict:
    """Step metrics to the host: blocks until the step that computes them is done."""
    return jax.device_get(m)


def _loader(cfg: TrainConfig, corpus, sharding, start: int,
            first_sample: int) -> loader_lib.Loader:
    """The run's batches from step start+1 on (0-based index `start`, beginning at sample
    `first_sample`), as the step takes them, on the batch sharding, `cfg.prefetch` ahead."""
    if isinstance(corpus, sft_lib.SftCorpus):
        addr = sft_lib.Addressing(corpus.train, seq_len=cfg.seq_len, seed=cfg.seed,
                                  packing=cfg.packing, completion_only=cfg.sft_completion_only)
    else:
        addr = loader_lib.Addressing(loader_lib.as_stream(corpus.train_TOK, corpus.train_ends_D),
                                     seq_len=cfg.seq_len, packing=cfg.packing, seed=cfg.seed)
    return loader_lib.Loader(addr, batch_size=cfg.global_batch_size, sharding=sharding,
                             prefetch=cfg.prefetch, start=start, first_sample=first_sample)


def _data_changed(ctx: _Ctx, state, done: int, e: DataChanged) -> DataChanged:
    """A data file changed under the run: checkpoint step `done` (unless it is saved), wait
    for it, and the one-line error that says so."""
    saver = ctx.saver
    if done not in (saver.last_saved, saver.pending):
        saver.save(done, guards_lib.strip_all(ctx.guards, state), ctx.meta(done))
    saver.finish()
    ctx.writer.record({"event": "stopped", "step": done, "reason": "data changed"})
    return DataChanged(f"{e}; stopped after step {done} with a checkpoint (resume with: "
                       f"dropless train --resume {ctx.out_dir}, on the data it started with)")


class _Due(NamedTuple):
    checkpoint: bool                  # save step n
    eval: bool                        # evaluate after step n


def _due(cfg: TrainConfig, n: int, end: int) -> _Due:
    """What step n (1-based) of a run ending at `end` is due for: the one place the
    checkpoint and eval conditions are written (the last step does both, its checkpoint unless
    save_last_step=false)."""
    return _Due(checkpoint=bool(cfg.checkpoint_every and n % cfg.checkpoint_every == 0)
                or (n == end and cfg.save_last_step), eval=n % cfg.eval_every == 0 or n == end)


def _needs_state(ctx: _Ctx, n: int, end: int, profile: range) -> bool:
    """Whether finishing step n (1-based) reads its state, so the loop reads step n before it
    dispatches step n+1."""
    cfg = ctx.cfg
    return (any(_due(cfg, n, end)) or any(g.due(n) for g in ctx.guards) or ctx.stop.requested
            or bool(profile and n in (profile.start, profile.stop)))


def _finish(ctx: _Ctx, result: RunResult, clock: _Clock, n: int, batch, m: dict, *, state,
            end: int, profile: range) -> None:
    """Read step n's metrics and record them (metrics.jsonl, terminal, TensorBoard). With
    `state` (step n's, not yet given to step n+1) also run what reads the state, in this
    order: the guards that decide before the step is recorded (check_nan),
    those that decide after (overflow), eval, the checkpoint. Without it (step n+1 already has
    the state) `_needs_state` was false for n."""
    cfg, prog, saver = ctx.cfg, ctx.prog, ctx.saver
    m = _read_metrics(m)
    now = time.perf_counter()
    rec = step_metrics(m, step=n, dt=now - clock.last, cfg=cfg, fpt=ctx.fpt, peak=ctx.peak)
    rec["input_wait_s"] = ctx.loader.wait_s.pop(n - 1, 0.0)   # its batch: index n - 1
    clock.last, clock.done = now, n
    if profile and n == profile.stop:
        jax.profiler.stop_trace()
        prog.line(f"  profiler trace of steps {profile.start + 1}-{n} in {ctx.out_dir}/profile")
        _, groups = profile_lib.write_table(ctx.out_dir, steps=len(profile))
        prog.line(f"  kernel time by group ({profile_lib.TABLE}): "
                  f"{profile_lib.group_line(groups)}")
        clock.last = time.perf_counter()
    due = _due(cfg, n, end)
    check = functools.partial(guards_lib.check_all, ctx.guards, state=state, step=n, metrics=m,
                              batch=batch, force=due.checkpoint or ctx.stop.requested,
                              save=functools.partial(_save_last_good, ctx))
    if state is not None:
        check(guards_lib.BEFORE_RECORD)   # raises to stop the run before step n is recorded
    # step n is done (a refused one is not: a run refused at its first step is undone)
    ctx.run.steps_done += 1
    if ctx.run.steps_done == 1 and not ctx.run.created:
        ctx.run.write_json("config.json", ctx.config_json)   # the resume is under way
    result.losses[n] = rec["loss"]
    show = n % cfg.log_every == 0 or n == end
    ctx.writer.record(rec)
    prog.step(n, loss=rec["loss"], tokens_per_s=rec["tokens_per_s"],
              text=step_line(rec, cfg.model.mtp_loss_coef) if show else None)
    ctx.tb(n, {k: v for k, v in rec.items() if isinstance(v, (int, float))
               and k not in ("step", "event")})
    if state is None:
        saver.poll()                      # a failed asynchronous save stops the run here
        return
    check(guards_lib.AFTER_RECORD)
    if due.eval:
        ev = ctx.evaluator(state["params"])
        result.eval_losses[n] = ev
        ctx.tb(n, {"eval_loss": ev})
        ctx.writer.record({"event": "eval", "step": n, "eval_loss": ev},
                          f"  eval loss {ev:.4f} at step {n}")
        clock.last = time.perf_counter()   # eval time is not step time
    if due.checkpoint:
        saver.save(n, guards_lib.strip_all(ctx.guards, state), ctx.meta(n))
        clock.last = time.perf_counter()
    else:
        saver.poll()


def _save_last_good(ctx: _Ctx, good: int, state) -> Path:
    """A guard's `save`: checkpoint `state` as step `good` through the run's Saver (unless it
    is a checkpoint already), wait for it; the run directory, for the guard's message."""
    ctx.saver.save_last_good(good, guards_lib.strip_all(ctx.guards, state), ctx.meta(good))
    return ctx.out_dir


def _stopped(ctx: _Ctx, result: RunResult, state, done: int) -> RunResult:
    """A signal asked to stop: save the last completed step, flush, say how to resume."""
    saver, name = ctx.saver, ctx.stop.name
    result.stopped_by = name
    if ctx.run.steps_done and done not in (saver.last_saved, saver.pending):
        saver.save(done, guards_lib.strip_all(ctx.guards, state), ctx.meta(done))
    saver.finish()
    ctx.prog.close()
    undone = ctx.run.undo() if ctx.run.steps_done == 0 else None
    if undone:
        ctx.prog.line(f"stopped by {name} before the first step; {undone} (nothing to resume)")
        return result
    if ctx.run.steps_done:
        ctx.writer.record({"event": "stopped", "step": done, "signal": name})
    ctx.prog.line(f"stopped by {name} at step {done}, checkpoint saved; resume with: "
                  f"dropless train --resume {ctx.out_dir}")
    return result
