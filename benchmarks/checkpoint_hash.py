"""What the checkpoint content hashes cost: save and restore seconds with and without them.

    PYTHONPATH=src python benchmarks/checkpoint_hash.py [--repeats 5] \
        [--out benchmarks/results/checkpoint_hash.jsonl]

The whole train state of the `deepseek3-test` preset (parameters and AdamW moments, as
`dropless train` checkpoints it) is saved synchronously with orbax into a temporary directory
and restored, alternately with hashes (`checkpoint.save(..., hashes=True)`, restore verifying
them) and without, A, B, A, B, ... in one process (BENCHMARKING.md: only interleaved ratios
mean anything on a shared machine). Also times the hashing alone (`integrity.tree_hashes` over
the state). Records one JSON line: state bytes, medians and min/max per variant, the overhead
in seconds and percent, the share of the cores others kept busy before each measurement, and
the machine.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path


def _stats(xs: list[float]) -> dict:
    return {"median_s": statistics.median(xs), "min_s": min(xs), "max_s": max(xs)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--preset", default="deepseek3-test")
    p.add_argument("--out", help="append the JSON line to this file")
    args = p.parse_args(argv)

    import jax
    import numpy as np
    from dropless.machine import busy_fraction, machine_info
    from dropless.config import TrainConfig
    from dropless.presets import get_preset
    from dropless import checkpoint as ckpt
    from dropless.checkpoint import integrity
    from dropless.train import step as step_lib

    cfg = TrainConfig(model=get_preset(args.preset), preset=args.preset)
    state, _ = step_lib.init_state(cfg)
    state = jax.block_until_ready(state)
    nbytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(state))
    meta = {"next_batch": 0, "corpus": {}}
    times = {k: [] for k in ("save_hash", "save_plain", "restore_verify", "restore_plain",
                             "hash_only")}
    busy = []
    root = Path(tempfile.mkdtemp(prefix="ckpt_hash_"))
    try:
        step = 0
        for rep in range(args.repeats + 1):     # round 0 warms up (first saves, restores)
            for hashed in (True, False):
                step += 1
                b = busy_fraction(0.3)
                if rep:
                    busy.append(b)
                mngr = ckpt.manager(root / "c", keep=100, async_save=False)
                t0 = time.perf_counter()
                ckpt.save(mngr, step, state, meta, hashes=hashed)
                mngr.wait_until_finished()
                t1 = time.perf_counter()
                restored, _ = ckpt.restore(mngr, step, state, verify=hashed)
                jax.block_until_ready(restored)
                t2 = time.perf_counter()
                mngr.close()
                shutil.rmtree(root / "c" / str(step))
                if rep:
                    times["save_hash" if hashed else "save_plain"].append(t1 - t0)
                    times["restore_verify" if hashed else "restore_plain"].append(t2 - t1)
            t0 = time.perf_counter()
            integrity.tree_hashes(state)
            if rep:
                times["hash_only"].append(time.perf_counter() - t0)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    s = {k: _stats(v) for k, v in times.items()}
    rec = {"bench": "checkpoint_hash", "preset": args.preset, "algorithm": integrity.ALGORITHM,
           "state_bytes": int(nbytes), "arrays": len(jax.tree.leaves(state)),
           "repeats": args.repeats, **s,
           "save_overhead_s": s["save_hash"]["median_s"] - s["save_plain"]["median_s"],
           "restore_overhead_s": s["restore_verify"]["median_s"] - s["restore_plain"]["median_s"],
           "hash_gb_per_s": nbytes / s["hash_only"]["median_s"] / 1e9,
           "busy_before": busy, "contended": any(b is not None and b > 0.2 for b in busy),
           "unix_time": time.time(), "machine": machine_info()}
    for k in ("save", "restore"):
        base = s["save_plain" if k == "save" else "restore_plain"]["median_s"]
        rec[f"{k}_overhead_pct"] = 100 * rec[f"{k}_overhead_s"] / base
    line = json.dumps(rec)
    print(line)
    if args.out:
        with open(args.out, "a") as fh:
            fh.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
