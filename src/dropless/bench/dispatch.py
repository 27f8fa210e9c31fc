"""`dropless bench dispatch`: expert-parallel dispatchers on a device mesh, and a DeepSeek-V3
projection of bytes per token with and without deduplication.

Legend: T tokens, D model dim, F expert hidden dim, E experts, K top-k, P expert-parallel ranks.

Per dispatcher (allgather is the baseline), timed interleaved in one process: the dispatch
(round 0: plan, pack, exchange, replicate expert-major), dispatch + grouped matmul, one full
round (+ combine), the layer's expert path forward, and forward+backward. gmm and combine
latencies are differences of these prefixes. Rows and bytes come from the dispatcher's aux.
On CPU the mesh is host devices: set with --host-devices before JAX starts its backend.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re

import numpy as np

from dropless.runtime.xla_flags import ask_host_devices

PROJECTION = dict(num_experts=256, top_k=8, n_groups=8, topk_groups=4, d_model=7168, ep=64,
                  devices_per_node=8, bytes_per_value=2)   # DeepSeek-V3, bf16 dispatch


def _stage_fn(spec, ctx, mesh, stage: str):
    """Round 0 of a dispatcher cut after `stage` (dispatch | gmm | round), jitted; `mesh` a
    NodeMesh (parallel.mesh)."""
    import jax
    from jax.sharding import PartitionSpec as P

    from dropless.moe.experts import expert_ffn

    def local(x, w, ids, experts):
        state = spec.prepare(ids, ctx)
        x_ND, sizes, meta = spec.dispatch(x, w, state, 0, ctx)
        if stage == "dispatch":
            return x_ND
        y_ND = expert_ffn(x_ND, sizes, experts, ctx.cfg)
        return y_ND if stage == "gmm" else spec.combine(y_ND, meta, ctx)

    tok = P(ctx.all_axes)
    ex = {k: P(ctx.expert_axis) for k in ("w_gate_EDF", "w_up_EDF", "w_down_EFD")}
    return jax.jit(jax.shard_map(local, mesh=mesh.mesh, in_specs=(tok, tok, tok, ex),
                                 out_specs=tok, check_vma=False))


def _case(args, dispatchers, mesh):
    """Timings and rows of each dispatcher on `mesh` (a NodeMesh: the mesh and its node size)."""
    import jax
    import jax.numpy as jnp

    from dropless.config import MoEConfig
    from dropless import machine
    from dropless.moe import dispatch as dsp
    from dropless.moe import layer, router
    from dropless.moe.dispatch.context import split_expert_axis
    from dropless.parallel import shard_params

    cfg = MoEConfig(num_experts=args.experts, top_k=args.top_k, d_model=args.d_model,
                    d_ff=args.d_ff, ragged_buffer_factor=args.buffer_factor)
    params = shard_params(layer.init_params(jax.random.key(0), cfg), mesh)
    x = jax.random.normal(jax.random.key(1), (args.tokens, args.d_model), jnp.float32)
    routing = router.route(router.router_logits(x, params["router"]["w_DE"]),
                           params["router"]["bias_E"], cfg)
    w, ids, ex = routing.weights_TK, routing.ids_TK, params["experts"]
    dy = jax.random.normal(jax.random.key(2), x.shape, jnp.float32)
    fns, cfgs = {}, {}
    for name in dispatchers:
        c = cfgs[name] = cfg.replace(dispatcher=name)
        spec = dsp.DISPATCHERS[dsp.resolve_dispatcher(name)]
        m = split_expert_axis(mesh) if spec.split_nodes else mesh
        ctx = dsp.make_context(c, m, args.tokens, x.dtype)
        for stage in ("dispatch", "gmm", "round"):
            f = _stage_fn(spec, ctx, m, stage)
            fns[f"{name}/{stage}"] = functools.partial(f, x, w, ids, ex)

        def path(x, w, ex, c=c):
            r = routing._replace(weights_TK=w)
            return dsp.expert_parallel_experts(x, r, ex, c, mesh)[0]
        fwd = jax.jit(path)
        fwd_bwd = jax.jit(lambda x, w, ex, path=path: jax.vjp(path, x, w, ex)[1](dy))
        fns[f"{name}/forward"] = functools.partial(fwd, x, w, ex)
        fns[f"{name}/fwd+bwd"] = functools.partial(fwd_bwd, x, w, ex)
    stats = machine.time_interleaved(fns, repeats=args.repeats)
    records = []
    for name in dispatchers:
        med = {s: stats[f"{name}/{s}"]["median_ms"]
               for s in ("dispatch", "gmm", "round", "forward", "fwd+bwd")}
        aux = jax.jit(lambda x, c=cfgs[name]: dsp.expert_parallel_experts(
            x, routing, ex, c, mesh)[2])(x)
        aux = {k: float(v) for k, v in aux.items()}
        spec = dsp.DISPATCHERS[dsp.resolve_dispatcher(name)]
        m = split_expert_axis(mesh) if spec.split_nodes else mesh
        ctx = dsp.make_context(cfgs[name], m, args.tokens, x.dtype)
        rec = {"bench": "dispatch", "dispatcher": name, "tokens": args.tokens,
               "d_model": args.d_model, "d_ff": args.d_ff, "experts": args.experts,
               "top_k": args.top_k, "ep": int(mesh.mesh.shape["expert"]),
               "buffer_factor": args.buffer_factor, "row_chunk": ctx.budget.row_chunk,
               "entry_chunk": ctx.budget.entry_chunk,
               "dispatch_ms": med["dispatch"], "gmm_ms": med["gmm"] - med["dispatch"],
               "combine_ms": med["round"] - med["gmm"], "forward_ms": med["forward"],
               "fwd_bwd_ms": med["fwd+bwd"], "timings": {s: stats[f"{name}/{s}"] for s in med},
               "row_bytes": ctx.row_bytes, "bytes_real": aux["rows_sent"] * ctx.row_bytes,
               "bytes_padding": aux["padding_rows"] * ctx.row_bytes,
               "dedup_saving_rows": 1.0 - aux["rows_sent"] / aux["rows_routed"], **aux}
        records.append(rec)
    base = next((r for r in records if r["dispatcher"] == "allgather"), None)
    for r in records:
        if base:
            r["fwd_bwd_vs_allgather"] = r["fwd_bwd_ms"] / base["fwd_bwd_ms"]
            r["forward_vs_allgather"] = r["forward_ms"] / base["forward_ms"]
    return records


def _v3_routing_sample(tokens: int, seed: int = 0) -> np.ndarray:
    """[T, K] expert ids from DeepSeek-V3's router rule on random activations and weights."""
    import jax
    import jax.numpy as jnp

    from dropless.config import MoEConfig
    from dropless.moe import router

    p = PROJECTION
    cfg = MoEConfig(num_experts=p["num_experts"], top_k=p["top_k"], d_model=p["d_model"],
                    d_ff=2048, n_groups=p["n_groups"], topk_groups=p["topk_groups"],
                    score_func="sigmoid", routed_scaling_factor=2.5)
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (tokens, p["d_model"]), jnp.float32)
    w = jax.random.normal(kw, (p["d_model"], p["num_experts"])) / math.sqrt(p["d_model"])
    return np.asarray(router.route(router.router_logits(x, w), jnp.zeros(p["num_experts"]),
                                   cfg).ids_TK)


def measured_v3_rows(tokens: int, seed: int = 0) -> dict:
    """The projection's routing sample through the real dispatchers on EP=64 host devices.

    Runs `node_a2a` (forward) on a 64-device mesh, 8 devices a node, with the sample's tokens
    placed as the projection places them (token t on rank t % 64), and reads the rows the
    implementation counts: inter- and intra-node rows of node dedup, and the device-dedup and
    no-dedup rows of the same routing. D is tiny (row counts do not depend on it); bytes use
    V3's 7168 bf16 values. Needs 64 devices (`--host-devices 64` in a fresh process).
    """
    import jax
    import jax.numpy as jnp

    from dropless.config import MoEConfig
    from dropless.config import MeshConfig
    from dropless.moe import layer
    from dropless.moe.dispatch import expert_parallel_experts
    from dropless.moe.router import Routing
    from dropless.parallel import NodeMesh, make_mesh, shard_params

    p = PROJECTION
    ep, t_local = p["ep"], tokens // p["ep"]
    if jax.device_count() < ep or tokens % ep:
        raise ValueError(f"measured_v3_rows needs {ep} devices (have {jax.device_count()}) and "
                         f"tokens divisible by {ep} (got {tokens})")
    ids = _v3_routing_sample(tokens, seed)
    # implementation: position i lives on rank i // t_local; the projection: token t on t % 64
    order = np.arange(tokens).reshape(t_local, ep).T.reshape(-1)
    ids_TK = jnp.asarray(ids[order], jnp.int32)
    cfg = MoEConfig(num_experts=p["num_experts"], top_k=p["top_k"], d_model=8, d_ff=8,
                    dispatcher="node_a2a", ragged_buffer_factor=2.0, gmm_backend="ragged_dot")
    mesh = NodeMesh(make_mesh(MeshConfig(data=jax.device_count() // ep, expert=ep)),
                    devices_per_node=p["devices_per_node"])
    if mesh.mesh.size != ep:
        raise ValueError(f"measured_v3_rows wants exactly {ep} devices; got {mesh.mesh.size}")
    experts = shard_params(layer.init_params(jax.random.key(0), cfg), mesh)["experts"]
    w_TK = jnp.full(ids_TK.shape, 1.0 / p["top_k"], jnp.float32)
    routing = Routing(w_TK, ids_TK, None, None)
    x = jnp.ones((tokens, cfg.d_model), jnp.float32)
    aux = jax.jit(lambda x, w: expert_parallel_experts(
        x, routing._replace(weights_TK=w), experts, cfg, mesh)[2])(x, w_TK)
    aux = {k: float(v) for k, v in aux.items()}
    row = p["d_model"] * p["bytes_per_value"]
    out = {"bench": "dispatch_projection_measured", "model": "deepseek-v3",
           "tokens_sampled": tokens, "dispatcher": "node_a2a", **p, "bytes_per_row": row,
           "rounds": aux["rounds"], "dropped_rows": aux["dropped_rows"]}
    for name, suffix in (("node_dedup", ""), ("device_dedup", "_device_dedup"),
                         ("no_dedup", "_no_dedup")):
        for where in ("inter", "intra"):
            out[f"{name}_{where}_node_rows_per_token"] = aux[f"rows_{where}_node{suffix}"] / tokens
        out[f"{name}_inter_node_bytes_per_token"] = (
            out[f"{name}_inter_node_rows_per_token"] * row)
    nd = out["no_dedup_inter_node_rows_per_token"]
    for name in ("node_dedup", "device_dedup"):
        out[f"{name}_inter_node_saving"] = 1 - out[f"{name}_inter_node_rows_per_token"] / nd
    return out


def rows_by_routing(args, dispatchers, mesh) -> list[dict]:
    """Deterministic rows per dispatcher and routing (no timing): the dispatchers' aux on
    `mesh` (a NodeMesh: the mesh and its node size)."""
    import jax
    import jax.numpy as jnp

    from dropless.config import MoEConfig
    from dropless.bench.moe import _router_bias
    from dropless.moe import dispatch as dsp
    from dropless.moe import layer, router
    from dropless.parallel import shard_params

    cfg = MoEConfig(num_experts=args.experts, top_k=args.top_k, d_model=args.d_model,
                    d_ff=args.d_ff, ragged_buffer_factor=args.buffer_factor,
                    gmm_backend="ragged_dot")
    params = shard_params(layer.init_params(jax.random.key(0), cfg), mesh)
    x = jax.random.normal(jax.random.key(1), (args.tokens, args.d_model), jnp.float32)
    records = []
    for routing_name in args.routings:
        bias = jnp.asarray(_router_bias(routing_name, args.experts, args.experts))
        routing = router.route(router.router_logits(x, params["router"]["w_DE"]), bias, cfg)
        load = np.bincount(np.asarray(routing.ids_TK).ravel(), minlength=args.experts)
        for name in dispatchers:
            c = cfg.replace(dispatcher=name)
            aux = jax.jit(lambda x, c=c: dsp.expert_parallel_experts(
                x, routing, params["experts"], c, mesh)[2])(x)
            rec = {"bench": "dispatch_rows", "dispatcher": name, "routing": routing_name,
                   "tokens": args.tokens, "experts": args.experts, "top_k": args.top_k,
                   "ep": int(mesh.mesh.shape["expert"]), "devices_per_node": mesh.devices_per_node,
                   "buffer_factor": args.buffer_factor,
                   "max_over_mean_load": float(load.max() / load.mean()),
                   **{k: float(v) for k, v in aux.items()}}
            records.append(rec)
    return records


def deepseek_v3_projection(tokens: int, seed: int = 0) -> dict:
    """Bytes per token leaving each device with and without dedup, from a routing sample.

    The sample is DeepSeek-V3's router rule (sigmoid scores, 8 groups, best 4 groups, top-8 of
    256) on random activations and router weights. Experts go to EP=64 ranks in order (4 per
    rank), ranks to nodes of 8 (32 experts = one routing group per node); token t lives on rank
    t % 64. Counts (token, destination) rows: no dedup (one per choice), per-device dedup (our
    a2a), and per-node dedup (what node-level forwarding such as DeepEP's achieves).
    """
    p = PROJECTION
    ids = _v3_routing_sample(tokens, seed)
    per_rank = p["num_experts"] // p["ep"]
    dev = ids // per_rank                                 # [T, K] destination rank
    node = dev // p["devices_per_node"]
    src_dev = (np.arange(tokens) % p["ep"])[:, None]
    src_node = src_dev // p["devices_per_node"]
    row = p["d_model"] * p["bytes_per_value"]
    out = {"bench": "dispatch_projection", "model": "deepseek-v3", "tokens_sampled": tokens,
           **p, "bytes_per_row": row}
    for name, keys in (("no_dedup", np.stack([dev, np.arange(p["top_k"])[None].repeat(
            tokens, 0)], -1)), ("device_dedup", dev[..., None]), ("node_dedup", None)):
        inter = intra = 0
        for t in range(tokens):
            if name == "node_dedup":
                nodes = set(node[t]) - {src_node[t, 0]}
                inter += len(nodes)
                intra += len(set(dev[t][node[t] == src_node[t, 0]]) - {src_dev[t, 0]})
                continue
            dests = {tuple(k) for k in keys[t]}
            for d in dests:
                if d[0] == src_dev[t, 0]:
                    continue
                if d[0] // p["devices_per_node"] == src_node[t, 0]:
                    intra += 1
                else:
                    inter += 1
        out[f"{name}_inter_node_rows_per_token"] = inter / tokens
        out[f"{name}_intra_node_rows_per_token"] = intra / tokens
        out[f"{name}_inter_node_bytes_per_token"] = inter / tokens * row
    out["nodes_per_token"] = float(np.mean([len(set(n)) for n in node]))
    out["devices_per_token"] = float(np.mean([len(set(d)) for d in dev]))
    nd = out["no_dedup_inter_node_rows_per_token"]
    out["device_dedup_inter_node_saving"] = 1 - out["device_dedup_inter_node_rows_per_token"] / nd
    out["node_dedup_inter_node_saving"] = 1 - out["node_dedup_inter_node_rows_per_token"] / nd
    return out


# ---- bytes on the wire, BF16 rows vs MXFP8 rows (MoEConfig.dispatch_quantization) ----------

COLLECTIVES = ("all-to-all", "ragged-all-to-all", "all-gather", "reduce-scatter", "all-reduce",
               "collective-permute")
ELEM_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e8m0fnu": 1,
              "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
              "f64": 8, "s64": 8, "u64": 8}
_DEF = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]")


def _arrays(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
    """(element type, dims) of each array in an HLO type: `f32[8,64]{1,0}` or a tuple."""
    return [(e, tuple(int(d) for d in dims.split(",") if d))
            for e, dims in _ARRAY.findall(type_text)]


def collectives(hlo: str) -> list[tuple[str, list[tuple[str, tuple[int, ...]]]]]:
    """(op, [(element type, dims) of each send operand]) of every collective in an HLO module's
    text (compiled, or lowered to HLO). ragged-all-to-all lists its input only (not the output
    buffer it also takes), `*-start` ops appear once (as the op) and `*-done` not at all."""
    types: dict[str, str] = {}
    out = []
    for line in hlo.splitlines():
        m = _DEF.match(line)
        if not m:
            continue
        name, type_text, op, rest = m.groups()
        types[name] = type_text
        base = op[:-len("-start")] if op.endswith("-start") else op
        if base not in COLLECTIVES:
            continue
        operands = [a.split()[-1].lstrip("%") for a in rest.split(")", 1)[0].split(",")
                    if a.strip()]
        if base == "ragged-all-to-all":
            operands = operands[:1]
        out.append((base, [arr for a in operands for arr in _arrays(types.get(a, ""))]))
    return out


def collective_bytes(hlo: str, row_widths: tuple[int, ...] = ()) -> dict:
    """Bytes that one device's collectives take as their send operands (`collectives`):
    {"by_type": {elem: bytes}, "rows": bytes of operands whose last dim is one of `row_widths`
    (rows of D values, or of ceil(D/32) scales), "rows_by_type", "total"}."""
    by_type: dict[str, int] = {}
    rows_by_type: dict[str, int] = {}
    for _, arrays in collectives(hlo):
        for elem, dims in arrays:
            b = math.prod(dims) * ELEM_BYTES[elem]
            by_type[elem] = by_type.get(elem, 0) + b
            if len(dims) >= 2 and dims[-1] in row_widths:
                rows_by_type[elem] = rows_by_type.get(elem, 0) + b
    return {"by_type": by_type, "rows": sum(rows_by_type.values()),
            "rows_by_type": rows_by_type, "total": sum(by_type.values())}


def _dispatch_hlo(cfg, mesh, tokens: int, dtype, platform: str) -> str:
    """HLO text of round 0's dispatch alone (dispatcher cfg.dispatcher on `mesh`, a NodeMesh):
    compiled when `platform` is this host's, else lowered for it (ragged_a2a on a CPU host)."""
    import jax
    import jax.numpy as jnp

    from dropless.moe import dispatch as dsp
    from dropless.moe import layer, router
    from dropless.moe.dispatch.context import split_expert_axis
    from dropless.parallel import shard_params

    spec = dsp.DISPATCHERS[cfg.dispatcher]
    m = split_expert_axis(mesh) if spec.split_nodes else mesh
    ctx = dsp.make_context(cfg, m, tokens, dtype)
    params = shard_params(layer.init_params(jax.random.key(0), cfg), mesh)
    x = jax.random.normal(jax.random.key(1), (tokens, cfg.d_model), jnp.float32).astype(dtype)
    routing = router.route(router.router_logits(x, params["router"]["w_DE"]),
                           params["router"]["bias_E"], cfg)
    fn = _stage_fn(spec, ctx, m, "dispatch")
    traced = fn.trace(x, routing.weights_TK, routing.ids_TK, params["experts"])
    if platform == jax.default_backend():
        return traced.lower().compile().as_text()
    return traced.lower(lowering_platforms=(platform,)).as_text(dialect="hlo")


def wire_bytes(args, mesh) -> list[dict]:
    """Per dispatcher, one device's dispatch bytes with BF16 rows and with MXFP8 rows, from the
    collectives of its HLO (`collective_bytes`): lowered for CUDA (every dispatcher; what a GPU
    build starts from) and compiled for this host's CPU (not ragged_a2a, which XLA:CPU cannot
    compile; XLA:CPU widens bf16 and float8 collectives to f32/f16, uint8 it moves as is); and
    from the dispatcher's own row accounting (rows sent, + padding, x the row bytes)."""
    import jax
    import jax.numpy as jnp

    from dropless.config import MoEConfig
    from dropless.moe import dispatch as dsp
    from dropless.moe.dispatch.context import dispatch_row_bytes

    base = MoEConfig(num_experts=args.experts, top_k=args.top_k, d_model=args.d_model,
                     d_ff=args.d_ff, ragged_buffer_factor=args.buffer_factor,
                     gmm_backend="ragged_dot", gmm_quantization="mxfp8", dtype="bfloat16",
                     weight_dtype="bfloat16")
    widths = (args.d_model, -(-args.d_model // 32))
    records = []
    for name in args.dispatchers:
        on_cpu = "cpu" not in dsp.DISPATCHERS[name].unsupported_on
        rec = {"bench": "dispatch_wire_bytes", "dispatcher": name, "tokens": args.tokens,
               "d_model": args.d_model, "experts": args.experts, "top_k": args.top_k,
               "ep": int(mesh.mesh.shape["expert"]), "devices_per_node": mesh.devices_per_node,
               "buffer_factor": args.buffer_factor, "activation_dtype": "bfloat16",
               "per": "one device, round 0's dispatch"}
        for q in ("none", "mxfp8"):
            cfg = base.replace(dispatcher=name, dispatch_quantization=q)
            rec[f"{q}_row_bytes"] = dispatch_row_bytes(cfg, jnp.bfloat16)
            for where in ("cuda", "cpu") if on_cpu else ("cuda",):
                hlo = _dispatch_hlo(cfg, mesh, args.tokens, jnp.bfloat16, where)
                by = collective_bytes(hlo, widths)
                rec[f"{q}_{where}_hlo"] = by
        for where in ("cuda", "cpu") if on_cpu else ("cuda",):
            rec[f"{where}_hlo_row_ratio"] = (rec[f"mxfp8_{where}_hlo"]["rows"]
                                             / rec[f"none_{where}_hlo"]["rows"])
            rec[f"{where}_hlo_total_ratio"] = (rec[f"mxfp8_{where}_hlo"]["total"]
                                               / rec[f"none_{where}_hlo"]["total"])
        if on_cpu:   # the dispatcher's own accounting: rows sent (+ padding) per device
            aux = jax.jit(lambda x, c=base.replace(dispatcher=name): _layer_aux(c, x, mesh))(
                _tokens(args))
            n = mesh.mesh.size
            for q in ("none", "mxfp8"):
                rb = rec[f"{q}_row_bytes"]
                rec[f"{q}_counted_bytes_real"] = float(aux["rows_sent"]) / n * rb
                rec[f"{q}_counted_bytes_padded"] = (float(aux["rows_sent"])
                                                    + float(aux["padding_rows"])) / n * rb
        rec["counted_ratio"] = rec["mxfp8_row_bytes"] / rec["none_row_bytes"]
        for q in ("none", "mxfp8"):
            rec[f"{q}_cuda_hlo_row_bytes"] = rec[f"{q}_cuda_hlo"]["rows"]
        records.append(rec)
    return records


def _tokens(args):
    import jax
    import jax.numpy as jnp
    return jax.random.normal(jax.random.key(1), (args.tokens, args.d_model),
                             jnp.float32).astype(jnp.bfloat16)


def _layer_aux(cfg, x, mesh) -> dict:
    """The EP layer's traffic stats (rows sent, padding) for x on `mesh`."""
    import jax

    from dropless.moe import layer
    from dropless.parallel import shard_params
    params = shard_params(layer.init_params(jax.random.key(0), cfg), mesh)
    return layer.apply(params, x, cfg, mesh=mesh)[1]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DispatchOptions:
    """What `dropless bench dispatch` runs: T, D, F, E, K, the expert-parallel ranks P, the host
    devices to create on CPU (before JAX starts its backend), devices per node (intra/inter-node
    accounting), ragged_buffer_factor, the dispatchers (allgather is the baseline); `rows_only`
    (no timing: deterministic rows per dispatcher for each of `routings`, router biases uniform
    and/or zipf), `wire_bytes` (no timing: each dispatcher's dispatch bytes with BF16 and with
    MXFP8 rows, from its HLO and its own row accounting), `projection_only` (only the DeepSeek-V3 projection, measured through node_a2a
    too on 64 devices), timed runs per function, the tokens of the V3 routing sample (0: no
    projection), `quick` (the smoke-run sizes, `quick_sized`) and the JSON-lines file appended
    to (None: none)."""
    tokens: int = 4096
    d_model: int = 256
    d_ff: int = 256
    experts: int = 64
    top_k: int = 8
    ep: int = 8
    host_devices: int = 8
    devices_per_node: int = 4
    buffer_factor: float = 2.0
    dispatchers: tuple[str, ...] = ("allgather", "a2a", "node_a2a")
    rows_only: bool = False
    routings: tuple[str, ...] = ("uniform", "zipf")
    projection_only: bool = False
    wire_bytes: bool = False
    repeats: int = 5
    projection_tokens: int = 4096
    quick: bool = False
    out: str | None = None

    def quick_sized(self) -> "DispatchOptions":
        """The smoke run: 1024 tokens, D=F=128, 3 repeats, a projection of at most 1024 tokens."""
        return dataclasses.replace(self, tokens=1024, d_model=128, d_ff=128, repeats=3,
                                   projection_tokens=min(self.projection_tokens, 1024))


def run(args: DispatchOptions) -> int:
    """Time the dispatchers of `args` (or count their rows, or only project DeepSeek-V3),
    printing tables and appending the records to `args.out`. Returns 0; raises ValueError
    when `args.ep` does not divide the devices JAX has."""
    ask_host_devices(args.host_devices)
    import jax

    from dropless import machine, text_table
    from dropless.bench import harness
    from dropless.config import MeshConfig
    from dropless.parallel import NodeMesh, make_mesh

    n = jax.device_count()
    if n % args.ep:
        raise ValueError(f"--ep={args.ep} does not divide the {n} devices (on CPU, start a "
                         f"fresh process with --host-devices or XLA_FLAGS)")
    args, info, busy = harness.start(args, devices=n)
    if args.projection_only:
        return _projection_only(args, info)
    mesh = NodeMesh(make_mesh(MeshConfig(data=n // args.ep, expert=args.ep)),
                    devices_per_node=args.devices_per_node)
    if args.wire_bytes:
        records = wire_bytes(args, mesh)
        for r in records:
            r.update(machine=info)
        print(text_table.format_table(records, [
            "dispatcher", "none_cuda_hlo_row_bytes", "mxfp8_cuda_hlo_row_bytes",
            "cuda_hlo_row_ratio", "cuda_hlo_total_ratio", "cpu_hlo_row_ratio",
            "none_counted_bytes_padded", "mxfp8_counted_bytes_padded", "counted_ratio"]))
        harness.write_jsonl(args.out, records)
        return 0
    if args.rows_only:
        records = rows_by_routing(args, list(args.dispatchers), mesh)
        for r in records:
            r.update(machine=info)
        print(text_table.format_table(records, [
            "routing", "dispatcher", "devices_per_node", "rows_routed", "rows_sent",
            "rows_inter_node", "rows_intra_node", "rows_inter_node_device_dedup",
            "rows_inter_node_no_dedup", "padding_rows", "rounds", "dropped_rows"]))
        harness.write_jsonl(args.out, records)
        return 0
    records = _case(args, list(args.dispatchers), mesh)
    after = machine.busy_fraction(0.2)
    for r in records:
        r.update(machine=info, busy_before=busy, busy_after=after)
    print(text_table.format_table(records, [
        "dispatcher", "dispatch_ms", "gmm_ms", "combine_ms", "forward_ms", "fwd_bwd_ms",
        "fwd_bwd_vs_allgather", "rows_sent", "padding_rows", "rows_routed",
        "dedup_saving_rows", "rounds", "rows_inter_node", "rows_intra_node",
        "rows_inter_node_device_dedup"]), flush=True)
    if args.projection_tokens > 0:
        proj = deepseek_v3_projection(args.projection_tokens)
        proj.update(machine=info)
        records.append(proj)
        print(text_table.format_table([proj], [
            "tokens_sampled", "devices_per_token", "nodes_per_token",
            "no_dedup_inter_node_rows_per_token", "device_dedup_inter_node_rows_per_token",
            "node_dedup_inter_node_rows_per_token", "device_dedup_inter_node_saving",
            "node_dedup_inter_node_saving"]))
    harness.write_jsonl(args.out, records)
    return 0


def _projection_only(args: DispatchOptions, info: dict) -> int:
    import jax

    from dropless import text_table
    from dropless.bench import harness

    proj = deepseek_v3_projection(args.projection_tokens)
    records = [proj]
    cols = ["tokens_sampled", "no_dedup_inter_node_rows_per_token",
            "device_dedup_inter_node_rows_per_token", "node_dedup_inter_node_rows_per_token",
            "device_dedup_inter_node_saving", "node_dedup_inter_node_saving"]
    if jax.device_count() >= PROJECTION["ep"]:
        records.append(measured_v3_rows(args.projection_tokens))
    else:
        print(f"# measured rows need {PROJECTION['ep']} devices (--host-devices "
              f"{PROJECTION['ep']} in a fresh process); projection only")
    for r in records:
        r.update(machine=info)
    print(text_table.format_table(records, ["bench"] + cols))
    harness.write_jsonl(args.out, records)
    return 0
