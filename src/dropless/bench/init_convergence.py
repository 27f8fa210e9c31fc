"""`dropless bench init`: which initialisation scheme (ModelConfig.init) trains best, measured.

Each (scheme, seed) is trained with the trainer (`train.loop.train`) on a preset at its
defaults (the built-in corpus, eval every `eval_every` steps), one run directory each
(`RUNS_DIR/PRESET-SCHEME-sSEED`), and one JSON line per run is appended to `--out`: the eval
loss at the end and along the way, the train loss, wall and step times, the machine and how
busy it was, the git commit. Resumable: a run whose line is already in `--out` is skipped, and
a finished run directory (its metrics.jsonl ends at `steps`, its config.json is the config
asked for) is read back instead of trained again, so a bench stopped half way goes on where
it stopped. The printed table has the final eval loss per seed and their mean.
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

from dropless import json_out, text_table
from dropless.config import INIT_SCHEMES
from dropless.config_file import build_config
from dropless.model_dir import from_dict, to_dict

# the config fields a run directory may differ in and still be the run asked for
_WHERE = ("run_dir", "run_name")


@dataclasses.dataclass(frozen=True, kw_only=True)
class InitOptions:
    preset: str = "tiny"
    steps: int = 300
    seeds: tuple[int, ...] = (0, 1)
    schemes: tuple[str, ...] = INIT_SCHEMES
    overrides: tuple[str, ...] = ()       # more KEY=VALUE config items for every run
    runs_dir: str = "init_runs"
    out: str | None = "benchmarks/results/init_convergence.jsonl"
    quick: bool = False

    def quick_sized(self) -> "InitOptions":
        return dataclasses.replace(self, steps=4, seeds=(0,), quick=False,
                                   overrides=self.overrides + ("eval_every=2", "eval_batches=1"))


def run_name(preset: str, scheme: str, seed: int, overrides: tuple[str, ...]) -> str:
    """The run directory's name: PRESET-SCHEME-sSEED, plus the overrides when there are any."""
    extra = "".join("-" + o.replace("=", "_").replace("/", "_") for o in overrides)
    return f"{preset}-{scheme}-s{seed}{extra}"


def run_config(opts: InitOptions, scheme: str, seed: int):
    """The TrainConfig of one (scheme, seed) run (raises ValueError for a bad override)."""
    from dropless.config_file import parse_override
    items = [("preset", opts.preset), ("steps", opts.steps), ("seed", seed),
             ("model.init", scheme), ("run_dir", opts.runs_dir),
             ("run_name", run_name(opts.preset, scheme, seed, opts.overrides)),
             ("checkpoint_every", 0), ("time_kernels", False)]
    items += [parse_override(o) for o in opts.overrides]
    return build_config(items)


def _same_run(cfg, folder: Path) -> bool:
    """Whether `folder`'s config.json is `cfg` (where it lives aside)."""
    try:
        saved = to_dict(from_dict(json.loads((folder / "config.json").read_text())))
    except (OSError, ValueError, TypeError, KeyError):
        return False
    want = to_dict(cfg)
    return all(saved.get(k) == v for k, v in want.items() if k not in _WHERE)


def read_run(folder: Path) -> list[dict] | None:
    """The events of `folder`'s metrics.jsonl from its last start, or None when it has no
    finished run (no "end" event)."""
    path = folder / "metrics.jsonl"
    if not path.is_file():
        return None
    events = [json_out.restore(json.loads(line)) for line in path.read_text().splitlines()
              if line.strip()]
    starts = [i for i, e in enumerate(events) if e.get("event") == "start"]
    if not starts or not any(e.get("event") == "end" for e in events):
        return None
    # a resumed run has several starts; its steps and evals are all kept
    return events


def summarise(events: list[dict], cfg, *, scheme: str, seed: int, folder: Path,
              trained_here: bool, overrides: tuple[str, ...]) -> dict[str, Any]:
    """One JSON line from a finished run's events."""
    start = next(e for e in events if e.get("event") == "start")
    steps = {e["step"]: e for e in events if e.get("event") == "step"}
    evals = {e["step"]: e["eval_loss"] for e in events if e.get("event") == "eval"}
    end = [e for e in events if e.get("event") == "end"][-1]
    last = sorted(steps)[-min(50, len(steps)):]
    times = [steps[s]["step_time_s"] for s in sorted(steps)]
    m = cfg.model
    return {
        "bench": "init_convergence", "preset": cfg.preset, "scheme": scheme, "seed": seed,
        "steps": cfg.steps, "overrides": list(overrides),
        "init": {k: getattr(m, k) for k in ("init", "init_std", "head_init_std",
                                              "embed_init_std", "init_residual_scaling")},
        "eval_loss": evals.get(end["step"]), "eval_losses": {str(k): v for k, v in
                                                             sorted(evals.items())},
        "train_loss": end.get("final_loss"),
        "train_loss_last50_mean": statistics.fmean(steps[s]["loss"] for s in last),
        "first_loss": steps[min(steps)]["loss"] if steps else None,
        "wall_s": sum(times) + sum(e.get("compile_s", 0.0) for e in events
                                   if e.get("event") == "start"),
        "step_time_median_s": statistics.median(times) if times else None,
        "compile_s": start.get("compile_s"), "busy_fraction_at_start": start.get("busy_fraction"),
        "machine": start.get("machine"), "git_commit": (start.get("machine") or {}).get(
            "git_commit"), "run_dir": str(folder), "trained_here": trained_here,
        "params": (start.get("params") or {}).get("total"),
    }


def _key(r: dict) -> tuple:
    return (r["preset"], r["scheme"], r["seed"], r["steps"], tuple(r.get("overrides") or ()))


def done_records(path: str | None) -> dict[tuple, dict]:
    """The lines already in `path`, by (preset, scheme, seed, steps, overrides)."""
    if not path or not Path(path).is_file():
        return {}
    out = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            r = json_out.restore(json.loads(line))
            if r.get("bench") == "init_convergence":
                out[_key(r)] = r
    return out


def one_run(opts: InitOptions, scheme: str, seed: int) -> dict[str, Any]:
    """Train (or read back a finished run of) one (scheme, seed); its JSON line."""
    from dropless.train.loop import train
    cfg = run_config(opts, scheme, seed)
    folder = Path(cfg.run_dir) / cfg.run_name
    events = read_run(folder) if _same_run(cfg, folder) else None
    trained_here = events is None
    if trained_here:
        t0 = time.perf_counter()
        train(cfg, echo=lambda line: None)
        print(f"  trained {folder} in {time.perf_counter() - t0:.0f} s", flush=True)
        events = read_run(folder)
        if events is None:
            raise RuntimeError(f"{folder}: the run ended without an 'end' event")
    return summarise(events, cfg, scheme=scheme, seed=seed, folder=folder,
                     trained_here=trained_here, overrides=opts.overrides)


def table(records: list[dict]) -> str:
    """Final eval loss per scheme: one column per seed, their mean, and the wall time."""
    seeds = sorted({r["seed"] for r in records})
    rows = []
    for scheme in dict.fromkeys(r["scheme"] for r in records):
        rs = {r["seed"]: r for r in records if r["scheme"] == scheme}
        row = {"scheme": scheme}
        for s in seeds:
            row[f"eval_s{s}"] = rs[s]["eval_loss"] if s in rs else None
        got = [r["eval_loss"] for r in rs.values() if r["eval_loss"] is not None]
        row["eval_mean"] = statistics.fmean(got) if got else None
        row["wall_s"] = sum(r["wall_s"] for r in rs.values())
        rows.append(row)
    return text_table.format_table(rows, list(rows[0]) if rows else [])


def run(opts: InitOptions) -> int:
    """Every (scheme, seed) of `opts` not yet in `opts.out`: trained or read back, one line each;
    then the table of every line for this preset and step count."""
    if opts.quick:
        opts = opts.quick_sized()
    for scheme in opts.schemes:
        if scheme not in INIT_SCHEMES:
            raise ValueError(f"--schemes: {scheme!r} is not one of {', '.join(INIT_SCHEMES)}")
    done = done_records(opts.out)
    mine = []
    for scheme in opts.schemes:
        for seed in opts.seeds:
            key = (opts.preset, scheme, seed, opts.steps, tuple(opts.overrides))
            if key in done:
                print(f"  {run_name(opts.preset, scheme, seed, opts.overrides)}: in {opts.out}",
                      flush=True)
                mine.append(done[key])
                continue
            r = one_run(opts, scheme, seed)
            mine.append(r)
            if opts.out:
                Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
                with open(opts.out, "a") as f:
                    f.write(json_out.dumps(r, sort_keys=True) + "\n")
            print(f"  {r['run_dir']}: eval loss {r['eval_loss']:.4f} at {r['steps']} "
                  f"({r['wall_s']:.0f} s)", flush=True)
    print(f"# {opts.preset}, {opts.steps} steps, overrides {list(opts.overrides) or 'none'}")
    print(table(mine))
    return 0
