"""Convergence with quantized grouped matmuls: a preset trained with bf16, MXFP8 and NVFP4
expert matmuls (`compare_preset`), and a two-layer MoE regression task, bf16 vs MXFP8
(`compare`).

Legend: T tokens in a batch, D model dim, H teacher hidden dim.

`compare_preset` trains a named preset (the `tiny` one by default) with the trainer
(`dropless.train.loop.train`) once per `MoEConfig.gmm_quantization`, with the same config,
initialisation and batches otherwise, and the expert activations and matmul inputs in bfloat16
(`model.moe.dtype`) in every run, so "none" is the bf16 grouped matmul the quantized ones are
measured against; everything outside the experts (attention, dense layers, shared experts,
router, embeddings, head) stays in its preset precision in all runs, as the NVFP4 recipe keeps
them in high precision.

The regression task: a student of two residual MoE layers (h = x + moe1(x), y = h + moe2(h))
learns to match a frozen random teacher x + gelu(x @ W1_DH) @ W2_HD on fresh N(0,1) tokens
every step (a smooth target the student can keep approaching, so the loss falls by an order of
magnitude and a precision floor would show). Both runs start from the same initialisation and
see the same batches; the only difference is `MoEConfig.gmm_quantization` ("none" vs "mxfp8",
bfloat16 activations). The student trains with the trainer's step (`train.step.train_step`,
its objective the regression loss) under `student_config`: Adam at a constant learning rate,
no weight decay, no clipping.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from dropless.config import ModelConfig, MoEConfig, TrainConfig
from dropless.moe import layer
from dropless.train import step as step_lib


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskConfig:
    """The regression task: model size, batch, optimiser."""

    num_experts: int = 8
    top_k: int = 2
    d_model: int = 64
    d_ff: int = 128
    tokens: int = 256
    teacher_hidden: int = 256
    learning_rate: float = 3e-3
    load_balance_coef: float = 0.01
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "d_model", "d_ff", "tokens", "teacher_hidden"):
            if getattr(self, name) <= 0:
                raise ValueError(f"TaskConfig.{name}={getattr(self, name)!r} must be > 0")
        if not self.learning_rate > 0:
            raise ValueError(f"TaskConfig.learning_rate={self.learning_rate!r} must be > 0")


def moe_config(task: TaskConfig, quantization: str, backend: str, dtype: str) -> MoEConfig:
    return MoEConfig(num_experts=task.num_experts, top_k=task.top_k, d_model=task.d_model,
                     d_ff=task.d_ff, dtype=dtype, gmm_backend=backend,
                     gmm_quantization=quantization, load_balance_coef=task.load_balance_coef)


def init(key: jax.Array, cfg: MoEConfig) -> dict[str, Any]:
    k1, k2 = jax.random.split(key)
    return {"moe1": layer.init_params(k1, cfg), "moe2": layer.init_params(k2, cfg)}


def forward(params, x_TD: jax.Array, cfg: MoEConfig) -> tuple[jax.Array, jax.Array]:
    """Two residual MoE layers; returns (y_TD, the layers' summed aux loss)."""
    y1, aux1 = layer.apply(params["moe1"], x_TD, cfg)
    h_TD = x_TD + y1
    y2, aux2 = layer.apply(params["moe2"], h_TD, cfg)
    return h_TD + y2, aux1["loss"] + aux2["loss"]


def teacher(key: jax.Array, task: TaskConfig):
    """The frozen target function x_TD -> x + gelu(x @ W1_DH) @ W2_HD, float32."""
    k1, k2 = jax.random.split(key)
    d, h = task.d_model, task.teacher_hidden
    w1_DH = jax.random.normal(k1, (d, h)) / np.sqrt(d)
    w2_HD = jax.random.normal(k2, (h, d)) / np.sqrt(h)
    return lambda x_TD: x_TD + jax.nn.gelu(x_TD @ w1_DH) @ w2_HD


def student_config(task: TaskConfig, cfg: MoEConfig, steps: int) -> TrainConfig:
    """The trainer's settings for the student: Adam (beta2 0.999) at the constant
    `task.learning_rate` (no warmup, no decay), no weight decay, no clipping. Its model is two
    MoE layers of `cfg`; the step reads only `model.moe` (the router-bias update), as the
    student has no attention, embedding or head."""
    model = ModelConfig(vocab_size=1, d_model=task.d_model, num_layers=2, num_heads=1,
                        d_ff=task.d_ff, moe=cfg)
    return TrainConfig(model=model, steps=steps, seed=task.seed,
                       learning_rate=task.learning_rate, warmup_steps=0, min_lr_ratio=1.0,
                       weight_decay=0.0, adam_b2=0.999, grad_clip=0.0)


def regression_loss(params, data_key: jax.Array, cfg: TrainConfig, mesh=None, *,
                    target_fn: Callable[[jax.Array], jax.Array], tokens: int
                    ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The step's objective: MSE to `target_fn` on `tokens` fresh N(0,1) tokens drawn from
    `data_key` (the step's batch), plus the layers' aux loss; metrics {"mse"}. `mesh` is
    unused (the student runs on one device)."""
    x_TD = jax.random.normal(data_key, (tokens, cfg.model.d_model))
    y_TD, aux = forward(params, x_TD, cfg.model.moe)
    mse = jnp.mean((y_TD.astype(jnp.float32) - target_fn(x_TD)) ** 2)
    return mse + aux, {"mse": mse}


def train(task: TaskConfig, cfg: MoEConfig, steps: int) -> np.ndarray:
    """Train the student for `steps` with the trainer's step; returns the per-step regression
    loss (MSE, float64)."""
    k_teacher, k_student, k_data = jax.random.split(jax.random.key(task.seed), 3)
    tcfg = student_config(task, cfg, steps)
    params = init(k_student, cfg)
    opt = step_lib.make_optimizer(tcfg, params)
    state = step_lib.new_state(params, opt, k_data)
    loss = functools.partial(regression_loss, target_fn=teacher(k_teacher, task),
                             tokens=task.tokens)
    step = jax.jit(functools.partial(step_lib.train_step, cfg=tcfg, opt=opt, loss=loss))
    losses = []
    for i in range(steps):
        state, metrics = step(state, jax.random.fold_in(k_data, i))
        losses.append(metrics["mse"])
    return np.asarray(jax.device_get(losses), np.float64)


def compare(*, steps: int = 500, backend: str = "auto", task: TaskConfig | None = None
            ) -> dict[str, Any]:
    """bf16 vs MXFP8 grouped matmuls on the same task, init and batches.

    Returns a record with both loss curves, the final losses (mean of the last 10% of steps)
    and `final_gap_rel` = (mxfp8 - bf16) / bf16.
    """
    if steps < 10:
        raise ValueError(f"steps={steps} must be >= 10")
    task = task or TaskConfig()
    curves = {name: train(task, moe_config(task, quant, backend, "bfloat16"), steps)
              for name, quant in (("bf16", "none"), ("mxfp8", "mxfp8"))}
    tail = max(steps // 10, 1)
    final = {name: float(c[-tail:].mean()) for name, c in curves.items()}
    return {"task": dataclasses.asdict(task), "steps": steps, "backend": backend,
            "final_window": tail, "final_bf16": final["bf16"], "final_mxfp8": final["mxfp8"],
            "final_gap_rel": (final["mxfp8"] - final["bf16"]) / final["bf16"],
            "initial_loss": float(curves["bf16"][0]),
            "losses_bf16": [round(v, 6) for v in curves["bf16"].tolist()],
            "losses_mxfp8": [round(v, 6) for v in curves["mxfp8"].tolist()]}


def summary(rec: dict[str, Any]) -> str:
    return (f"convergence, {rec['steps']} steps: initial loss {rec['initial_loss']:.4g}; final "
            f"(mean of last {rec['final_window']}) bf16 {rec['final_bf16']:.4g}, mxfp8 "
            f"{rec['final_mxfp8']:.4g}, gap {100 * rec['final_gap_rel']:+.2f}%")


def plot(rec: dict[str, Any], path: str) -> None:
    """Both loss curves (log scale) to a PNG. Needs matplotlib (`pip install dropless[plot]`)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("plotting needs matplotlib: pip install 'dropless[plot]'") from e
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for name in ("bf16", "mxfp8"):
        ax.plot(rec[f"losses_{name}"], label=f"{name} (final {rec[f'final_{name}']:.4g})",
                lw=1)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("regression loss (MSE)")
    ax.set_title(f"two-layer MoE regression: bf16 vs MXFP8 grouped matmuls "
                 f"(gap {100 * rec['final_gap_rel']:+.2f}%)", fontsize=9)
    ax.legend()
    fig.tight_layout()
    from dropless.runtime import files
    with files.replacing(path) as tmp:
        fig.savefig(tmp, format=str(path).rsplit(".", 1)[-1] if "." in str(path) else "png")
    plt.close(fig)


PRESET_QUANTIZATIONS = ("none", "mxfp8", "nvfp4")


def preset_config(preset: str, quantization: str, *, steps: int, run_dir: str,
                  batch: int, seq_len: int, seed: int = 0,
                  overrides: tuple[tuple[str, Any], ...] = ()):
    """The TrainConfig of one preset run: bf16 expert activations, `quantization` for the
    expert grouped matmuls, no checkpoints, one evaluation at the end; `overrides`: more
    (key, value) pairs (e.g. ("model.moe.nvfp4_rht", False)), named in the run's name."""
    from dropless.config_file import build_config
    name = "-".join([preset, quantization] + [f"{k.rsplit('.', 1)[-1]}={v}"
                                              for k, v in overrides])
    return build_config([
        ("preset", preset), ("steps", steps), ("seed", seed),
        ("per_device_batch_size", batch), ("seq_len", seq_len),
        ("model.moe.dtype", "bfloat16"), ("model.moe.gmm_quantization", quantization),
        ("run_dir", run_dir), ("run_name", name),
        ("checkpoint_every", 0), ("eval_every", steps), *overrides])


def train_preset(preset: str, quantization: str, *, steps: int, run_dir: str, batch: int,
                 seq_len: int, seed: int = 0, overrides: tuple[tuple[str, Any], ...] = (),
                 echo: Callable[[str], Any] = print) -> dict[str, Any]:
    """Train one preset run; returns its record (per-step training losses, eval loss, time)."""
    from dropless.train import loop
    cfg = preset_config(preset, quantization, steps=steps, run_dir=run_dir, batch=batch,
                        seq_len=seq_len, seed=seed, overrides=overrides)
    t0 = time.perf_counter()
    result = loop.train(cfg, echo=echo)
    wall = time.perf_counter() - t0
    losses = [result.losses[i] for i in sorted(result.losses)]
    return {"preset": preset, "quantization": quantization,
            "overrides": {k: v for k, v in overrides}, "steps": len(losses),
            "batch": f"{batch} x {seq_len}", "wall_s": round(wall, 1),
            **_timing(result.run_dir / "metrics.jsonl"),
            "final_eval_loss": (result.eval_losses[max(result.eval_losses)]
                                if result.eval_losses else None),
            "losses": [round(float(v), 5) for v in losses]}


def _timing(metrics_path) -> dict[str, Any]:
    """compile_s and the median step time (compilation excluded) of a run's metrics.jsonl."""
    import json
    recs = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    times = [r["step_time_s"] for r in recs if r.get("event") == "step"]
    start = next((r for r in recs if r.get("event") == "start"), {})
    return {"compile_s": start.get("compile_s"),
            "median_step_time_s": float(np.median(times)) if times else None}


def loss_gaps(runs: list[dict[str, Any]], baseline: str = "none") -> dict[str, Any]:
    """Final training loss of each run (mean of its last 10% of steps), its gap to `baseline`
    relative to the baseline's, and the eval-loss gap; only over the steps all runs reached."""
    steps = min(r["steps"] for r in runs)
    tail = max(steps // 10, 1)
    final = {r["quantization"]: float(np.mean(r["losses"][steps - tail:steps])) for r in runs}
    evals = {r["quantization"]: r["final_eval_loss"] for r in runs}
    rec: dict[str, Any] = {"steps_compared": steps, "final_window": tail, "final": final,
                           "final_eval": evals}
    if baseline in final:
        b = final[baseline]
        rec["final_gap_rel"] = {q: (v - b) / b for q, v in final.items() if q != baseline}
        if evals.get(baseline) is not None:
            rec["eval_gap_rel"] = {q: (v - evals[baseline]) / evals[baseline]
                                   for q, v in evals.items()
                                   if q != baseline and v is not None}
    return rec


def compare_preset(*, preset: str = "tiny", steps: int = 300,
                   quantizations: tuple[str, ...] = PRESET_QUANTIZATIONS, batch: int = 16,
                   seq_len: int = 128, run_dir: str = "runs/quant_convergence", seed: int = 0,
                   on_run: Callable[[dict[str, Any]], Any] | None = None,
                   echo: Callable[[str], Any] = print) -> dict[str, Any]:
    """Train `preset` once per quantization, one after another; `on_run(record)` is called as
    each finishes (so a long comparison keeps what it measured). Returns the summary record
    (`loss_gaps` of the runs)."""
    if steps < 10:
        raise ValueError(f"steps={steps} must be >= 10")
    unknown = [q for q in quantizations if q not in PRESET_QUANTIZATIONS]
    if unknown or not quantizations:
        raise ValueError(f"quantizations={quantizations!r} must be a non-empty subset of "
                         f"{PRESET_QUANTIZATIONS}")
    runs = []
    for q in quantizations:
        rec = train_preset(preset, q, steps=steps, run_dir=run_dir, batch=batch,
                           seq_len=seq_len, seed=seed, echo=echo)
        runs.append(rec)
        if on_run is not None:
            on_run(rec)
    return {"preset": preset, "batch": f"{batch} x {seq_len}", **loss_gaps(runs)}


def preset_summary(rec: dict[str, Any]) -> str:
    gaps = rec.get("final_gap_rel", {})
    parts = ", ".join(f"{q} {v:.4f}" + (f" ({100 * gaps[q]:+.2f}%)" if q in gaps else "")
                      for q, v in rec["final"].items())
    return (f"{rec['preset']} preset, {rec['steps_compared']} steps of {rec['batch']}: final "
            f"training loss (mean of last {rec['final_window']}) {parts}")
