"""One step's metrics as the run records them: `step_metrics`, the "step" record of
metrics.jsonl (loss terms, throughput, MFU, expert loads, from the step's host metrics), and
`step_line`, its line on the terminal. The arithmetic is train/metrics.py's; the loop
(train/loop.py) reads a step's metrics and writes what these return.

Legend: L MoE layers (or MTP blocks), E experts.
"""
from __future__ import annotations

import numpy as np

from dropless.config import TrainConfig
from dropless.train import metrics as met


def step_metrics(m: dict, *, step: int, dt: float, cfg: TrainConfig, fpt: dict,
                 peak: float | None) -> dict:
    """The "step" record of metrics.jsonl from step `step`'s host metrics `m` (train/step's,
    read to the host; its tokens_per_expert_LE [L, E] and mtp_tokens_per_expert_LE where the
    model routes), `dt` seconds after the previous step's, `fpt` the FLOPs per token ("model",
    "executed") and `peak` the device's FLOP/s (None: no MFU). The step computed global batch x
    seq_len positions (every micro-batch's, padding too): TFLOPS and MFU count those;
    tokens_per_s counts `m["real_tokens"]` (`step.real_tokens`: positions holding a document's
    token; all positions where `m` has none), `met.throughput`."""
    rec = {"event": "step", "step": step, "step_time_s": dt}
    for k in ("loss", "ce_loss", "moe_loss", "mtp_loss", "mtp_moe_loss", "grad_norm", "lr",
              "load_balance_loss", "seq_aux_loss", "z_loss"):
        if k in m:
            rec[k] = float(m[k])
    rec["dropped_tokens"] = int(m["dropped_tokens"])
    for k in ("overflow_rounds", "overflow_skipped", "real_tokens"):
        if k in m:   # overflow_skipped (overflow="error"): 1 = not applied
            rec[k] = int(m[k])
    rec.update(met.throughput(step_time_s=dt, tokens=cfg.global_batch_size * cfg.seq_len,
                              flops_per_token=fpt["model"], num_devices=cfg.num_devices,
                              peak_flops_per_device=peak, real_tokens=rec.get("real_tokens")))
    rec["executed_tflops_per_device"] = rec["tflops_per_device"] * fpt["executed"] / fpt["model"]
    if "tokens_per_expert_LE" in m:
        le = np.asarray(m["tokens_per_expert_LE"])
        rec.update(met.expert_load_summary(le))
        rec["tokens_per_expert"] = le.tolist()
    if "mtp_tokens_per_expert_LE" in m:   # the MTP blocks' own MoE layers, one row a block
        le = np.asarray(m["mtp_tokens_per_expert_LE"])
        rec["mtp_expert_load_max_over_mean"] = met.expert_load_summary(le)[
            "expert_load_max_over_mean"]
        rec["mtp_tokens_per_expert"] = le.tolist()
    return rec


def step_line(r: dict, mtp_coef: float = 0.0) -> str:
    """The terminal's line of step record `r` (`step_metrics`): loss (with MTP what it adds
    up, `mtp_coef` the MTP loss's weight), time, throughput, MFU, the expert loads where the
    model routes, and the dropped tokens."""
    mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
    load = r.get("expert_load_max_over_mean")   # None: no MoE layer in the decoder
    mtp = r.get("mtp_expert_load_max_over_mean")   # None: no MTP block routes
    load = ("" if load is None else f"load max/mean {load:.2f} | ") + (
        "" if mtp is None else f"mtp load max/mean {mtp:.2f} | ")
    return (f"step {r['step']:>5} | {_loss_words(r, mtp_coef)} | "
            f"{r['step_time_s'] * 1e3:7.0f} ms | "
            f"{r['tokens_per_s']:8.0f} tok/s | {r['tflops_per_device']:.4f} TFLOPS/dev | "
            f"MFU {mfu} | {load}dropped {r['dropped_tokens']}")


def _loss_words(r: dict, mtp_coef: float) -> str:
    """`loss X`; with MTP, what the objective adds up (train/step.loss_fn), so the number is
    not read as the next-token loss alone."""
    if "mtp_loss" not in r:
        return f"loss {r['loss']:.4f}"
    moe = " + MoE aux" if r.get("moe_loss") or r.get("mtp_moe_loss") else ""
    return (f"loss {r['loss']:.4f} (ce {r['ce_loss']:.4f} + {mtp_coef:g} x mtp "
            f"{r['mtp_loss']:.4f}{moe})")
