"""A run folder as `dropless report` reads it: metrics.jsonl with step records (loss falling by
0.1 a step from 5.0) and, optionally, the config.json that names the run's vocabulary."""
import json
from pathlib import Path


def step_record(step: int, **change) -> dict:
    """The record the training loop writes for `step`, with `change` applied."""
    return {"event": "step", "step": step, "loss": 5.0 - step / 10, "step_time_s": 0.5,
            "tokens_per_s": 4000.0, "tflops_per_device": 0.02, "dropped_tokens": 0, **change}


def write_run(run: Path, steps: int, vocab_size: int | None = None) -> Path:
    """Make the folder `run` holding metrics.jsonl with steps 1..`steps`, and a config.json with
    model.vocab_size when `vocab_size` is given; returns `run`."""
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps(step_record(s)) + "\n" for s in range(1, steps + 1)))
    if vocab_size is not None:
        (run / "config.json").write_text(json.dumps({"model": {"vocab_size": vocab_size}}))
    return run
