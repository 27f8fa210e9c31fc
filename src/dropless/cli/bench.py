"""`dropless bench KIND`: each kind's flags, checked, then handed to its bench module's `run` as
that bench's typed options (`dropless.bench.gmm.GmmOptions`, ...).

Every kind's arguments are checked here, before its module runs (so before anything is compiled
or timed): sizes and repeats are positive, buffer factors >= 1, comma lists name known dtypes,
backends, routings and dispatchers, `--experts E:K` has 0 < K <= E, `--cap` and
`--inject-fault` are KEY=VALUE pairs and a cap is a number of seconds (`bench gpu` checks its
own sections, shapes and fault kinds first thing). Then the sizes must fit: `needed_bytes` is a
lower bound of what the largest case holds at once (its inputs, weights and outputs; what XLA
adds on top is not counted), refused when above the memory of the devices it runs on. A bad one
is a ValueError naming the flag and the value (one line, exit 2, at the command line).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import math
import os
from typing import Any, Callable, NamedTuple


class Kind(NamedTuple):
    """One `dropless bench` kind: its module (with `run(options)`), its help line, the function
    that adds its flags to a parser, and the one that turns the parsed flags into its options."""
    module: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    options: Callable[[argparse.Namespace], Any]


def _join(items) -> str:
    return ",".join(map(str, items))


def _split(text: str) -> tuple[str, ...]:
    """The items of a comma list, stripped (`check_arguments` refuses empty ones first)."""
    return tuple(x.strip() for x in str(text).split(","))


def _options(cls, args: argparse.Namespace, **typed):
    """`cls` from the parsed flags named as its fields, with `typed` (the fields parsed from
    text: comma lists, KEY=VALUE pairs) given."""
    names = [f.name for f in dataclasses.fields(cls) if f.name not in typed]
    return cls(**{name: getattr(args, name) for name in names}, **typed)


def _pairs(items: list[str], what: str) -> dict[str, str]:
    out = {}
    for item in (i for i in items if i):
        key, sep, val = item.partition("=")
        if not sep or not key or not val:
            raise ValueError(f"{what}: {item!r} is not KEY=VALUE")
        out[key] = val
    return out


def _seconds(pairs: dict[str, str], what: str) -> dict[str, float]:
    out = {}
    for key, val in pairs.items():
        try:
            out[key] = float(val)
        except ValueError:
            raise ValueError(f"{what} {key}={val!r} is not a number of seconds") from None
    return out


def _dispatch_arguments(p: argparse.ArgumentParser) -> None:
    from dropless.bench.dispatch import DispatchOptions
    d = DispatchOptions()
    p.add_argument("--tokens", type=int, default=d.tokens,
                   help=f"global tokens T (default {d.tokens})")
    p.add_argument("--d-model", type=int, default=d.d_model, help=f"D (default {d.d_model})")
    p.add_argument("--d-ff", type=int, default=d.d_ff, help=f"expert hidden F (default {d.d_ff})")
    p.add_argument("--experts", type=int, default=d.experts, help=f"E (default {d.experts})")
    p.add_argument("--top-k", type=int, default=d.top_k, help=f"K (default {d.top_k})")
    p.add_argument("--ep", type=int, default=d.ep, help=f"expert-parallel ranks (default {d.ep})")
    p.add_argument("--host-devices", type=int, default=d.host_devices,
                   help=f"on CPU, host devices to create (default {d.host_devices}; needs a "
                        "fresh process)")
    p.add_argument("--devices-per-node", type=int, default=d.devices_per_node,
                   help=f"for intra/inter-node byte accounting (default {d.devices_per_node})")
    p.add_argument("--buffer-factor", type=float, default=d.buffer_factor,
                   help=f"ragged_buffer_factor (default {d.buffer_factor})")
    p.add_argument("--dispatchers", default=_join(d.dispatchers),
                   help=f"comma list (default {_join(d.dispatchers)}; ragged_a2a on GPU/TPU)")
    p.add_argument("--rows-only", action="store_true",
                   help="no timing: deterministic rows per dispatcher for each of --routings")
    p.add_argument("--routings", default=_join(d.routings),
                   help="with --rows-only: router bias, uniform and/or zipf (default both)")
    p.add_argument("--wire-bytes", action="store_true",
                   help="no timing: each dispatcher's dispatch bytes with BF16 rows and with "
                        "MXFP8 rows (dispatch_quantization), from its HLO and its row counts")
    p.add_argument("--projection-only", action="store_true",
                   help="only the DeepSeek-V3 projection; with 64 devices (--host-devices 64) "
                        "also measured through node_a2a")
    p.add_argument("--repeats", type=int, default=d.repeats)
    p.add_argument("--projection-tokens", type=int, default=d.projection_tokens,
                   help="tokens in the DeepSeek-V3 routing sample (0 to skip; default "
                        f"{d.projection_tokens})")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 1024 tokens, D=F=128, 3 repeats, 1024-token projection")
    p.add_argument("--out", default=None, help="append JSON lines here")


def _dispatch_options(args: argparse.Namespace):
    from dropless.bench.dispatch import DispatchOptions
    return _options(DispatchOptions, args, dispatchers=_split(args.dispatchers),
                    routings=_split(args.routings))


def _gmm_arguments(p: argparse.ArgumentParser) -> None:
    from dropless.bench.gmm import ROUTINGS, GmmOptions
    d = GmmOptions()
    p.add_argument("--m", type=int, default=d.m, help=f"routed rows M (default {d.m})")
    p.add_argument("--k", type=int, default=d.k, help=f"contraction dim K (default {d.k})")
    p.add_argument("--n", type=int, default=d.n, help=f"output dim N (default {d.n})")
    p.add_argument("--groups", default=_join(d.groups),
                   help=f"comma list of G (default {_join(d.groups)})")
    p.add_argument("--routings", default=_join(d.routings), help=f"comma list of {ROUTINGS}")
    p.add_argument("--dtypes", default=_join(d.dtypes), help="comma list of dtypes")
    p.add_argument("--backends", default=_join(d.backends),
                   help="comma list of backends to time beside dense (default "
                        f"{_join(d.backends)}; padded uses capacity = largest group; "
                        "native:own and native:openblas force the native library's kernel; "
                        "openblas, the native backend's old name, still works)")
    p.add_argument("--repeats", type=int, default=d.repeats,
                   help="timed runs per function (median)")
    p.add_argument("--budget-s", type=float, default=d.budget_s,
                   help="time budget per baseline and case: G-fold baselines get fewer runs, "
                        f"and are skipped if two calls would not fit (default {d.budget_s:g})")
    p.add_argument("--quick", action="store_true",
                   help="small smoke run: M=2048, K=N=256, G=8,64, uniform+half, 3 repeats")
    p.add_argument("--model-only", action="store_true",
                   help="print pallas_gpu's cost model for each case and time nothing")
    p.add_argument("--out", default=None, help="append JSON lines here")


def _gmm_options(args: argparse.Namespace):
    from dropless.bench.gmm import GmmOptions
    return _options(GmmOptions, args, groups=tuple(int(v) for v in _split(args.groups)),
                    routings=_split(args.routings), dtypes=_split(args.dtypes),
                    backends=_split(args.backends))


def _gpu_arguments(p: argparse.ArgumentParser) -> None:
    from dropless.bench import gpu_plan as plan
    from dropless.bench.gpu import FAULT_KINDS, GpuOptions
    d = GpuOptions()
    p.add_argument("--out-dir", default=os.environ.get("OUT", d.out_dir),
                   help=f"where gpu_bench.jsonl and the logs go (default $OUT, else ./{d.out_dir})")
    p.add_argument("--sections", default=_join(d.sections),
                   help=f"comma list of {plan.SECTIONS}, run in that order")
    p.add_argument("--routings", default=_join(d.routings), help="grouped-matmul routings")
    p.add_argument("--shapes", default=None,
                   help="comma list of shape labels (default all: "
                        f"{_join(s.label for s in plan.SHAPES)}; dry run: "
                        f"{_join(s.label for s in plan.DRY_SHAPES)})")
    p.add_argument("--train-steps", type=int, default=d.train_steps)
    p.add_argument("--train-set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config key the train section's run sets over the preset's run "
                        "settings (repeatable), e.g. model.scan_layers=true or "
                        "gradient_accumulation_steps=4: a variant to measure")
    p.add_argument("--train-dir", default=None,
                   help="the training run's directory (default: a new temporary one, so OUT_DIR "
                        "holds only the results and the logs)")
    p.add_argument("--budget-s", type=float, default=d.budget_s,
                   help=f"the whole check's deadline in seconds (default {d.budget_s}; the "
                        f"dry run's, and its caps, are {plan.DRY_CAP_SCALE} times longer)")
    p.add_argument("--maxtext-dir", default=d.maxtext_dir, metavar="DIR",
                   help="the folder benchmarks/gpu/fetch_maxtext.sh wrote, for the maxtext "
                        "section (default: the checkout's .maxtext; absent: a skip record)")
    p.add_argument("--cap", action="append", default=[], metavar="SECTION=SECONDS",
                   help=f"override a section's time cap (defaults {plan.CAPS_S})")
    p.add_argument("--inject-fault", default="", metavar="KEY=KIND,...",
                   help="make a section (KEY=gmm) or one measurement (KEY=gmm:pallas_gpu) "
                        f"{'/'.join(FAULT_KINDS)}: shows on CPU that failures stay isolated; "
                        "KEY=moe:tokamax (gmm, moe, train) =compile/=run puts a stand-in "
                        "tokamax that fails there first in auto, to show the fallback")
    p.add_argument("--dry-run", action="store_true",
                   help="every section on CPU with tiny shapes (pallas_gpu in interpret mode, "
                        "the tests only collected)")


def _gpu_options(args: argparse.Namespace):
    from dropless.bench.gpu import GpuOptions
    from dropless.config_file import parse_override
    return _options(GpuOptions, args,
                    sections=tuple(s for s in _split(args.sections) if s),
                    routings=_split(args.routings),
                    shapes=_split(args.shapes) if args.shapes else None,
                    caps=_seconds(_pairs(args.cap, "--cap"), "--cap"),
                    train_set=tuple((k, parse_override(f"{k}={v}")[1]) for k, v in
                                    _pairs(args.train_set, "--train-set").items()),
                    faults=_pairs(args.inject_fault.split(","), "--inject-fault"))


def _moe_arguments(p: argparse.ArgumentParser) -> None:
    from dropless.bench.moe import MoEOptions
    d = MoEOptions()
    experts = _join(f"{e}:{k}" for e, k in d.experts)
    p.add_argument("--rows", type=int, default=d.rows,
                   help=f"routed rows N = T*K (default {d.rows})")
    p.add_argument("--d-model", type=int, default=d.d_model, help=f"D (default {d.d_model})")
    p.add_argument("--d-ff", type=int, default=d.d_ff, help=f"expert hidden F (default {d.d_ff})")
    p.add_argument("--experts", default=experts,
                   help=f"comma list of E:K pairs (default {experts})")
    p.add_argument("--routings", default=_join(d.routings), help="uniform and/or zipf")
    p.add_argument("--dtypes", default=_join(d.dtypes), help="comma list of dtypes")
    p.add_argument("--backends", default=_join(d.backends),
                   help="grouped-matmul backends for the dropless layer (default "
                        f"{_join(d.backends)})")
    p.add_argument("--capacity-factors", default=_join(d.capacity_factors),
                   help=f"capacity baseline factors (default {_join(d.capacity_factors)}; "
                        "empty for none)")
    p.add_argument("--no-fused", action="store_true",
                   help="skip the prefuse_moe_weights rows (fused/<backend>)")
    p.add_argument("--repeats", type=int, default=d.repeats)
    p.add_argument("--budget-s", type=float, default=d.budget_s,
                   help="skip a variant whose estimated total time exceeds this (default "
                        f"{d.budget_s:g})")
    p.add_argument("--quick", action="store_true",
                   help="small smoke run: 2048 rows, D=F=256, E:K=8:2, uniform, 3 repeats")
    cases = _join(":".join(map(str, c)) for c in d.cases)
    p.add_argument("--vs-torch", action="store_true",
                   help="side by side with PyTorch (HF Mixtral block on _grouped_mm, raw "
                        "_grouped_mm, dense) over --cases, in one round-robin; needs the "
                        "bench-torch extra")
    p.add_argument("--profile", action="store_true",
                   help="per-part profile of the layer's forward and backward over --cases, "
                        "each part against its FLOPs/bytes limit")
    p.add_argument("--cases", default=cases,
                   help=f"--vs-torch/--profile cases, comma list of T:E:K:D:F (default {cases})")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="torch's intra-op threads (default: every usable core)")
    p.add_argument("--out", default=None, help="append JSON lines here")


def _peer_cases(text: str) -> tuple[tuple[int, ...], ...]:
    cases = []
    for item in _split(text):
        parts = item.split(":")
        if len(parts) != 5 or not all(v.isdigit() and int(v) > 0 for v in parts):
            raise ValueError(f"--cases: {item!r} is not T:E:K:D:F (five positive ints, e.g. "
                             "4096:8:2:512:1024)")
        t, e, k, d, f = map(int, parts)
        if k > e:
            raise ValueError(f"--cases: {item!r} needs top_k <= experts (K={k}, E={e})")
        cases.append((t, e, k, d, f))
    return tuple(cases)


def _moe_options(args: argparse.Namespace):
    from dropless.bench.moe import MoEOptions
    pairs = (item.split(":") for item in _split(args.experts))
    return _options(MoEOptions, args, experts=tuple((int(e), int(k)) for e, k in pairs),
                    routings=_split(args.routings), dtypes=_split(args.dtypes),
                    backends=_split(args.backends),
                    capacity_factors=tuple(float(v) for v in _split(args.capacity_factors) if v),
                    fused=not args.no_fused, cases=_peer_cases(args.cases))


def _quant_arguments(p: argparse.ArgumentParser) -> None:
    from dropless.bench.quant import QuantOptions
    d = QuantOptions()
    p.add_argument("--shape", type=int, nargs=4, default=d.shape, metavar=("M", "K", "N", "G"),
                   help="grouped-matmul shape for the gmm error and cost parts")
    p.add_argument("--error-shape", type=int, nargs=2, default=d.error_shape,
                   metavar=("R", "C"), help="tensor shape for the quantization-error part")
    p.add_argument("--backend", default=d.backend, help="grouped-matmul backend wrapped")
    p.add_argument("--repeats", type=int, default=d.repeats, help="timed repeats per candidate")
    p.add_argument("--skip-cost", action="store_true", help="accuracy parts only")
    p.add_argument("--convergence", action="store_true",
                   help="also train the two-layer MoE regression task, bf16 vs MXFP8")
    p.add_argument("--steps", type=int, default=d.steps, help="training steps (convergence)")
    p.add_argument("--plot", default=None,
                   help="PNG path for the convergence losses (needs matplotlib)")
    p.add_argument("--preset", default=None,
                   help="with --convergence: train this preset (e.g. tiny) once per "
                        "--quantizations instead of the regression task; only that part runs")
    p.add_argument("--quantizations", default=",".join(d.quantizations),
                   help=f"comma list for --preset (default {','.join(d.quantizations)})")
    p.add_argument("--batch", type=int, default=d.batch, help="--preset: sequences a step")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="--preset: tokens a sequence")
    p.add_argument("--run-dir", default=d.run_dir, help="--preset: where the runs go")
    p.add_argument("--out", default=None, help="append JSON lines to this file")


def _quant_options(args: argparse.Namespace):
    from dropless.bench.quant import QuantOptions
    from dropless.bench.quant_convergence import PRESET_QUANTIZATIONS
    _one_of(args, "quantizations", PRESET_QUANTIZATIONS)
    return _options(QuantOptions, args, shape=tuple(args.shape),
                    error_shape=tuple(args.error_shape),
                    quantizations=tuple(_items(args, "quantizations")))


def _prepare_arguments(p: argparse.ArgumentParser) -> None:
    from dropless.bench.prepare import PrepareOptions
    d = PrepareOptions()
    p.add_argument("--corpus-mb", type=int, default=d.corpus_mb,
                   help=f"MB of text to write, half JSONL.zst, half Parquet (default {d.corpus_mb})")
    p.add_argument("--corpus", default=d.corpus, help="an existing source instead (any SRC)")
    p.add_argument("--tokenizer", default=d.tokenizer,
                   help="a tokenizer.json, or byte (default: a byte-level BPE trained here)")
    p.add_argument("--vocab", type=int, default=d.vocab,
                   help=f"the trained BPE's vocabulary (default {d.vocab})")
    p.add_argument("--workers", default=_join(d.workers),
                   help=f"comma list of worker counts (default {_join(d.workers)})")
    p.add_argument("--quick", action="store_true", help="smoke run: 4 MB, vocab 2000, 1 worker")
    p.add_argument("--out", default=None, help="append JSON lines here")


def _prepare_options(args: argparse.Namespace):
    from dropless.bench.prepare import PrepareOptions
    workers = _items(args, "workers")
    if not all(w.isdigit() and int(w) >= 1 for w in workers):
        raise ValueError(f"--workers {args.workers!r}: each must be a whole number >= 1")
    if args.corpus_mb < 1 or args.vocab < 300:
        raise ValueError("--corpus-mb must be >= 1 and --vocab >= 300")
    return _options(PrepareOptions, args, workers=tuple(int(w) for w in workers))


def _data_arguments(p: argparse.ArgumentParser) -> None:
    from dropless.bench.data import DataOptions
    d = DataOptions()
    for name in ("dir", "tokens", "doc_len", "shard_tokens", "batch", "seq_len", "batches",
                 "packings", "mfu", "memory_steps"):
        default = getattr(d, name)
        p.add_argument(_flag(name), type=type(default), default=default,
                       help=f"(default {default})")
    p.add_argument("--quick", action="store_true", help="a small dataset, few batches")
    p.add_argument("--out", default=None, help="append JSON lines to this file")


def _data_options(args: argparse.Namespace):
    from dropless.bench.data import DataOptions
    return _options(DataOptions, args)


def _init_arguments(p: argparse.ArgumentParser) -> None:
    from dropless.bench.init_convergence import InitOptions
    d = InitOptions()
    p.add_argument("--preset", default=d.preset, help=f"the model (default {d.preset})")
    p.add_argument("--steps", type=int, default=d.steps, help=f"per run (default {d.steps})")
    p.add_argument("--seeds", default=_join(d.seeds), help=f"comma list (default {_join(d.seeds)})")
    p.add_argument("--schemes", default=_join(d.schemes),
                   help=f"comma list of model.init schemes (default {_join(d.schemes)})")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a config item for every run (repeatable), e.g. model.head_init_std=0.088")
    p.add_argument("--runs-dir", default=d.runs_dir,
                   help=f"where the run directories go (default ./{d.runs_dir})")
    p.add_argument("--quick", action="store_true", help="smoke run: 4 steps, seed 0")
    p.add_argument("--out", default=d.out, help=f"append JSON lines here (default {d.out}); runs "
                   "already there are not run again")


def _init_options(args: argparse.Namespace):
    from dropless.bench.init_convergence import InitOptions
    from dropless.config import INIT_SCHEMES
    _numbers(args, "seeds", int, 0, "a seed (a whole number >= 0)")
    _one_of(args, "schemes", INIT_SCHEMES)
    _pairs(args.overrides, "--set")
    return _options(InitOptions, args, seeds=tuple(int(v) for v in _items(args, "seeds")),
                    schemes=tuple(_items(args, "schemes")), overrides=tuple(args.overrides))


KINDS = {
    "data": Kind("dropless.bench.data", "the loader: prepared shards -> device batches, tokens/s "
                 "against what training consumes, resident memory", _data_arguments,
                 _data_options),
    "dispatch": Kind("dropless.bench.dispatch",
                     "expert-parallel dispatchers: latency, rows/bytes moved, dedup saving",
                     _dispatch_arguments, _dispatch_options),
    "gpu": Kind("dropless.bench.gpu", "the prepared device check for one NVIDIA GPU: GPU tests, "
                "grouped matmul vs cuBLAS and torch, MoE layer, a few training steps, MaxText's beside "
                "them (--dry-run: CPU)", _gpu_arguments, _gpu_options),
    "gmm": Kind("dropless.bench.gmm", "grouped matmul backends vs a dense matmul of equal FLOPs",
                _gmm_arguments, _gmm_options),
    "init": Kind("dropless.bench.init_convergence", "initialisation schemes (model.init): eval "
                 "loss of each scheme and seed trained with the trainer", _init_arguments,
                 _init_options),
    "moe": Kind("dropless.bench.moe", "MoE layer (dropless and capacity) vs a dense SwiGLU FFN",
                _moe_arguments, _moe_options),
    "quant": Kind("dropless.bench.quant", "MXFP8 vs bf16 / per-tensor FP8: error, emulation "
                  "cost, convergence", _quant_arguments, _quant_options),
    "prepare": Kind("dropless.bench.prepare", "`data prepare` tokens/s per worker vs the "
                    "tokenizer's batch encoder, scaling with workers, peak memory",
                    _prepare_arguments, _prepare_options),
}
POSITIVE = ("doc_len", "shard_tokens", "batch", "seq_len", "batches", "mfu", "tokens", "d_model", "d_ff", "top_k", "ep", "host_devices", "devices_per_node",
            "repeats", "m", "k", "n", "rows", "steps", "train_steps", "tests_timeout_s",
            "budget_s", "shape", "error_shape", "torch_threads")
AT_LEAST_ZERO = ("projection_tokens",)
AT_LEAST_ONE = ("buffer_factor",)
ROUTINGS = {"gmm": None, "gpu": None, "moe": ("uniform", "zipf"), "dispatch": ("uniform", "zipf")}


def add_arguments(parser) -> None:
    sub = parser.add_subparsers(dest="kind", required=True, metavar="KIND")
    for name, kind in KINDS.items():
        kind.add_arguments(sub.add_parser(name, help=kind.help, description=kind.help))


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _items(args, dest: str) -> list[str]:
    text = getattr(args, dest)
    items = list(_split(text))
    if not all(items):
        raise ValueError(f"{_flag(dest)} {text!r} has an empty item (a comma list: a,b,c)")
    return items


def _one_of(args, dest: str, known) -> None:
    for item in _items(args, dest):
        if item not in known:
            raise ValueError(f"{_flag(dest)}: {item!r} is not one of {', '.join(known)}")


def _numbers(args, dest: str, convert, low: float, what: str) -> None:
    for item in _items(args, dest):
        try:
            ok = math.isfinite(convert(item)) and convert(item) >= low
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"{_flag(dest)}: {item!r} is not {what}")


def _dtypes(args) -> None:
    import jax.numpy as jnp
    for item in _items(args, "dtypes"):
        try:
            ok = jnp.issubdtype(jnp.dtype(item), jnp.floating)
        except TypeError:
            ok = False
        if not ok:
            raise ValueError(f"--dtypes: {item!r} is not a floating dtype (float32, bfloat16, "
                             "float16)")


def _experts_pairs(args) -> None:
    for item in _items(args, "experts"):
        e, sep, k = item.partition(":")
        if not (sep and e.isdigit() and k.isdigit()):
            raise ValueError(f"--experts: {item!r} is not E:K (experts:top_k, e.g. 8:2)")
        if not 0 < int(k) <= int(e):
            raise ValueError(f"--experts: {item!r} needs 0 < top_k <= experts (top_k={k}, "
                             f"experts={e})")


def check_arguments(kind: str, args) -> None:
    """Raise ValueError naming the flag and value of the first bad argument of `kind`."""
    for dest in POSITIVE + AT_LEAST_ZERO + AT_LEAST_ONE:
        value = getattr(args, dest, None)
        if value is None:
            continue
        low = 0 if dest in AT_LEAST_ZERO else 1 if dest in AT_LEAST_ONE else None
        values = value if isinstance(value, (list, tuple)) else [value]
        if not all(math.isfinite(v) and (v > 0 if low is None else v >= low) for v in values):
            need = "> 0" if low is None else f">= {low}"
            raise ValueError(f"{_flag(dest)} {' '.join(map(str, values))} must be {need}")
    if kind == "dispatch":
        if not 0 < args.top_k <= args.experts:
            raise ValueError(f"--top-k {args.top_k} must be in [1, --experts={args.experts}]")
        if args.host_devices % args.ep:
            raise ValueError(f"--ep={args.ep} does not divide --host-devices={args.host_devices}")
        from dropless.moe.dispatch import DISPATCHERS
        _one_of(args, "dispatchers", tuple(DISPATCHERS))
    if isinstance(getattr(args, "experts", None), str):
        _experts_pairs(args)
    if getattr(args, "groups", None) is not None:
        _numbers(args, "groups", int, 1, "a positive number of groups")
    if getattr(args, "capacity_factors", None):
        _numbers(args, "capacity_factors", float, 1e-300, "a capacity factor > 0")
    if getattr(args, "dtypes", None) is not None:
        _dtypes(args)
    for dest in ("backends", "backend"):   # gmm, moe: a comma list; quant: one name
        if getattr(args, dest, None) is not None:
            from dropless.ops.gmm.registry import check_backend_name
            for item in _items(args, dest):
                # gmm also takes native:own / native:openblas (bench/gmm.py split_backend)
                check_backend_name(item.partition(":")[0] if kind == "gmm" else item,
                                   where=_flag(dest))
                if kind == "gmm":
                    from dropless.bench.gmm import split_backend
                    split_backend(item)
    if getattr(args, "routings", None) is not None:
        known = ROUTINGS.get(kind)
        if known is None:
            from dropless.bench.gmm import ROUTINGS as known
        _one_of(args, "routings", known)


def _itemsize(args) -> int:
    """The widest dtype a bench holds its arrays in (host inputs are drawn as float32 first)."""
    import numpy as np
    names = _split(args.dtypes) if getattr(args, "dtypes", None) else ()
    return max([4] + [np.dtype(_jnp_dtype(n)).itemsize for n in names])


def _jnp_dtype(name: str):
    import jax.numpy as jnp
    return jnp.dtype(name)


def needed_bytes(kind: str, args) -> tuple[int, str]:
    """(a lower bound of the bytes the largest case of `kind` holds at once, the flags that set
    it), from the parsed flags; (0, "") for kinds not sized here (`gpu` sizes its own)."""
    if getattr(args, "quick", False):
        return 0, ""
    b = _itemsize(args)
    if kind == "gmm":   # lhs [M, K], the largest G's weights [G, K, N], the output [M, N]
        if args.model_only:
            return 0, ""
        g = max(int(v) for v in _split(args.groups))
        return b * (args.m * args.k + g * args.k * args.n + args.m * args.n), \
            "--m, --k, --n, --groups"
    if kind == "moe":   # three [E, D, F] expert weights, x and dy [N, D], routed rows [N, D]
        e = max(int(item.split(":")[0]) for item in _split(args.experts))
        return b * (3 * e * args.d_model * args.d_ff + 4 * args.rows * args.d_model), \
            "--rows, --d-model, --d-ff, --experts"
    if kind == "dispatch":   # expert weights, x and dy [T, D], routed rows [T*K, D]
        if args.rows_only or args.projection_only:
            return 0, ""
        t, d = args.tokens, args.d_model
        return 4 * (3 * args.experts * d * args.d_ff + 2 * t * d + t * args.top_k * d), \
            "--tokens, --d-model, --d-ff, --experts, --top-k"
    if kind == "quant":   # lhs [M, K], weights [G, K, N], output [M, N]; the error tensor [R, C]
        m, k, n, g = args.shape
        r, c = args.error_shape
        return 4 * max(m * k + g * k * n + m * n, r * c), "--shape, --error-shape"
    return 0, ""


def check_outputs(args) -> None:
    """Raise ValueError naming the flag when a file `--out` / `--plot` names cannot be written
    (a folder, a file in the way, an unwritable folder), or `--out-dir` is no folder to write
    into, before anything runs."""
    from dropless.runtime.environment import check_output_file, check_writable_folder
    for dest in ("out", "plot"):
        if getattr(args, dest, None):
            check_output_file(getattr(args, dest), _flag(dest))
    if getattr(args, "out_dir", None):
        check_writable_folder(args.out_dir, "--out-dir")


def check_sizes(kind: str, args) -> None:
    """Raise ValueError (the flags, the bytes needed and available) when `needed_bytes` is
    above the memory of the devices `kind` runs on."""
    need, flags = needed_bytes(kind, args)
    if need:
        from dropless.runtime.environment import check_fits
        # dispatch sets its host-device count before JAX starts: its bound is the host's RAM
        check_fits(need, f"dropless bench {kind} at these sizes ({flags})",
                   "choose smaller sizes", on_device=kind != "dispatch")


def run(args) -> int:
    """Check the flags of `dropless bench KIND`, then run KIND's bench with its options."""
    check_arguments(args.kind, args)
    check_outputs(args)
    check_sizes(args.kind, args)
    kind = KINDS[args.kind]
    return int(importlib.import_module(kind.module).run(kind.options(args)) or 0)
