"""`dropless bench quant`: what MXFP8 does to accuracy, and what its emulation costs.

Legend: M routed rows, K contraction dim, N output dim, G experts (groups).

Three parts (JSON lines, one record per row, plus a readable table):
  error     quantization error of a tensor, relative Frobenius and worst 1x32 block, on N(0,1),
            heavy-tailed (Student t, 2 dof) and wide-range rows (see `sample`), for per-tensor
            FP8 E4M3 (one float scale amax/448) vs MXFP8 with floor (OCP) and round-up scales
            (and E5M2);
  gmm       relative Frobenius error of the grouped matmul against float64, bf16 vs MXFP8;
  cost      time of the MXFP8 grouped matmul (forward, forward+backward) relative to the bf16
            grouped matmul on the same backend, interleaved in one process.
`--convergence` trains a two-layer MoE regression task with bf16 and MXFP8 grouped matmuls
(see dropless.bench.quant_convergence).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dropless import machine, text_table
from dropless.bench import harness
from dropless.ops.gmm import grouped_matmul
from dropless.quant import MXFP8Config, fake_quantize, mxfp8_grouped_matmul


def per_tensor_fp8(x: jax.Array) -> jax.Array:
    """The per-tensor FP8 baseline: one float32 scale amax/448 for the whole tensor (E4M3)."""
    scale = jnp.max(jnp.abs(x)) / 448.0
    q = jnp.clip(x / scale, -448.0, 448.0).astype(jnp.float8_e4m3fn)
    return q.astype(jnp.float32) * scale


METHODS = {
    "per_tensor_e4m3": per_tensor_fp8,
    "mxfp8_e4m3_floor": lambda x: fake_quantize(x, -1, rounding="floor"),
    "mxfp8_e4m3_up": lambda x: fake_quantize(x, -1, rounding="up"),
    "mxfp8_e5m2_floor": lambda x: fake_quantize(x, -1, elem="e5m2", rounding="floor"),
}


DATA_KINDS = ("normal", "heavy_tailed", "wide_rows")


def sample(kind: str, shape: tuple[int, int], seed: int = 0) -> np.ndarray:
    """'normal': N(0,1); 'heavy_tailed': Student t with 2 degrees of freedom (infinite variance);
    'wide_rows': N(0,1) rows each scaled by 2**u, u uniform in [-12, 12] (tokens, or gradient
    rows, whose magnitudes differ by orders of magnitude: wider than FP8's own range)."""
    rng = np.random.default_rng(seed)
    if kind == "normal":
        return rng.standard_normal(shape).astype(np.float32)
    if kind == "heavy_tailed":
        return rng.standard_t(2.0, shape).astype(np.float32)
    if kind == "wide_rows":
        scale = 2.0 ** rng.integers(-12, 13, (shape[0], 1))
        return (rng.standard_normal(shape) * scale).astype(np.float32)
    raise ValueError(f"kind={kind!r} must be one of {DATA_KINDS}")


def quant_errors(x: np.ndarray, xq: np.ndarray) -> dict[str, float]:
    """Relative Frobenius error, and the worst relative error of any 1x32 block along rows."""
    x64, d64 = x.astype(np.float64), (xq.astype(np.float64) - x)
    rel = float(np.linalg.norm(d64) / np.linalg.norm(x64))
    nb = x.shape[-1] // 32
    xb = x64[..., :nb * 32].reshape(-1, 32)
    db = d64[..., :nb * 32].reshape(-1, 32)
    norms = np.linalg.norm(xb, axis=1)
    ok = norms > 0
    worst = float((np.linalg.norm(db, axis=1)[ok] / norms[ok]).max())
    return {"rel_frobenius": rel, "worst_block_rel": worst}


def error_rows(shape=(512, 1024)) -> list[dict[str, Any]]:
    rows = []
    for kind in DATA_KINDS:
        x = sample(kind, shape)
        for name, fn in METHODS.items():
            xq = np.asarray(jax.jit(fn)(jnp.asarray(x)))
            rows.append({"part": "error", "data": kind, "method": name, **quant_errors(x, xq)})
    return rows


def gmm_operands(m: int, k: int, n: int, g: int, seed: int = 0):
    """N(0,1) operands and uneven group sizes (a Dirichlet draw) summing to m."""
    rng = np.random.default_rng(seed)
    sizes = rng.multinomial(m, rng.dirichlet(np.ones(g)))
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((g, k, n)) / np.sqrt(k)).astype(np.float32)
    return x, w, sizes.astype(np.int32)


def gmm_error_rows(m: int, k: int, n: int, g: int, backend: str) -> list[dict[str, Any]]:
    x, w, sizes = gmm_operands(m, k, n, g)
    ends = np.cumsum(sizes)
    exact = np.concatenate([x[e - s:e].astype(np.float64) @ w[i]
                            for i, (s, e) in enumerate(zip(sizes, ends))])
    xs, ws, gs = jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes)
    outs = {
        "bf16": grouped_matmul(xs.astype(jnp.bfloat16), ws.astype(jnp.bfloat16), gs,
                               backend=backend, preferred_element_type=jnp.float32),
        "mxfp8": mxfp8_grouped_matmul(xs, ws, gs, config=MXFP8Config(backend=backend)),
    }
    return [{"part": "gmm", "data": "normal", "method": name,
             "rel_frobenius": float(np.linalg.norm(np.asarray(o, np.float64) - exact)
                                    / np.linalg.norm(exact))} for name, o in outs.items()]


def cost_rows(m: int, k: int, n: int, g: int, backend: str, repeats: int
              ) -> list[dict[str, Any]]:
    """Forward and forward+backward time of MXFP8 vs bf16 grouped matmul, interleaved."""
    x, w, sizes = gmm_operands(m, k, n, g)
    xb, wb, gs = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16), jnp.asarray(sizes)
    cfg = MXFP8Config(backend=backend)
    impls = {
        "bf16": lambda x, w: grouped_matmul(x, w, gs, backend=backend,
                                            preferred_element_type=jnp.bfloat16),
        "mxfp8": lambda x, w: mxfp8_grouped_matmul(x, w, gs, config=cfg),
    }
    # a random cotangent passed as an argument: a constant one (grad of a sum) would let XLA
    # constant-fold its quantization out of the timed program
    dy = jnp.asarray(np.random.default_rng(1).standard_normal((m, n)), jnp.bfloat16)
    fns = {}
    for name, f in impls.items():
        fwd = jax.jit(f)
        fwdbwd = jax.jit(lambda x, w, dy, f=f: jax.vjp(f, x, w)[1](dy))
        fns[f"{name}/fwd"] = lambda fwd=fwd: fwd(xb, wb)
        fns[f"{name}/fwd+bwd"] = lambda fb=fwdbwd: fb(xb, wb, dy)
    busy = machine.busy_fraction()
    stats = machine.time_interleaved(fns, repeats=repeats)
    rows = []
    for mode in ("fwd", "fwd+bwd"):
        base = stats[f"bf16/{mode}"]["median_ms"]
        for name in ("bf16", "mxfp8"):
            s = stats[f"{name}/{mode}"]
            rows.append({"part": "cost", "method": name, "mode": mode, "backend": backend,
                         "shape": f"M={m} K={k} N={n} G={g}", **s,
                         "ratio_vs_bf16": s["median_ms"] / base, "busy_fraction": busy})
    return rows


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantOptions:
    """What `dropless bench quant` runs: the grouped-matmul shape (M, K, N, G) of the gmm error
    and cost parts, the tensor shape (R, C) of the quantization-error part, the grouped-matmul
    backend wrapped, timed repeats per candidate, `skip_cost` (accuracy parts only),
    `convergence` (also train the two-layer MoE regression task, bf16 vs MXFP8, for `steps`
    steps; `plot`: a PNG of its losses, needs matplotlib) and the JSON-lines file appended to
    (None: none). With `preset` (and `convergence`) only the convergence part runs: the preset
    trained once per entry of `quantizations` (batch x seq_len tokens a step, run directories
    under `run_dir`), each run's record appended to `out` as it finishes, then the loss gaps."""
    shape: tuple[int, int, int, int] = (2048, 512, 512, 8)
    error_shape: tuple[int, int] = (512, 1024)
    backend: str = "auto"
    repeats: int = 5
    skip_cost: bool = False
    convergence: bool = False
    steps: int = 500
    plot: str | None = None
    preset: str | None = None
    quantizations: tuple[str, ...] = ("none", "mxfp8", "nvfp4")
    batch: int = 16
    seq_len: int = 128
    run_dir: str = "runs/quant_convergence"
    out: str | None = None


def run(args: QuantOptions) -> int:
    """The parts `args` asks for, each printed as a table and appended to `args.out` (one
    record per row, with the machine). Returns 0."""
    info = machine.machine_info()
    if args.convergence and args.preset:
        return _run_preset(args, info)
    m, k, n, g = args.shape
    rows = error_rows(tuple(args.error_shape)) + gmm_error_rows(m, k, n, g, args.backend)
    print(text_table.format_table(rows, ["part", "data", "method", "rel_frobenius",
                                      "worst_block_rel"]))
    if not args.skip_cost:
        cost = cost_rows(m, k, n, g, args.backend, args.repeats)
        print()
        print(text_table.format_table(cost, ["method", "mode", "shape", "median_ms", "min_ms",
                                          "max_ms", "ratio_vs_bf16", "busy_fraction"]))
        rows += cost
    if args.convergence:
        from dropless.bench import quant_convergence
        conv = quant_convergence.compare(steps=args.steps, backend=args.backend)
        print()
        print(quant_convergence.summary(conv))
        if args.plot:
            quant_convergence.plot(conv, args.plot)
            print(f"wrote {args.plot}")
        rows.append({"part": "convergence", **conv})
    harness.write_jsonl(args.out, [{"bench": "quant", **info, **r} for r in rows])
    return 0


def _run_preset(args: QuantOptions, info: dict[str, Any]) -> int:
    from dropless.bench import quant_convergence as qc

    def keep(rec):
        harness.write_jsonl(args.out, [{"bench": "quant", **info, "part": "convergence_run",
                                        **rec}])
    summary = qc.compare_preset(preset=args.preset, steps=args.steps,
                                quantizations=tuple(args.quantizations), batch=args.batch,
                                seq_len=args.seq_len, run_dir=args.run_dir, on_run=keep)
    print(qc.preset_summary(summary))
    harness.write_jsonl(args.out, [{"bench": "quant", **info, "part": "convergence_preset",
                                    **summary}])
    return 0
