"""A predicted per-kernel table of a compiled XLA executable, read from its optimized HLO text
(`compiled.as_text()`), with no device: which kernels one execution launches, how often, the
bytes they move and the FLOPs they do, and a roofline time for each.

What counts as a kernel (the GPU's rule: on XLA:GPU each of these becomes one launch, or one
library call): every instruction of the ENTRY computation, and of the computations it reaches
through `while` (body), `call` (to_apply) and `conditional` (every branch), whose opcode is
not bookkeeping. Bookkeeping, never a kernel: parameter, constant, tuple, get-tuple-element,
bitcast, after-all, add-dependency, opt-barrier, domain and the `*-done` / `*-update` halves of
async pairs; `while`, `call`, `conditional` and `async-start` are descended into, not counted.
So a kernel is a fusion (its `kind=`: kLoop, kInput, kCustom with its backend_config kind,
e.g. `__triton_nested_gemm_fusion`), a `fusion-start`, a custom-call (its
`custom_call_target`), a copy, dot, convolution, sort, scatter, gather, reduce, collective, or
any other op left unfused. A fusion's computation (`calls=`) is not walked for kernels: it is
one kernel, whose FLOPs are those of the dots and convolutions inside it (nested fusions too).

Per launch:
  - bytes read: each distinct operand's shape once (arrays: elements x dtype size; tuples
    summed), except an operand the kernel only slices (every use inside the fusion, through
    bitcasts, is operand 0 of a dynamic-slice, slice or gather; or the kernel is such an op):
    the slices' bytes; and the buffer a dynamic-update-slice or scatter updates in place
    (operand 0 of the fusion root, or of the op itself): 0 bytes;
  - bytes written: the result shape (tuples summed; a `fusion-start`'s result is element 1 of
    its async tuple), or for an in-place dynamic-update-slice / scatter the update's bytes;
  - FLOPs: 2 x (result elements) x (product of the lhs contracting dimensions) per dot (cuBLAS
    custom calls: the `dot_dimension_numbers` of their backend_config), 2 x (result
    elements) x (kernel elements / output features) per convolution; a custom call of the
    grouped-matmul group (a Pallas/Mosaic kernel: `kernel_table.group` by name and scope)
    2 x M x K x N of its rows operand and result (`_Walker.grouped_flops`: the useful FLOPs);
    elementwise FLOPs are 0, and so are those of any other custom call (a cuDNN attention
    kernel is timed by its bytes);
  - count: the product of the trip counts (`"known_trip_count":{"n":"K"}` in a while's
    backend_config) of the loops around it. A loop without a known count is counted once and
    its kernels carry a note saying so; its condition's kernels are then listed too (with a
    known count XLA:GPU runs the body K times without evaluating the condition). A
    conditional's branches are all listed, each noted: one of them runs.
  - precision: the dtype of a dot's first operand ("bf16", "float32", "fp8", ...), or None for
    a kernel with no dot.
Rows are merged by instruction name (a computation reached twice sums its counts).

The predicted time of one launch is the roofline max(bytes / (hbm_bw x hbm_efficiency),
FLOPs / (peak x gemm_efficiency)) of the profile passed in (any object with those fields,
e.g. `dropless.machine.PROFILES[kind]`; `peak` maps a precision to FLOP/s, the profile's
`peak_bf16` when not given), "memory" or "compute" bound by whichever is larger.

Not modelled: caches (L2 hits count as HBM traffic), a fusion reading an operand element more
than once (it is read once), launch latency and tail effects, overlap of async work (copies,
collectives and `fusion-start` kernels are timed as if serial), kernels a library call runs
internally (a cuBLAS/cuDNN custom call is one row), and control flow's own cost. Times are a
prediction, not a measurement.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

from dropless.runtime.kernel_table import GROUPS, group

# bits per element of each HLO primitive type
_BITS = {"pred": 8, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16,
         "u16": 16, "s32": 32, "u32": 32, "s64": 64, "u64": 64, "f16": 16, "bf16": 16,
         "f32": 32, "f64": 64, "c64": 64, "c128": 128, "f4e2m1fn": 4, "f8e8m0fnu": 8,
         "f8e4m3fn": 8, "f8e5m2": 8, "f8e4m3": 8, "f8e4m3fnuz": 8, "f8e5m2fnuz": 8,
         "f8e4m3b11fnuz": 8, "f8e3m4": 8, "token": 0, "opaque": 0}
# the precision of a dot by its first operand's dtype (the names machine.peak_for takes)
_PRECISION = {"bf16": "bf16", "f16": "float16", "f32": "float32", "f8e4m3fn": "fp8",
              "f8e5m2": "fp8", "f8e4m3": "fp8", "f8e4m3fnuz": "fp8", "f8e5m2fnuz": "fp8"}
BOOKKEEPING = frozenset(("parameter", "constant", "tuple", "get-tuple-element", "bitcast",
                         "after-all", "add-dependency", "opt-barrier", "domain"))
_DESCENDED = frozenset(("while", "call", "conditional", "async-start"))
_SLICING = frozenset(("dynamic-slice", "slice", "gather"))
_IN_PLACE = frozenset(("dynamic-update-slice", "scatter"))
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%(\S+)\s*\(.*\{\s*$")
_NAME = re.compile(r"^\s*(ROOT\s+)?%(\S+)\s*=\s*")
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


@dataclass(frozen=True)
class Instr:
    """One HLO instruction: its name, result shape text, opcode, operand names (a parameter's:
    its number), and the text after its operand list (calls=, metadata=, backend_config=...)."""

    name: str
    shape: str
    op: str
    operands: tuple[str, ...]
    attrs: str
    root: bool = False


@dataclass(frozen=True)
class Module:
    """An HLO module's computations by name (instructions in order) and its ENTRY's name."""

    computations: dict[str, tuple[Instr, ...]]
    entry: str


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape's text: arrays' elements x dtype size, tuples summed (layouts,
    comments and a dynamic bound's `<=` ignored). ValueError naming an unknown dtype.

    >>> shape_bytes("f32[256,128]{1,0}"), shape_bytes("(s32[], bf16[2,3]{1,0})")
    (131072, 16)
    """
    total = 0
    for dtype, dims in _ARRAY.findall(re.sub(r"/\*.*?\*/", "", shape)):
        if dtype not in _BITS:
            raise ValueError(f"HLO shape {shape!r}: unknown element type {dtype!r}")
        n = math.prod(int(d.replace("<=", "")) for d in dims.split(",") if d.strip())
        total += -(-n * _BITS[dtype] // 8)
    return total


def dims(shape: str) -> list[int]:
    """The dimensions of an array shape's text (the first array in it)."""
    m = _ARRAY.search(shape)
    if m is None:
        raise ValueError(f"HLO shape {shape!r} has no array")
    return [int(d.replace("<=", "")) for d in m.group(2).split(",") if d.strip()]


def _dtype(shape: str) -> str:
    m = _ARRAY.search(shape)
    return m.group(1) if m else ""


def _closing(text: str, at: int) -> int:
    """The index of the bracket closing the one opening at text[at] (quotes respected)."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack, quoted, i = [], False, at
    while i < len(text):
        c = text[i]
        if quoted:
            if c == "\\":
                i += 1
            elif c == '"':
                quoted = False
        elif c == '"':
            quoted = True
        elif c in pairs:
            stack.append(pairs[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return i
        i += 1
    raise ValueError(f"HLO text: unbalanced bracket in {text[at:at + 80]!r}")


def _split_top(text: str) -> list[str]:
    """`text` split at the commas outside brackets."""
    out, depth, start = [], 0, 0
    for i, c in enumerate(text):
        if c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
        elif c == "," and depth == 0:
            out.append(text[start:i])
            start = i + 1
    out.append(text[start:])
    return [s.strip() for s in out if s.strip()]


def parse_instr(line: str) -> Instr:
    """One instruction line of HLO text. ValueError quoting the line when it is not one."""
    m = _NAME.match(line)
    if m is None:
        raise ValueError(f"HLO text: not an instruction: {line.strip()[:120]!r}")
    rest, at = line[m.end():], 0
    if rest.startswith("("):
        end = _closing(rest, 0)
        shape, at = rest[:end + 1], end + 1
    else:
        sp = rest.find(" ")
        shape, at = rest[:sp], sp
    op_m = re.compile(r"\s*([a-z][a-z0-9-]*)\(").match(rest, at)
    if op_m is None:
        raise ValueError(f"HLO text: no opcode in {line.strip()[:120]!r}")
    open_at = op_m.end() - 1
    close = _closing(rest, open_at)
    names = []
    for operand in _split_top(rest[open_at + 1:close]):
        ref = re.search(r"%(\S+)$", operand)
        if ref:
            names.append(ref.group(1))
        elif op_m.group(1) == "parameter":      # its number: parameter(2)
            names.append(operand)
    return Instr(m.group(2), shape, op_m.group(1), tuple(names), rest[close + 1:],
                 bool(m.group(1)))


def parse(text: str) -> Module:
    """The computations of an HLO module's text (`compiled.as_text()`). ValueError when it has
    no ENTRY computation or a line cannot be read."""
    comps: dict[str, tuple[Instr, ...]] = {}
    entry, current, body = None, None, []
    for line in text.splitlines():
        if current is None:
            h = _HEADER.match(line)
            if h:
                current, body = h.group(2), []
                if h.group(1):
                    entry = current
        elif line.strip() == "}":
            comps[current] = tuple(body)
            current = None
        elif line.strip():
            body.append(parse_instr(line))
    if entry is None:
        raise ValueError("HLO text has no ENTRY computation (pass compiled.as_text())")
    return Module(comps, entry)


def _called(instr: Instr, key: str) -> list[str]:
    """The computations named by attribute `key` (calls=, body=, to_apply=, ...)."""
    m = re.search(rf"\b{key}=(\{{[^}}]*\}}|%[^\s,]+)", instr.attrs)
    if m is None:
        return []
    return re.findall(r"%([^\s,{}]+)", m.group(1))


def _scope(instr: Instr) -> str:
    m = _OP_NAME.search(instr.attrs)
    return m.group(1) if m else ""


def _int_list(attrs: str, key: str) -> list[int]:
    m = re.search(rf"\b{key}=\{{([\d,\s]*)\}}", attrs)
    return [int(x) for x in m.group(1).split(",") if x.strip()] if m else []


def _json_ints(attrs: str, key: str) -> list[int]:
    m = re.search(rf'"{key}":\[([^\]]*)\]', attrs)
    return [int(x.strip().strip('"')) for x in m.group(1).split(",") if x.strip()] if m else []


class _Walker:
    """Instruction lookups within one module (shapes by name, users within a computation)."""

    def __init__(self, module: Module):
        self.m = module
        self.shapes = {i.name: i.shape for c in module.computations.values() for i in c}

    def comp(self, name: str) -> tuple[Instr, ...]:
        if name not in self.m.computations:
            raise ValueError(f"HLO text: computation %{name} is called but not defined")
        return self.m.computations[name]

    def dot_flops(self, instr: Instr) -> tuple[float, str | None]:
        """(FLOPs, precision) of one dot, convolution or cuBLAS gemm custom call; (0, None)
        for any other instruction."""
        out = instr.shape
        if instr.op == "dot":
            contracting = _int_list(instr.attrs, "lhs_contracting_dims")
        elif instr.op == "custom-call" and "dot_dimension_numbers" in instr.attrs:
            contracting = _json_ints(instr.attrs, "lhs_contracting_dimensions")
            if out.startswith("("):      # (result, workspace)
                out = _split_top(out[1:-1])[0]
        elif instr.op == "convolution":
            kernel = dims(self.shapes[instr.operands[1]])
            labels = re.search(r"dim_labels=\w+_(\w+)->", instr.attrs)
            o = labels.group(1).index("o") if labels else len(kernel) - 1
            per = math.prod(kernel) // kernel[o]
            return (2.0 * math.prod(dims(out)) * per,
                    _PRECISION.get(_dtype(self.shapes[instr.operands[0]]), None))
        else:
            return 0.0, None
        lhs = dims(self.shapes[instr.operands[0]])
        k = math.prod(lhs[d] for d in contracting)
        return (2.0 * math.prod(dims(out)) * k,
                _PRECISION.get(_dtype(self.shapes[instr.operands[0]]), None))

    def grouped_flops(self, instr: Instr) -> tuple[float, str | None]:
        """(FLOPs, precision) of a grouped-matmul custom call (a Pallas/Mosaic kernel) from its
        shapes: its 2-D floating operand [M, K] with a 2-D result [M, N] (forward, dlhs:
        2 M K N) or a 3-D result [G, A, B] (the weight gradient: 2 M A B); (0, None) for any
        other shape. The useful FLOPs: tiles straddling two groups are not counted."""
        rows = [self.shapes[o] for o in instr.operands
                if _dtype(self.shapes[o]) in _PRECISION and len(dims(self.shapes[o])) == 2]
        out = instr.shape if not instr.shape.startswith("(") else \
            _split_top(instr.shape[1:-1])[0]
        if not rows or _dtype(out) not in _PRECISION:
            return 0.0, None
        m, k = dims(rows[0])
        res = dims(out)
        if len(res) == 2 and res[0] == m:
            return 2.0 * m * k * res[1], _PRECISION[_dtype(rows[0])]
        if len(res) == 3:
            return 2.0 * m * res[1] * res[2], _PRECISION[_dtype(rows[0])]
        return 0.0, None

    def fused_flops(self, comp_name: str) -> tuple[float, str | None]:
        """FLOPs of the dots/convolutions in a fused computation and those it calls."""
        total, precision = 0.0, None
        for instr in self.comp(comp_name):
            f, p = self.dot_flops(instr)
            total += f
            precision = precision or p
            for key in ("calls", "to_apply"):
                for sub in _called(instr, key):
                    f, p = self.fused_flops(sub)
                    total += f
                    precision = precision or p
        return total, precision

    def _through_bitcasts(self, body: tuple[Instr, ...], name: str) -> list[tuple[Instr, int]]:
        """(user, operand index) of `name` in `body`, looking through bitcasts."""
        out = []
        for u in body:
            for i, o in enumerate(u.operands):
                if o == name:
                    out += (self._through_bitcasts(body, u.name) if u.op == "bitcast"
                            else [(u, i)])
        return out

    def _root_source(self, body: tuple[Instr, ...], name: str) -> str:
        by_name = {i.name: i for i in body}
        while name in by_name and by_name[name].op == "bitcast":
            name = by_name[name].operands[0]
        return name

    def io_bytes(self, instr: Instr) -> tuple[int, int]:
        """(bytes read, bytes written) of one kernel (see the module docstring)."""
        operands = list(dict.fromkeys(instr.operands))       # distinct, in order
        reads = {o: shape_bytes(self.shapes[o]) for o in operands}
        written = self._result_bytes(instr)
        fused = _called(instr, "calls") if instr.op in ("fusion", "fusion-start") else []
        if fused:
            body = self.comp(fused[0])
            params = {int(i.operands[0]): i.name for i in body if i.op == "parameter"}
            for idx, pname in params.items():
                if idx >= len(instr.operands):
                    continue
                uses = self._through_bitcasts(body, pname)
                if uses and all(u.op in _SLICING and i == 0 for u, i in uses):
                    reads[instr.operands[idx]] = min(
                        reads[instr.operands[idx]],
                        sum(shape_bytes(u.shape) for u, _ in uses))
            roots = [i for i in body if i.root]
            outs = ([self._by(body, o) for o in roots[0].operands]
                    if roots and roots[0].op == "tuple" else roots)
            for r in outs:
                r = self._by(body, self._root_source(body, r.name))
                if r is not None and r.op in _IN_PLACE:
                    src = self._root_source(body, r.operands[0])
                    if src in params.values():
                        idx = next(k for k, v in params.items() if v == src)
                        reads[instr.operands[idx]] = 0
                    written += shape_bytes(self.shapes[_update(r)]) - shape_bytes(r.shape)
        elif instr.op in _SLICING:
            reads[instr.operands[0]] = min(reads[instr.operands[0]], written)
        elif instr.op in _IN_PLACE:
            reads[instr.operands[0]] = 0
            written = shape_bytes(self.shapes[_update(instr)])
        return sum(reads.values()), written

    @staticmethod
    def _by(body: tuple[Instr, ...], name: str) -> Instr | None:
        return next((i for i in body if i.name == name), None)

    def _result_bytes(self, instr: Instr) -> int:
        if instr.op == "fusion-start" and instr.shape.startswith("(("):
            return shape_bytes(_split_top(instr.shape[1:-1])[1])
        if instr.op == "copy-start" and instr.shape.startswith("("):
            return shape_bytes(_split_top(instr.shape[1:-1])[0])
        return shape_bytes(instr.shape)


def _update(instr: Instr) -> str:
    """The update operand of a dynamic-update-slice (operand 1) or a scatter (the last)."""
    return instr.operands[1] if instr.op == "dynamic-update-slice" else instr.operands[-1]


def kernels(text: str) -> list[dict]:
    """The kernels one execution of the module in `text` launches (see the module docstring),
    one dict each, in program order, merged by name: {"name", "kind", "scope", "group",
    "computation", "count", "bytes_read", "bytes_written", "flops" (those three per launch),
    "precision", "note"}. ValueError for text that is not HLO."""
    module = parse(text)
    w = _Walker(module)
    rows: dict[str, dict] = {}

    def visit(comp: str, count: int, note: str | None, depth: int) -> None:
        if depth > 64:
            raise ValueError(f"HLO text: computations nest deeper than 64 at %{comp}")
        for instr in w.comp(comp):
            op = instr.op
            if op == "while":
                trip = _TRIP.search(instr.attrs)
                n = int(trip.group(1)) if trip else 1
                why = note if trip else (f"loop {instr.name} has no known trip count: "
                                         "counted once")
                for body in _called(instr, "body"):
                    visit(body, count * n, why, depth + 1)
                if not trip:
                    for cond in _called(instr, "condition"):
                        visit(cond, count, why, depth + 1)
            elif op == "call":
                for sub in _called(instr, "to_apply"):
                    visit(sub, count, note, depth + 1)
            elif op == "conditional":
                branches = (_called(instr, "branch_computations")
                            or _called(instr, "true_computation")
                            + _called(instr, "false_computation"))
                for b in branches:
                    visit(b, count, f"a branch of {instr.name}: one branch runs", depth + 1)
            elif op == "async-start":
                for sub in _called(instr, "calls"):
                    visit(sub, count, note, depth + 1)
            elif op in BOOKKEEPING or op.endswith(("-done", "-update")):
                continue
            else:
                _add(rows, w, instr, comp, count, note)

    visit(module.entry, 1, None, 0)
    return list(rows.values())


def _add(rows: dict, w: _Walker, instr: Instr, comp: str, count: int, note: str | None) -> None:
    if instr.name in rows:
        rows[instr.name]["count"] += count
        return
    if instr.op in ("fusion", "fusion-start"):
        kind = re.search(r"\bkind=(\w+)", instr.attrs)
        custom = re.search(r'"kind":"(\w+)"', instr.attrs)
        what = (custom.group(1) if custom and kind and kind.group(1) == "kCustom"
                else kind.group(1) if kind else instr.op)
        flops, precision = 0.0, None
        for sub in _called(instr, "calls"):
            f, p = w.fused_flops(sub)
            flops, precision = flops + f, precision or p
    else:
        target = re.search(r'custom_call_target="([^"]*)"', instr.attrs)
        what = target.group(1) if target else instr.op
        flops, precision = w.dot_flops(instr)
        if not flops and instr.op == "custom-call" and \
                group(instr.name, _scope(instr)) == "moe_gmm":
            flops, precision = w.grouped_flops(instr)
    read, written = w.io_bytes(instr)
    scope = _scope(instr)
    rows[instr.name] = {"name": instr.name, "kind": what, "scope": scope,
                        "group": group(instr.name, scope), "computation": comp,
                        "count": count, "bytes_read": read, "bytes_written": written,
                        "flops": flops, "precision": precision, "note": note}


def predict(rows: list[dict], profile, *,
            peak: Callable[[str], float | None] | None = None) -> list[dict]:
    """Records of the predicted table for one execution (one training step) from `kernels`
    rows, in the schema of `train.profile.table_records` (measured): a "kernel" record each,
    most time first ({"event", "name", "group", "count", "total_us", "share", "hlo_op" (the
    instruction name, what a trace's hlo_op stat names), "scope", "us_per_step"} plus "kind",
    "bytes", "bytes_read", "bytes_written", "flops" (all launches), "bound", "precision",
    "note"), then a "group" record each of GROUPS, largest first ({"event", "group",
    "total_us", "share", "us_per_step", "bytes", "flops"}). `profile`: hbm_bw, hbm_efficiency,
    peak_bf16, gemm_efficiency; `peak(precision)`: FLOP/s for a dot's precision (None or a
    missing precision: peak_bf16)."""
    bw = profile.hbm_bw * profile.hbm_efficiency
    out = []
    for r in rows:
        rate = (peak(r["precision"]) if peak and r["precision"] else None) or profile.peak_bf16
        rate *= profile.gemm_efficiency
        nbytes = r["bytes_read"] + r["bytes_written"]
        mem_s, flop_s = nbytes / bw, r["flops"] / rate
        us = r["count"] * max(mem_s, flop_s) * 1e6
        out.append({"event": "kernel", "name": r["name"], "group": r["group"],
                    "count": r["count"], "total_us": us, "share": 0.0,
                    "hlo_op": r["name"], "scope": r["scope"] or None, "us_per_step": us,
                    "kind": r["kind"], "bytes": r["count"] * nbytes,
                    "bytes_read": r["count"] * r["bytes_read"],
                    "bytes_written": r["count"] * r["bytes_written"],
                    "flops": r["count"] * r["flops"],
                    "bound": "compute" if flop_s > mem_s else "memory",
                    "precision": r["precision"], "note": r["note"]})
    total = sum(r["total_us"] for r in out) or 1.0
    sums = {g: {"total_us": 0.0, "bytes": 0, "flops": 0.0} for g in GROUPS}
    for r in out:
        r["share"] = r["total_us"] / total
        s = sums[r["group"]]
        s["total_us"] += r["total_us"]
        s["bytes"] += r["bytes"]
        s["flops"] += r["flops"]
    out.sort(key=lambda r: (-r["total_us"], r["name"]))
    groups = [{"event": "group", "group": g, "total_us": s["total_us"],
               "share": s["total_us"] / total, "us_per_step": s["total_us"],
               "bytes": s["bytes"], "flops": s["flops"]}
              for g, s in sorted(sums.items(), key=lambda kv: -kv[1]["total_us"])]
    return out + groups
