"""Compile time of the `dropless train` step with and without `scan_layers`, at several depths.

    PYTHONPATH=src python benchmarks/scan_compile.py [--layers 4,16] [--repeats 1] \
        [--lower-only] [--out benchmarks/results/scan_compile.jsonl]

For each depth and layout, in a fresh subprocess (no cache shared between measurements), the
preset `deepseek3-test` with `num_layers` changed is traced, lowered and compiled as the trainer
jits its step (loss, MTP, gradients, AdamW, router-bias update), on one CPU device. Records one
JSON line per measurement: seconds to trace+lower and to compile, the size of the lowered
module (StableHLO lines: deterministic, the reason compile time grows), and the machine. Timings
are only meaningful on a quiet machine (the share of cores others kept busy just before each
measurement is recorded); `--lower-only` skips compilation and records the deterministic
module size alone.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

_CHILD = r"""
import functools, json, sys, time
import jax, numpy as np
from dropless.config import TrainConfig
from dropless.presets import get_preset
from dropless.train import step
layers, scan, lower_only = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3] == "1"
model = get_preset("deepseek3-test").replace(num_layers=layers, scan_layers=scan)
cfg = TrainConfig(model=model, preset="deepseek3-test", per_device_batch_size=4, seq_len=64)
state, opt = step.init_state(cfg)
batch = np.zeros((4, 65), np.int32)
fn = jax.jit(functools.partial(step.train_step, cfg=cfg, opt=opt))
t0 = time.perf_counter()
lowered = fn.trace(state, batch).lower()
t1 = time.perf_counter()
if not lower_only:
    lowered.compile()
t2 = time.perf_counter()
print(json.dumps({"lower_s": t1 - t0, "compile_s": None if lower_only else t2 - t1,
                  "hlo_lines": lowered.as_text().count("\n")}))
"""


def measure(layers: int, scan: bool, lower_only: bool = False) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)          # one device: the step alone, no EP
    out = subprocess.run([sys.executable, "-c", _CHILD, str(layers), "1" if scan else "0",
                          "1" if lower_only else "0"],
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", default="4,16")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--lower-only", action="store_true", help="no compile: module size only")
    p.add_argument("--out", default="benchmarks/results/scan_compile.jsonl")
    args = p.parse_args(argv)
    from dropless.machine import busy_fraction, machine_info
    machine = machine_info()
    rows = []
    for rep in range(args.repeats):
        for layers in [int(x) for x in args.layers.split(",")]:
            for scan in (False, True):        # interleaved, so drift hits both alike
                busy = busy_fraction()            # others' load just before measuring
                r = {"bench": "scan_compile", "preset": "deepseek3-test", "num_layers": layers,
                     "scan_layers": scan, "repeat": rep, **measure(layers, scan, args.lower_only),
                     "busy_before": busy, "unix_time": time.time(), "machine": machine}
                rows.append(r)
                comp = "-" if r["compile_s"] is None else f"{r['compile_s']:6.2f} s"
                print(f"layers {layers:>3} scan {str(scan):5} lower {r['lower_s']:6.2f} s  "
                      f"compile {comp}  hlo {r['hlo_lines']:>6} lines  "
                      f"busy before {r['busy_before']}", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
