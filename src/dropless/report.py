"""A run's metrics, read and drawn (`dropless report`'s library): RUN_DIR/metrics.jsonl read
back (`read_metrics`), summarised (`summary`), and drawn to PNG files in RUN_DIR (`draw`: loss
train and eval, throughput tokens/s and MFU, an expert-load heatmap; matplotlib, an optional
dependency: pip install 'dropless[report]'; `make run` and `make test` install it)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dropless import json_out


# what `summary` and `draw` read from each record, by event: field -> whether it may be absent
# or null (numbers are ints or floats, NaN and infinities included; `step` is an int)
FIELDS = {"step": {"step": False, "loss": False, "dropped_tokens": False, "step_time_s": True,
                   "tokens_per_s": True, "padded_tokens_per_s": True,
                   "tflops_per_device": True, "mfu": True,
                   "expert_load_max_over_mean": True, "mtp_expert_load_max_over_mean": True},
          "eval": {"step": False, "eval_loss": False}}
# a step record's expert-load tables, [layers][experts]: the decoder's MoE layers, and the MTP
# blocks' own (one row a block) -> the label of a row in the heatmap
LOAD_TABLES = {"tokens_per_expert": "MoE layer", "mtp_tokens_per_expert": "MTP block"}


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_record(path: Path, n: int, rec: dict) -> None:
    """Raise ValueError naming the file, the line and the field unless record `rec` (line `n`)
    holds what `FIELDS` says its event needs, and a `tokens_per_expert` is a [layers][experts]
    table of numbers."""
    where = f"{path} line {n}: a {rec.get('event')!r} record"
    for key, optional in FIELDS.get(rec.get("event"), {}).items():
        value = rec.get(key)
        if value is None and optional:
            continue
        if key not in rec:
            raise ValueError(f"{where} has no {key!r} (not a record dropless wrote; remove the "
                             "line or restore the file)")
        ok = isinstance(value, int) and not isinstance(value, bool) if key == "step" \
            else _is_number(value)
        if not ok:
            raise ValueError(f"{where} has {key}={str(value)[:60]!r}, not "
                             f"{'an int' if key == 'step' else 'a number'} (remove the line or "
                             "restore the file)")
    for key in LOAD_TABLES:
        load = rec.get(key)
        if rec.get("event") == "step" and load is not None and not (
                isinstance(load, list) and load and all(isinstance(r, list) and r and
                                                        len(r) == len(load[0]) and
                                                        all(map(_is_number, r)) for r in load)):
            raise ValueError(f"{where} has a {key} that is not a table of numbers "
                             "[layers][experts] (remove the line or restore the file)")


def _records(path: Path, skipped: list[str]):
    """(line number, record) of every complete JSON object line of `path`; a torn line (a
    process killed mid-write, or a resume that appended onto it) is skipped and named in
    `skipped` with its line number in the file (1-based, blank lines counted)."""
    for n, raw in enumerate(path.read_bytes().split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            rec = json_out.restore(json.loads(raw))
        except (ValueError, UnicodeDecodeError):
            rec = None
        if not isinstance(rec, dict):
            skipped.append(f"{path} line {n} is not a complete JSON record (torn by an "
                           f"interrupted write?): {raw[:60].decode(errors='replace')!r}")
            continue
        yield n, rec


def read_metrics(run_dir: str | Path, skipped: list[str] | None = None
                 ) -> dict[str, list[dict]]:
    """metrics.jsonl grouped by event ("start", "step", "eval", "end"), as the run's checkpoints
    have it: a "start" record resuming from step S (`resumed_from`) drops the step, eval and
    end records of steps after S written before it (an earlier session's steps that no
    checkpoint kept, which this session trains again or never reaches; TensorBoard drops them
    too, train/tensorboard.py), so each step is the last session's. Lines that are not
    complete records are skipped, each named (with its line number) in `skipped`. Raises
    ValueError when the file is missing, and naming the line and field for a record without
    what the report reads (`check_record`) or whose expert-load table changes shape."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"run_dir={str(run_dir)!r} has no metrics.jsonl{_runs_inside(run_dir)}")
    out: dict[str, list[dict]] = {"start": [], "step": [], "eval": [], "end": []}
    steps: dict[int, dict] = {}
    evals: dict[int, dict] = {}
    shapes: dict[str, tuple] = {}   # load table -> ((layers, experts), first line)
    for n, rec in _records(path, [] if skipped is None else skipped):
        check_record(path, n, rec)
        ev = rec.get("event")
        for key in LOAD_TABLES:
            if ev != "step" or rec.get(key) is None:
                continue
            here, shape = (len(rec[key]), len(rec[key][0])), shapes.get(key)
            if shape is not None and here != shape[0]:
                raise ValueError(f"{path} line {n}: {key} is {here[0]} x {here[1]} "
                                 f"(layers x experts), line {shape[1]}'s {shape[0][0]} x "
                                 f"{shape[0][1]}: two runs in one file? (remove the lines of "
                                 "the other)")
            shapes.setdefault(key, (here, n))
        if ev == "start" and _is_int(rec.get("resumed_from")):
            _drop_after(rec["resumed_from"], steps, evals, out)
        if ev == "step":
            steps[rec["step"]] = rec
        elif ev == "eval":
            evals[rec["step"]] = rec
        elif ev in out:
            out[ev].append(rec)
    out["step"] = [steps[k] for k in sorted(steps)]
    out["eval"] = [evals[k] for k in sorted(evals)]
    return out


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _drop_after(start: int, steps: dict, evals: dict, out: dict) -> None:
    """Forget the step and eval records of steps after `start`, and the end records past it."""
    for table in (steps, evals):
        for k in [k for k in table if k > start]:
            del table[k]
    out["end"] = [r for r in out["end"] if not (_is_int(r.get("step")) and r["step"] > start)]


def _warm_steps(m: dict[str, list[dict]], skip: int) -> set[int]:
    """The first `skip` steps of every session (the steps after each "start" record's
    `resumed_from`; the first `skip` step records where no start record says)."""
    firsts = [f for f in (r.get("resumed_from") for r in m.get("start", [])) if _is_int(f)]
    if not firsts:
        return {r["step"] for r in m["step"][:skip]}
    return {f + i for f in firsts for i in range(1, skip + 1)}


def summary(m: dict[str, list[dict]], skip: int = 2) -> dict:
    """Median step time, tokens/s (real tokens; and every computed position, padding too,
    where the records hold it), TFLOPS/device, MFU and the time a step waited for its batch
    (input_wait_s; the first `skip` steps of each session left out), first and last loss,
    worst expert load, total dropped tokens."""
    steps = m["step"]
    if not steps:
        return {}
    warm = _warm_steps(m, skip)
    body = [r for r in steps if r["step"] not in warm] or steps

    def med(k: str) -> float | None:   # None where no record holds `k`
        vals = [r[k] for r in body if r.get(k) is not None]
        return float(np.median(vals)) if vals else None
    return {"steps": len(steps), "first_loss": steps[0]["loss"], "last_loss": steps[-1]["loss"],
            "last_eval_loss": m["eval"][-1]["eval_loss"] if m["eval"] else None,
            "median_step_time_s": med("step_time_s"), "median_tokens_per_s": med("tokens_per_s"),
            "median_padded_tokens_per_s": med("padded_tokens_per_s"),
            "median_tflops_per_device": med("tflops_per_device"),
            "median_input_wait_s": med("input_wait_s") if any(
                "input_wait_s" in r for r in body) else None,
            "median_mfu": med("mfu") if any(r.get("mfu") for r in body) else None,
            "max_expert_load_max_over_mean": _worst(steps, "expert_load_max_over_mean"),
            "max_mtp_expert_load_max_over_mean": _worst(steps, "mtp_expert_load_max_over_mean"),
            "dropped_tokens": sum(r["dropped_tokens"] for r in steps)}


def _runs_inside(folder: str | Path) -> str:
    """Where `folder` holds runs (a `run_dir=` parent, runs/): words naming the newest, to be
    named instead; else nothing."""
    try:
        runs = sorted((d for d in Path(folder).iterdir() if (d / "metrics.jsonl").is_file()),
                      key=lambda d: (d / "metrics.jsonl").stat().st_mtime_ns)
    except OSError:
        return ""
    if not runs:
        return ""
    return (f"; it holds {len(runs)} run{'s' * (len(runs) > 1)}: name one, e.g. the newest, "
            f"{str(runs[-1])!r}")


def _worst(steps: list[dict], key: str) -> float | None:
    """The largest `key` over the step records; None where none holds one (no MoE layer in the
    decoder, no MTP block that routes)."""
    return max((r[key] for r in steps if r.get(key) is not None), default=None)


def draw(run_dir: str | Path) -> list[Path]:
    """Write loss.png, throughput.png and expert_load.png into run_dir; returns their paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    run_dir = Path(run_dir)
    m = read_metrics(run_dir)
    steps = m["step"]
    x = [r["step"] for r in steps]
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(x, [r["loss"] for r in steps], label="train loss")
    if m["eval"]:
        ax.plot([r["step"] for r in m["eval"]], [r["eval_loss"] for r in m["eval"]], "o-",
                label="eval loss")
    vocab = _vocab_size(run_dir)
    if vocab:                                   # the loss of a uniform guess
        ax.axhline(np.log(vocab), ls=":", c="gray", label=f"ln {vocab:,} (uniform guess)")
    ax.set_xlabel("step"), ax.set_ylabel("nats/token"), ax.legend(), ax.grid(alpha=.3)
    paths.append(_save(fig, run_dir / "loss.png"))

    paths.append(_save(_throughput_figure(plt, steps), run_dir / "throughput.png"))

    panels = _load_panels(steps)
    if panels:
        fig, axes = plt.subplots(len(panels), 1, figsize=(7, 1.8 * len(panels) + .6),
                                 squeeze=False)
        for (label, sx, rel_SE), a in zip(panels, axes[:, 0]):
            right = sx[-1] if sx[-1] > sx[0] else sx[0] + 1   # one step: a column of width 1
            im = a.imshow(rel_SE.T, aspect="auto", cmap="viridis",
                          extent=(sx[0], right, rel_SE.shape[1] - .5, -.5))
            a.set_ylabel(f"{label}\nexpert")
            fig.colorbar(im, ax=a, label="load / mean")
        axes[-1, 0].set_xlabel("step")
        paths.append(_save(fig, run_dir / "expert_load.png"))
    return paths


def _load_panels(steps: list[dict]) -> list[tuple[str, list[int], np.ndarray]]:
    """One heatmap panel a row of each load table (`LOAD_TABLES`): (label, the steps that hold
    the table, load / mean load [steps, experts])."""
    panels = []
    for key, label in LOAD_TABLES.items():
        held = [r for r in steps if r.get(key) is not None]
        if not held:
            continue
        arr = np.stack([np.asarray(r[key], float) for r in held])   # [steps, layers, experts]
        rel = arr / np.maximum(arr.mean(-1, keepdims=True), 1e-9)
        panels += [(f"{label} {li}", [r["step"] for r in held], rel[:, li])
                   for li in range(arr.shape[1])]
    return panels


def _vocab_size(run_dir: Path) -> int | None:
    """The run's model.vocab_size (its config.json), None when that cannot be read."""
    try:
        v = json.loads((run_dir / "config.json").read_text())["model"]["vocab_size"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 1 else None


def _throughput_figure(plt, steps: list[dict]):
    """tokens/s and MFU on two stacked axes sharing the step axis (one y scale each, so neither
    curve is drawn over the other), each with its median and a legend; where padding was
    computed (a step's padded_tokens_per_s above its tokens_per_s), that rate too, dashed."""
    x = [r["step"] for r in steps]
    has_mfu = any(r.get("mfu") is not None for r in steps)
    fig, axes = plt.subplots(2 if has_mfu else 1, 1, figsize=(7, 6 if has_mfu else 3.4),
                             sharex=True, squeeze=False)
    series = [("tokens_per_s", 1.0, "tokens/s", "C0", "{:,.0f}")]
    if has_mfu:
        series.append(("mfu", 100.0, "MFU %", "C1", "{:.1f}"))
    for ax, (key, scale, label, color, fmt) in zip(axes[:, 0], series):
        pts = [(s, scale * r[key]) for s, r in zip(x, steps) if r.get(key) is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], color=color, label=label)
        if pts:
            med = float(np.median([p[1] for p in pts]))
            ax.axhline(med, ls=":", c="gray", label="median " + fmt.format(med))
        padded = [(s, r["padded_tokens_per_s"]) for s, r in zip(x, steps)
                  if r.get("padded_tokens_per_s") is not None]
        real = dict(pts)
        if key == "tokens_per_s" and any(v > real.get(s, v) for s, v in padded):
            ax.plot([p[0] for p in padded], [p[1] for p in padded], "--", color=color,
                    alpha=.5, label="with padding")
        # above the axes, never over the curve
        ax.legend(loc="lower left", bbox_to_anchor=(0, 1), ncol=2, frameon=False)
        ax.set_ylabel(label), ax.grid(alpha=.3)
    axes[-1, 0].set_xlabel("step")
    return fig


def _save(fig, path: Path) -> Path:
    from dropless.runtime import files
    fig.tight_layout()
    import matplotlib.pyplot as plt
    try:
        with files.replacing(path) as tmp:      # a full disk keeps the old plot
            fig.savefig(tmp, dpi=110, format=Path(path).suffix.lstrip(".") or "png")
    except OSError as e:                        # named by the plot, not its temporary file
        raise OSError(e.errno, e.strerror or str(e), str(path)) from None
    finally:
        plt.close(fig)
    return path
