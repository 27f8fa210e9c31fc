"""A per-kernel time table read from a JAX profiler trace: which kernels ran, how often, how long.

`jax.profiler.trace(DIR)` writes DIR/plugins/profile/<run>/<host>.xplane.pb (an XSpace: planes
of lines of timed events), read here through jaxlib's own reader (`jax.profiler.ProfileData`),
so no protobuf definitions are carried. What counts as a kernel:
  - on a GPU, every event on a stream line ("Stream #...") of a device plane
    ("/device:GPU:N"): the kernels CUPTI recorded, with memory copies and sets under their own
    names; the lines a reader derives from them ("XLA Ops", "XLA Modules", "Steps", ...) are
    not counted, so no time is counted twice;
  - where no device plane has events (a CPU trace), the XLA runtime's thunk events on the host
    plane ("/host:CPU", the events that carry an "hlo_op" stat), innermost only (a thunk that
    contains others, such as a loop, is counted through them).
Rows are summed by kernel name over the newest run's hosts: name, count, total_us (device
microseconds), share (of all the rows' time), the first `hlo_op` seen and the first scope (the
op's name stack, where the trace carries one), and its group (`group`).
"""
from __future__ import annotations

import re
from pathlib import Path

GROUPS = ("attention", "moe_gmm", "dispatch_permute", "router", "optimizer", "other")
# the lines a trace reader derives from the stream lines: their time is the streams' time
DERIVED_LINES = ("XLA Modules", "XLA Ops", "XLA TraceMe", "Steps", "TensorFlow Ops",
                 "TensorFlow Name Scope", "Framework Ops", "Framework Name Scope",
                 "Source code", "Async XLA Ops", "Launch Stats")
# the stats that can name an event's op and its scope (jax's name stack), most specific first
SCOPE_STATS = ("tf_op", "long_name", "kernel_annotation", "name_scope", "hlo_op")
# a kernel's group: the first whose pattern matches its name or scope (case-insensitive). The
# router comes before the grouped matmul (its top-k is not a gmm; "wgmma" is an instruction,
# not a gmm), the gmm before dispatch
# (a gmm kernel's scope can name the dispatch it runs in), attention before the gathers and
# scatters a dispatch is made of (an attention scope's gather is attention's).
_PATTERNS = (
    ("router", r"router|top_?k|topk"),
    ("moe_gmm", r"(?<!w)gmm|ragged|grouped|group_gemm|grouped_mm|moe_gemm|cutlass.*group"),
    ("attention", r"attention|attn|sdpa|flash|fmha|rotary"),
    ("dispatch_permute", r"dispatch|permute|combine|unsort|argsort|\bsort|radixsort|"
                         r"segment|scatter|gather|all_?to_?all|all-to-all"),
    ("optimizer", r"optimizer|optax|adam|adafactor|muon|sgd|scale_by|apply_updates"),
)


def group(name: str, scope: str = "") -> str:
    """The group of a kernel named `name` (with the op's `scope`, a name stack, when known):
    one of GROUPS, "other" when nothing matches.

    >>> group("dropless_gmm"), group("fusion.3", "jit(step)/moe/router/dot_general")
    ('moe_gmm', 'router')
    >>> group("cudnn_generated_fort_native_sdpa_sm90_flash_fprop"), group("loop_add_fusion")
    ('attention', 'other')
    """
    text = f"{name} {scope}".lower()
    for g, pattern in _PATTERNS:
        if re.search(pattern, text):
            return g
    return "other"


def trace_files(trace_dir: str | Path) -> list[Path]:
    """The .xplane.pb files of the newest run under `trace_dir` (the directory given to
    `jax.profiler.trace`, a run directory, or one .xplane.pb file). FileNotFoundError naming
    `trace_dir` when there is none."""
    p = Path(trace_dir)
    if p.is_file() and p.name.endswith(".xplane.pb"):
        return [p]
    found = sorted(p.glob("**/*.xplane.pb")) if p.is_dir() else []
    if not found:
        raise FileNotFoundError(f"{trace_dir}: no profiler trace (*.xplane.pb) there; pass the "
                                f"directory given to jax.profiler.trace")
    newest = max(f.parent for f in found)      # run directories are named by their start time
    return [f for f in found if f.parent == newest]


def _stats(ev) -> dict:
    return {k: v for k, v in ev.stats}


def _leaves(events: list[tuple[float, float, object]]) -> list[tuple[float, float, object]]:
    """The events (start_ns, duration_ns, event) of one line that contain no other event."""
    events = sorted(events, key=lambda e: (e[0], -e[1]))
    out, stack = [], []          # stack: [event, has_child] of the events still open
    for e in events:
        while stack and stack[-1][0][0] + stack[-1][0][1] <= e[0]:
            top = stack.pop()
            if not top[1]:
                out.append(top[0])
        if stack:
            stack[-1][1] = True
        stack.append([e, False])
    out += [e for e, has_child in stack if not has_child]
    return out


def _device_events(plane) -> list:
    lines = [ln for ln in plane.lines if ln.name not in DERIVED_LINES]
    streams = [ln for ln in lines if ln.name.startswith("Stream")]
    return [ev for ln in (streams or lines) for ev in ln.events]


def _host_events(plane) -> list:
    out = []
    for ln in plane.lines:
        evs = [(ev.start_ns, ev.duration_ns, ev) for ev in ln.events
               if "hlo_op" in _stats(ev) and not ev.name.startswith("end: ")]
        out += [ev for _, _, ev in _leaves(evs)]
    return out


def events(trace_dir: str | Path) -> list:
    """The kernel events of the newest run's trace under `trace_dir` (see the module
    docstring): the device planes' stream events, or where none has any, the host's thunks."""
    from jax.profiler import ProfileData
    device, host = [], []
    for f in trace_files(trace_dir):
        data = ProfileData.from_file(str(f))
        for plane in data.planes:
            if plane.name.startswith("/device:"):
                device += _device_events(plane)
            elif plane.name == "/host:CPU":
                host += _host_events(plane)
    return device or host


def kernel_table(trace_dir: str | Path) -> list[dict]:
    """One row per kernel name of the trace under `trace_dir`, most time first: {"name",
    "count", "total_us", "share", "group", "hlo_op", "scope"} (share: of all the rows' time;
    hlo_op and scope: the first seen, None when the trace names none)."""
    rows: dict[str, dict] = {}
    for ev in events(trace_dir):
        st = _stats(ev)
        r = rows.setdefault(ev.name, {"name": ev.name, "count": 0, "total_us": 0.0,
                                      "hlo_op": None, "scope": None})
        r["count"] += 1
        r["total_us"] += ev.duration_ns / 1e3
        if r["hlo_op"] is None and isinstance(st.get("hlo_op"), str):
            r["hlo_op"] = st["hlo_op"]
        if r["scope"] is None:
            r["scope"] = next((st[k] for k in SCOPE_STATS[:-1] if isinstance(st.get(k), str)),
                              None)
    total = sum(r["total_us"] for r in rows.values()) or 1.0
    out = []
    for r in sorted(rows.values(), key=lambda r: (-r["total_us"], r["name"])):
        scope = " ".join(filter(None, (r["hlo_op"], r["scope"])))
        out.append(dict(r, share=r["total_us"] / total, group=group(r["name"], scope)))
    return out
