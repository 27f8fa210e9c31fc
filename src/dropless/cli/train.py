"""`dropless train [--config FILE] [--preset NAME] [key=value ...]`.

With no arguments: the tiny preset on the built-in corpus (the Python standard library's own
source), writing to runs/<timestamp>-tiny/. Importing this module must not start JAX: the XLA
flag recipe is applied in `run` before the first JAX computation.
"""
from __future__ import annotations


# presets.PRESETS' names, spelled here so that building the parser imports no JAX (a test holds
# them equal)
PRESET_NAMES = ("tiny", "small", "deepseek3-test", "deepseek3-1gpu", "deepseek3-671b",
                "mixtral-8x7b", "qwen3-30b-a3b")


def add_config_arguments(parser) -> None:
    """The arguments that describe a config (shared with `dropless config show`): KEY=VALUE
    overrides, --config FILE, --preset NAME."""
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="config overrides: our keys (steps=100, model.moe.top_k=4) or "
                             "MaxText names (per_device_batch_size=8, ici_expert_parallelism=4)")
    parser.add_argument("--config", help="YAML config file (nested or flat keys)")
    from dropless.presets import PRESETS   # names only: no JAX computation
    parser.add_argument("--preset", help=f"model preset ({', '.join(PRESETS)}, or hf:DIR); "
                                         "default tiny")


def add_arguments(parser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--profile-steps", type=int, metavar="N",
                        help="write a JAX profiler trace of N steps to RUN_DIR/profile")
    parser.add_argument("--resume", metavar="RUN_DIR",
                        help="continue the run in RUN_DIR (its config.json, then overrides) "
                             "from its newest intact checkpoint (damaged newer ones are moved "
                             "to RUN_DIR/checkpoints/damaged/ and the fall-back announced)")
    parser.add_argument("--strict-resume", action="store_true",
                        help="refuse to resume when the newest checkpoint is damaged, instead "
                             "of falling back to an older one")


def config_from_args(args, notes: list[str] | None = None):
    """The TrainConfig the arguments describe (library call; no JAX computation). `notes`
    receives a line per accepted key that changes nothing."""
    from dropless.config_file import build_config, parse_override
    items = [parse_override(o) for o in args.overrides]
    if args.preset:
        items.insert(0, ("preset", args.preset))
    if getattr(args, "profile_steps", None):
        items.append(("profile_steps", args.profile_steps))
    saved: list = []
    if getattr(args, "resume", None):
        from dropless.config_file import resume_items
        # the run's config.json under --config and the overrides (as `defaults`: the file,
        # read after them, would otherwise have every key it sets undone by config.json)
        saved = resume_items(args.resume)
    cfg = build_config(items, yaml_path=args.config, notes=notes, defaults=saved)
    if saved:
        check_resume_path(args.resume, cfg)
        check_resume_preset(args.resume, dict(saved[:1])["preset"], cfg)
    return cfg


def check_resume_preset(run: str, preset: str, cfg) -> None:
    """Raise ValueError when --preset (or a `preset:` in --config) names another preset than
    the one the resumed run was trained as: the run's config.json sets every model key, so the
    other preset would change only the run's label."""
    if cfg.preset != preset:
        raise ValueError(f"preset {cfg.preset!r}: {run} was trained as preset {preset!r}, and a "
                         "resumed run keeps its model (its config.json); drop --preset (and "
                         "any preset: in --config), or start a new run from its weights: "
                         f"init_from={run} with another run_name")


def check_resume_path(run: str, cfg) -> None:
    """Raise ValueError when the config (after the overrides and --config) names another folder
    than the run being resumed (`run_dir` / `run_name` changed): the run would continue, or
    start afresh, somewhere else."""
    import os
    from pathlib import Path
    there = Path(cfg.run_dir) / cfg.run_name
    if os.path.realpath(there) != os.path.realpath(run):
        raise ValueError(f"--resume {run}: the overrides move the run to {there} (run_dir="
                         f"{cfg.run_dir!r}, run_name={cfg.run_name!r}); a resumed run stays in its "
                         "folder: drop the run_dir / run_name override (or copy the folder and "
                         "resume the copy)")


def run(args) -> int:
    """Train; exit status 0 when done (or nothing to do), signals.EXIT_PREEMPTED (75) when a
    SIGTERM/SIGINT stopped the run after saving a checkpoint."""
    from dropless.train.signals import StopRequest, stop_on_signals
    with stop_on_signals(StopRequest()) as stop:   # a signal from here on exits with 75
        return _train(args, stop)


def _train(args, stop) -> int:
    notes: list[str] = []
    cfg = config_from_args(args, notes=notes)
    from dropless.runtime.distributed import start
    from dropless.train.overflow import startup_notes
    start(cfg, notes, late_notes=startup_notes(cfg))   # XLA flags, env, jax.distributed: first
    from dropless.train.loop import train
    result = train(cfg, resume=bool(getattr(args, "resume", None)),
                   strict_resume=bool(getattr(args, "strict_resume", False)), stop=stop)
    if result.stopped_by:
        from dropless.train.signals import EXIT_PREEMPTED
        return EXIT_PREEMPTED
    first = result.losses[min(result.losses)] if result.losses else None
    last = result.losses[max(result.losses)] if result.losses else None
    if first is not None:
        print(f"done: loss {first:.4f} -> {last:.4f}; metrics in {result.run_dir}/metrics.jsonl")
    return 0
