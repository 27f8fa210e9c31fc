"""Human-readable text for a plan (the JSON is the plan dict itself)."""
from __future__ import annotations

from dropless.text_table import format_table
from dropless.plan.memory import GiB, verdict

GB = 1e9


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _chunked(k: int) -> str:
    return f" + EP in {k} chunks" if k > 1 else ""


def _accumulated(k: int) -> str:
    return f" x {k} accumulation steps" if k > 1 else ""


def format_plan(r: dict) -> str:
    """The sections of `dropless plan`: layout, memory, FLOPs, bytes, step time, shares."""
    lay, mem, fl, by, tm = r["layout"], r["memory"], r["flops"], r["bytes"], r["time"]
    g = lay["groups"]
    lines = [f"{r['model']} on {lay['gpus']} x {r['hardware']}: data {lay['data']} x fsdp "
             f"{lay['fsdp']} x ep {lay['ep']} ({lay['devices_per_node']} GPUs per node; fsdp x ep "
             f"group spans {g['sharded_gather']['nodes']} node(s), fsdp "
             f"{g['experts_gather']['nodes']}, ep {g['expert']['nodes']})",
             f"  per-device batch {lay['per_device_batch']} x seq {lay['seq_len']}"
             f"{_accumulated(lay['gradient_accumulation_steps'])}, remat "
             f"{lay['remat']}, offload {','.join(lay['offload']) or 'none'}, gmm "
             f"{lay['gmm_quantization']}, dispatcher {lay['dispatcher']}"
             f"{' + dedup' if lay['dedup'] else ''}, buffer factor "
             f"{lay['ragged_buffer_factor']}, overlap {lay['overlap']}"
             f"{_chunked(lay['ep_comm_overlap_chunks'])}, layers "
             f"{'scanned' if lay['scan_layers'] else 'unrolled'}", "",
             "Memory per device (GiB):"]
    rows = [{"part": k, "GiB": mem[k] / GiB} for k in
            ("parameters", "gradients", "grad_accumulator", "optimizer_state", "gathered_weights",
             "compute_weights", "activations", "layer_workspace", "logits", "ep_buffers",
             "total")]
    lines += ["  " + x for x in format_table(rows, ["part", "GiB"]).splitlines()]
    lines += [f"  host (offloaded activations): {mem['host_offloaded'] / GiB:.1f} GiB",
              f"  verdict: {verdict(mem)}", "",
              f"FLOPs per device per step: model {fl['model_per_device'] / 1e12:.1f} TFLOP "
              f"({fl['model_per_token'] / 1e9:.1f} GFLOP/token; 6N = "
              f"{fl['six_n_per_token'] / 1e9:.1f}), executed {fl['executed_per_device'] / 1e12:.1f}"
              f" TFLOP (remat and padding)", "", "Communication per device per step (GB sent):"]
    rows = []
    for k in ("fsdp", "data", "ep", "ep_real_rows", "ep_with_dedup", "ep_without_dedup"):
        if k in by:
            rows.append({"traffic": k, "NVLink": by[k]["intra"] / GB,
                         "InfiniBand": by[k]["inter"] / GB})
    table = format_table(rows, ["traffic", "NVLink", "InfiniBand"])
    lines += ["  " + x for x in table.splitlines()]
    if "ep_rows_per_token" in by:
        e = by["ep_rows_per_token"]
        lines.append(f"  EP rows per token: {e['with_dedup']:.2f} with dedup, "
                     f"{e['without_dedup']:.0f} without")
    if "ep_dispatch_wire" in by:   # MoEConfig.dispatch_quantization (docs/fp8_dispatch.md)
        w = by["ep_dispatch_wire"]
        lines.append(f"  EP dispatch as MXFP8 rows: {w['dispatch_bytes'] / GB:.3f} -> "
                     f"{w['dispatch_bytes_mxfp8'] / GB:.3f} GB a forward dispatch (x"
                     f"{w['dispatch_ratio']:.3f}); EP per step {w['step_bytes'] / GB:.1f} -> "
                     f"{w['step_bytes_mxfp8'] / GB:.1f} GB (combine and backward stay bf16)")
    lines += [f"  host offload: {by['host_offload'] / GB:.1f} GB", "",
              f"Step time: {tm['step_s']:.3f} s  |  {r['tflops_per_device']:.0f} TFLOPS/device  |"
              f"  MFU {_pct(r['mfu'])} (of bf16 peak)  |  {r['tokens_per_s']:.4g} tokens/s", ""]
    rows = [{"part": k, "kernel_s": tm["kernel_s"][k], "kernel_share": _pct(
                r["shares"]["kernel"][k]), "exposed_s": tm["exposed_s"][k],
             "step_share": _pct(r["shares"]["step"][k])} for k in tm["kernel_s"]]
    lines += ["  " + x for x in format_table(
        rows, ["part", "kernel_s", "kernel_share", "exposed_s", "step_share"]).splitlines()]
    lines.append(f"  communication: {_pct(r['shares']['communication_of_kernel'])} of kernel time,"
                 f" {_pct(r['shares']['communication_exposed_of_step'])} of the step exposed")
    return "\n".join(lines)


def format_sweep(rows: list[dict]) -> str:
    view = [{**r, "mfu": _pct(r["mfu"]), "scaling_efficiency": _pct(r["scaling_efficiency"]),
             "communication_of_kernel": _pct(r["communication_of_kernel"])} for r in rows]
    return format_table(view, ["gpus", "data", "fsdp", "ep", "step_s", "tflops_per_device",
                               "mfu", "tokens_per_s", "scaling_efficiency", "fits"])


def format_suggest(rows: list[dict]) -> str:
    if not rows:
        return ("no layout fits: try more GPUs, a smaller batch (raise "
                "gradient_accumulation_steps to keep the global batch) or sequence, or remat=full")
    view = [{**r, "offload": ",".join(r["offload"]) or "-", "mfu": _pct(r["mfu"])} for r in rows]
    return format_table(view, ["fsdp", "ep", "data", "remat", "offload", "ragged_buffer_factor",
                               "step_s", "tflops_per_device", "mfu", "tokens_per_s",
                               "memory_gib", "headroom_gib"])
