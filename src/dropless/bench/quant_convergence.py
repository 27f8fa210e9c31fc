"""Convergence with MXFP8: a two-layer MoE regression task, bf16 vs MXFP8 grouped matmuls.

Legend: T tokens in a batch, D model dim, H teacher hidden dim.

Until the trainer exists this stands in for "the tiny preset trained with bf16 vs MXFP8": a
student of two residual MoE layers (h = x + moe1(x), y = h + moe2(h)) learns to match a frozen
random teacher x + gelu(x @ W1_DH) @ W2_HD on fresh N(0,1) tokens every step (a smooth target
the student can keep approaching, so the loss falls by an order of magnitude and a precision
floor would show). Both runs start from the same initialisation and see the same batches; the
only difference is `MoEConfig.gmm_quantization` ("none" vs "mxfp8", bfloat16 activations).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dropless.config import MoEConfig
from dropless.moe import layer


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


def train(task: TaskConfig, cfg: MoEConfig, steps: int) -> np.ndarray:
    """Train the student for `steps`; returns the per-step regression loss (MSE, float64)."""
    k_teacher, k_student, k_data = jax.random.split(jax.random.key(task.seed), 3)
    target_fn = teacher(k_teacher, task)
    params = init(k_student, cfg)
    opt = optax.adam(task.learning_rate)
    state = opt.init(params)

    def loss_fn(p, x, target):
        y, aux = forward(p, x, cfg)
        mse = jnp.mean((y.astype(jnp.float32) - target) ** 2)
        return mse + aux, mse

    @jax.jit
    def step(p, s, i):
        x = jax.random.normal(jax.random.fold_in(k_data, i), (task.tokens, task.d_model))
        target = target_fn(x)
        (_, mse), g = jax.value_and_grad(loss_fn, has_aux=True)(p, x, target)
        upd, s = opt.update(g, s, p)
        return optax.apply_updates(p, upd), s, mse

    losses = []
    for i in range(steps):
        params, state, mse = step(params, state, jnp.int32(i))
        losses.append(mse)
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
