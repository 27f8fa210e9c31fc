"""The training loop: data -> jitted step -> metrics (JSON lines, terminal) -> checkpoints.

One function, `train(cfg)`, used by `dropless train`; everything it computes is also written to
RUN_DIR/metrics.jsonl (one JSON object per line: a "start" record, "step" records, "eval"
records and an "end" record).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from dropless.config import TrainConfig
from dropless.models.count import format_counts, param_counts
from dropless.train import checkpoint as ckpt
from dropless.train import data as data_lib
from dropless.train import mesh as mesh_lib
from dropless.train import metrics as met
from dropless.train import step as step_lib


@dataclasses.dataclass
class RunResult:
    run_dir: Path
    losses: dict[int, float]          # step number (1-based, after the update) -> loss
    eval_losses: dict[int, float]
    start_step: int


def run_path(cfg: TrainConfig) -> Path:
    name = cfg.run_name or time.strftime("%Y%m%d-%H%M%S") + f"-{cfg.preset or 'custom'}"
    return Path(cfg.run_dir) / name


def _peak(cfg: TrainConfig) -> tuple[float | None, str]:
    return met.peak_flops_per_device(cfg.model.dtype)


def _fmt_step(r: dict) -> str:
    mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
    load = r.get("expert_load_max_over_mean")
    return (f"step {r['step']:>5} | loss {r['loss']:.4f} | {r['step_time_s'] * 1e3:7.0f} ms | "
            f"{r['tokens_per_s']:8.0f} tok/s | {r['tflops_per_device']:.4f} TFLOPS/dev | "
            f"MFU {mfu} | load max/mean {load if load is None else f'{load:.2f}'} | "
            f"dropped {r['dropped_tokens']}")


class _Writer:
    def __init__(self, path: Path, echo: Callable[[str], Any]):
        self.path, self.echo = path, echo

    def record(self, rec: dict, line: str | None = None) -> None:
        with open(self.path, "a") as fh:
            fh.write(json.dumps(rec, default=float) + "\n")
        if line:
            self.echo(line)


def _step_metrics(m: dict, *, step: int, dt: float, cfg: TrainConfig, fpt: dict,
                  peak: float | None) -> dict:
    tokens = cfg.global_batch_size * cfg.seq_len
    rec = {"event": "step", "step": step, "step_time_s": dt}
    for k in ("loss", "ce_loss", "moe_loss", "mtp_loss", "grad_norm", "lr",
              "load_balance_loss", "seq_aux_loss", "z_loss"):
        if k in m:
            rec[k] = float(m[k])
    rec["dropped_tokens"] = int(m["dropped_tokens"])
    if "overflow_rounds" in m:
        rec["overflow_rounds"] = int(m["overflow_rounds"])
    rec.update(met.throughput(step_time_s=dt, tokens=tokens, flops_per_token=fpt["model"],
                              num_devices=cfg.num_devices, peak_flops_per_device=peak))
    rec["executed_tflops_per_device"] = rec["tflops_per_device"] * fpt["executed"] / fpt["model"]
    if "tokens_per_expert_LE" in m:
        le = np.asarray(m["tokens_per_expert_LE"])
        rec.update(met.expert_load_summary(le))
        rec["tokens_per_expert"] = le.tolist()
    return rec


def train(cfg: TrainConfig, *, echo: Callable[[str], Any] = print,
          stop_at: int | None = None) -> RunResult:
    """Train (or resume, when the run directory holds checkpoints) until cfg.steps.

    `stop_at` ends early after that step (tests use it to simulate an interrupted run).
    """
    out_dir = run_path(cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    from dropless.config_file import to_dict
    (out_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
    writer = _Writer(out_dir / "metrics.jsonl", echo)
    from dropless.train.tensorboard import ScalarWriter
    tb = ScalarWriter(out_dir)

    corpus = data_lib.load_corpus(cfg.data, tokenizer=cfg.tokenizer,
                                  eval_fraction=cfg.eval_fraction, bin_dtype=cfg.bin_dtype)
    if corpus.vocab_size > cfg.model.vocab_size:
        raise ValueError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the "
                         f"tokenizer's vocabulary ({corpus.vocab_size})")
    mesh = mesh_lib.make_mesh(cfg)
    model_mesh = mesh_lib.model_mesh(cfg, mesh)
    moe = cfg.model.moe
    fpt = met.flops_per_token(cfg.model, cfg.seq_len,
                              capacity_factor=moe.capacity_factor if moe else None)
    peak, peak_src = _peak(cfg)
    counts = param_counts(cfg.model)

    state, opt = step_lib.init_state(cfg)
    mngr = ckpt.manager(out_dir / "checkpoints", keep=cfg.keep_checkpoints,
                        async_save=cfg.async_checkpoints)
    start = 0
    latest = ckpt.latest_step(mngr)
    if latest is not None:
        state, meta = ckpt.restore(mngr, latest, state)
        if meta["corpus"] != corpus.fingerprint():
            raise ValueError(f"checkpoint {latest} in {out_dir} was made on different data: "
                             f"{meta['corpus']} != {corpus.fingerprint()}")
        start = int(meta["next_batch"])
    shard = mesh_lib.state_shardings(state, mesh)
    if shard is not None:
        state = jax.device_put(state, shard)
    bshard = mesh_lib.batch_sharding(mesh)

    fn = functools.partial(step_lib.train_step, cfg=cfg, opt=opt, mesh=model_mesh)
    batch0 = data_lib.batch_at(corpus.train_TOK, start, batch_size=cfg.global_batch_size,
                               seq_len=cfg.seq_len, seed=cfg.seed)
    if bshard is not None:
        batch0 = jax.device_put(batch0, bshard)
    t0 = time.perf_counter()
    step_fn = jax.jit(fn, donate_argnums=0).lower(state, batch0).compile()
    compile_s = time.perf_counter() - t0
    eval_fn = jax.jit(functools.partial(step_lib.eval_loss, cfg=cfg, mesh=model_mesh))
    evals = data_lib.eval_batches(corpus, num_batches=cfg.eval_batches,
                                  batch_size=cfg.global_batch_size, seq_len=cfg.seq_len)

    from dropless.bench.harness import busy_fraction, machine_info
    kernels = {}
    if cfg.time_kernels and moe is not None:
        from dropless.train.kernel_timing import time_moe_kernels
        kernels = time_moe_kernels(cfg)
    start_rec = {"event": "start", "resumed_from": start, "preset": cfg.preset,
                 "params": counts, "flops_per_token": fpt, "peak_flops_per_device": peak,
                 "peak_source": peak_src, "compile_s": compile_s, "devices": jax.device_count(),
                 "corpus": corpus.fingerprint(), "busy_fraction": busy_fraction(0.2),
                 "moe_kernels": kernels, "xla_flags": os.environ.get("XLA_FLAGS", ""),
                 "machine": machine_info()}
    writer.record(start_rec, f"dropless train: {out_dir}\n  model: {format_counts(counts)}; "
                  f"{fpt['model'] / 1e6:.2f} MFLOPs/token (training)\n  data: {corpus.source} "
                  f"({corpus.train_TOK.size:,} train / {corpus.eval_TOK.size:,} eval tokens); "
                  f"batch {cfg.global_batch_size} x {cfg.seq_len}\n  peak "
                  f"{(peak or 0) / 1e12:.3f} TFLOPS/device ({peak_src}); compile {compile_s:.1f} s"
                  + (f"; resumed at step {start}" if start else "")
                  + (f"\n  MoE layer at this shape ({kernels['rows']} routed rows): grouped matmul "
                     f"{kernels['gmm_ms']:.2f} ms, dispatch {kernels['dispatch_ms']:.2f} ms, "
                     f"combine {kernels['combine_ms']:.2f} ms" if kernels else ""))

    result = RunResult(out_dir, {}, {}, start)
    end = cfg.steps if stop_at is None else min(cfg.steps, stop_at)
    profile = range(start + 2, start + 2 + cfg.profile_steps)
    last = time.perf_counter()
    for i in range(start, end):
        if cfg.profile_steps and i == profile.start:
            jax.profiler.start_trace(str(out_dir / "profile"))
        batch = batch0 if i == start else data_lib.batch_at(
            corpus.train_TOK, i, batch_size=cfg.global_batch_size, seq_len=cfg.seq_len,
            seed=cfg.seed)
        if bshard is not None:
            batch = jax.device_put(batch, bshard)
        state, m = step_fn(state, batch)
        m = jax.device_get(m)
        now = time.perf_counter()
        rec = _step_metrics(m, step=i + 1, dt=now - last, cfg=cfg, fpt=fpt, peak=peak)
        last = now
        if cfg.profile_steps and i + 1 == min(profile.stop, end):
            jax.profiler.stop_trace()
            echo(f"  profiler trace of steps {profile.start + 1}-{i + 1} in {out_dir}/profile")
            last = time.perf_counter()
        result.losses[i + 1] = rec["loss"]
        show = (i + 1) % cfg.log_every == 0 or i + 1 == end
        writer.record(rec, _fmt_step(rec) if show else None)
        tb.scalars(i + 1, {k: v for k, v in rec.items() if isinstance(v, (int, float))
                           and k not in ("step", "event")})
        if (i + 1) % cfg.eval_every == 0 or i + 1 == end:
            ev = float(np.mean([float(eval_fn(state["params"], b)) for b in evals]))
            result.eval_losses[i + 1] = ev
            tb.scalars(i + 1, {"eval_loss": ev})
            writer.record({"event": "eval", "step": i + 1, "eval_loss": ev},
                          f"  eval loss {ev:.4f} at step {i + 1}")
            last = time.perf_counter()   # eval time is not step time
        if (cfg.checkpoint_every and (i + 1) % cfg.checkpoint_every == 0) or i + 1 == end:
            ckpt.save(mngr, i + 1, state, {"next_batch": i + 1, "corpus": corpus.fingerprint()})
            last = time.perf_counter()
    mngr.wait_until_finished()
    mngr.close()
    writer.record({"event": "end", "step": end, "final_loss": result.losses.get(end)})
    return result
