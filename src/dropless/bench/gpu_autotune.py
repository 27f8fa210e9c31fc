"""The autotune section of `dropless bench gpu`: a restricted tokamax autotune, saved for the
package.

Legend: M routed rows, K contraction dim, N output dim, G groups (experts).

For each planned shape (gpu_plan.AUTOTUNE_SHAPES, most informative first) the grouped matmul's
forward+backward through the `tokamax` backend is lowered, and every tokamax op in it (the
forward, and the products its VJP runs) is found with `tokamax.autotuning.get_bound_args`. Each
op is timed at a handful of configs (`pick_configs`: tokamax's heuristic one, the config it runs
untuned, and others spread evenly over its own sm90 search space) by `BoundArguments.autotune`,
and the results join one `tokamax.AutotuningResult` for the device kind. After every shape the
whole result is written again (whole or not at all) as BENCH_DIR/tokamax_<device kind>.json in
tokamax's own dump format (`AutotuningResult.dumps`, failed configs left out), so a section cut
at its cap keeps the shapes it finished; the file is ready for src/dropless/ops/gpu/tuned/.
Where tokamax cannot run here, every unit is a "skipped" record with the reason. The dry run
has no tokamax: it records that, and nothing else.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

from dropless.bench.gpu_common import error, gmm_fn, late, operands


def pick_configs(configs, heuristic, n: int) -> list:
    """`n` configs to time (fewer when there are fewer): `heuristic` first, then configs
    spread evenly over the rest of `configs` in a fixed order (their reprs sorted)."""
    rest = sorted((c for c in configs if c != heuristic), key=repr)
    want = max(n - 1, 0)
    if want >= len(rest):
        picked = rest
    else:
        step = len(rest) / want if want else 0
        picked = [rest[int(i * step)] for i in range(want)]
    return [heuristic, *picked]


def file_name(device_kind: str) -> str:
    """tokamax_<device kind>.json, the kind as tokamax names its data folders ("NVIDIA H200"
    -> tokamax_nvidia_h200.json)."""
    return f"tokamax_{re.sub(r'[^a-z0-9]+', '_', device_kind.lower()).strip('_')}.json"


def _shape(label: str, shapes: Sequence[dict]):
    from dropless.ops.gmm import shapes as gmm_shapes
    from dropless.ops.gmm.shapes import GmmShape
    for d in shapes:
        if d["label"] == label:
            return GmmShape(**d)
    return gmm_shapes.shape(label)


def autotune_section(emit, spec: dict) -> None:
    """The plan's autotune units (one shape each; see the module docstring): one record per
    shape (its ops, configs timed, the fastest config's time per op, the file written)."""
    from dropless.ops.gmm import registry
    for u in spec["autotune_dropped"]:
        emit({"shape": u["shape"], "skipped": u["skipped"]})
    why = registry.unusable("tokamax")
    if why:
        for u in spec["autotune_units"]:
            emit({"shape": u["shape"], "skipped": f"tokamax cannot run here: {why}"})
        return
    result = None
    for u in spec["autotune_units"]:
        why = late(spec, u["seconds"] * spec["est"])
        if why:
            emit({"shape": u["shape"], "skipped": why})
            continue
        try:
            s = _shape(u["shape"], spec["shapes"])
            one, rec = _tune(s, operands(s), spec["autotune_configs"])
            result = one if result is None else result | one
            rec["file"] = _write(result, Path(spec["bench_dir"]))
        except Exception as e:  # noqa: BLE001 (recorded; the next shape runs)
            emit({"shape": u["shape"], "error": error(e)})
            continue
        emit(rec, f"{rec['shape']}: {rec['ops']} tokamax ops, {rec['configs_timed']} configs "
                  f"-> {rec['file']}")


def _tune(s, ops: tuple, n: int):
    """(the AutotuningResult of shape `s`'s tokamax ops, its record)."""
    import jax
    import jax.numpy as jnp
    import tokamax
    from tokamax import autotuning

    from dropless.ops.gmm import shapes as gmm_shapes
    x, w, dy = ops
    gs = jnp.asarray(gmm_shapes.group_sizes("uniform", s.m, s.g), jnp.int32)
    bound = autotuning.get_bound_args(jax.jit(gmm_fn("tokamax", "fwd+bwd")), x, w, gs, dy)
    data, per_op, timed = [], [], 0
    for ba in bound:
        configs = pick_configs(ba.autotuning_configs, ba.heuristics_config, n)
        d = ba.autotune(configs=set(configs), cache_results=False, timeout=60.0)
        data.append((ba, d))
        ok = d.prune_errors()
        timed += len(configs)
        best = min(ok.items(), key=lambda kv: kv[1].median_evaluation_time_ms) if ok else None
        heur = ok.get(ba.heuristics_config)
        per_op.append({"op": str(ba.op)[:120], "configs": len(configs), "failed": len(d) - len(ok),
                       "best_ms": best[1].median_evaluation_time_ms if best else None,
                       "heuristic_ms": heur.median_evaluation_time_ms if heur else None,
                       "best_config": repr(best[0])[:300] if best else None})
    kind = jax.devices()[0].device_kind
    result = tokamax.AutotuningResult(kind, tuple(data))
    rec = {"shape": s.label, "m": s.m, "k": s.k, "n": s.n, "groups": s.g, "device": kind,
           "ops": len(data), "configs_timed": timed, "per_op": per_op}
    return result, rec


def _write(result, out_dir: Path) -> str:
    """Write `result` (tokamax's dump, failed configs left out) whole or not at all; its name."""
    from dropless.runtime import files
    name = file_name(result.device_kind)
    files.write_text(out_dir / name, result.dumps(prune_errors=True))
    return name
