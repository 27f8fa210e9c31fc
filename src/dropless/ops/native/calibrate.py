"""The native library's machine-dependent choices, picked by measuring them on this CPU the first
time the library loads, and cached per CPU and library build.

Legend: M rows, K contraction dim, N output dim, G groups.

What is chosen (csrc/kernel.h, `SettingId`; each 0 = the build's rule until calibrated):
  pack_b          the tiled kernel copies B's panels side by side before its tiles read them
                  ("on"), or reads them in place ("off")
  stream          outputs larger than the workers' L2s together are written with streaming
                  stores ("on") or plain ones ("off")
  kernel_nn, kernel_nt, kernel_tn, kernel_gate_up
                  the GEMM of the forward, the NT form (dlhs), the TN form (drhs) and the fused
                  gate and up tile: the tiled kernel ("own"), OpenBLAS ("openblas") or, where
                  the `mkl` wheel is installed, MKL ("mkl"; load.py opens it)
Each is timed on probes, grouped products of the layer's kind (`PROBE`: 8 groups of 256 rows,
K = 512, N = 1024) run on the handlers' own path (`dropless_run_grouped_gemm`, and the fused
handlers the layer runs: `dropless_run_gate_up` for the fused forward tile, and for the NT form
the fused backward's `dropless_run_swiglu_dlhs` and `dropless_run_dual_dlhs` beside the plain
dlhs), its candidates interleaved (A, B, A, B, ...), `REPEATS` times each;
the candidate with the lowest median wins, and the build's default keeps its place unless
another is faster by more than `MARGIN`. The settings are chosen in order (pack_b and stream
under the tiled kernel, then each form's kernel with them), about a second in all.

The result (`Calibration`: each setting's choice, every candidate's median in ms, when, and the
key) is one JSON file per key in `cache_dir()/calibration/`: the key is the CPU (its model and
flags, as the build's) and the library's build key, so a new build or another CPU calibrates
anew. The file is written whole or not at all (runtime.files); two processes calibrating at
once each write a whole file and the last one stays. A file that cannot be read or does not
match its key is reported in one warning line and measured again. DROPLESS_NATIVE_KERNEL (load.py)
still forces one kernel for every form; DROPLESS_NATIVE_CALIBRATION=off keeps the build's
rules (nothing measured, nothing cached).
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import hashlib
import json
import os
import statistics
import time
import warnings
from pathlib import Path
from typing import Callable

import numpy as np

from dropless.runtime import files

CALIBRATION_ENV = "DROPLESS_NATIVE_CALIBRATION"
VERSION = 2          # of the file's format and the procedure: a change calibrates anew
REPEATS = 5
MARGIN = 0.05        # another candidate must beat the default by more than this to replace it

# setting -> (its SettingId in csrc/kernel.h, {candidate: value}, the probes it is timed on);
# the first candidate is the build's default, and the order is the order of choosing
SETTINGS: dict[str, tuple[int, dict[str, int], tuple[str, ...]]] = {
    "pack_b": (4, {"on": 1, "off": 2}, ("forward", "drhs", "gate_up")),
    "stream": (5, {"on": 1, "off": 2}, ("forward", "drhs", "gate_up")),
    "kernel_nn": (0, {"own": 1, "openblas": 2, "mkl": 3}, ("forward",)),
    "kernel_nt": (1, {"own": 1, "openblas": 2, "mkl": 3}, ("dlhs", "swiglu_dlhs", "dual_dlhs")),
    "kernel_tn": (2, {"own": 1, "openblas": 2, "mkl": 3}, ("drhs",)),
    "kernel_gate_up": (3, {"own": 1, "openblas": 2, "mkl": 3}, ("gate_up",)),
}
# candidates only some installs have: MKL where its wheel is (the library says, `_absent`)
OPTIONAL = ("mkl",)
PROBE = {"groups": 8, "rows": 256, "k": 512, "n": 1024}


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What was chosen for this CPU and build: `chosen` {setting: candidate}, `medians_ms`
    {setting: {candidate: median ms of its probes}}, `how` (measured now, read from the cache
    file, or the build's rules and why) and `key`."""
    chosen: dict[str, str]
    medians_ms: dict[str, dict[str, float]]
    how: str
    key: str

    def record(self) -> dict[str, object]:
        """For benchmark records: the choices and the medians that made them."""
        return {"native_choices": dict(self.chosen), "native_choice_ms": self.medians_ms,
                "native_calibration": self.how}


def _default_candidates(vector_floats: int) -> dict[str, str]:
    """The build's rules: pack and stream on, the tiled kernel in AVX-512 builds."""
    own = "own" if vector_floats == 16 else "openblas"
    return {"pack_b": "on", "stream": "on", "kernel_nn": own, "kernel_nt": own,
            "kernel_tn": own, "kernel_gate_up": own}


def choose(measure: Callable[[str], float], apply: Callable[[str, str], None],
           defaults: dict[str, str], repeats: int = REPEATS, margin: float = MARGIN,
           absent: frozenset[str] = frozenset()
           ) -> tuple[dict[str, str], dict[str, dict[str, float]]]:
    """Pick each setting in SETTINGS' order: `apply(setting, candidate)` sets it,
    `measure(probe)` times one call of a probe in seconds. Candidates (less those `absent`
    here) are timed round-robin, `repeats` rounds; a setting keeps `defaults[setting]` unless
    another candidate's median is lower by more than `margin` of it. Settings already chosen
    stay applied while the later ones are timed. Returns ({setting: chosen}, {setting:
    {candidate: median ms}})."""
    chosen: dict[str, str] = {}
    medians: dict[str, dict[str, float]] = {}
    for name, (_, candidates, probes) in SETTINGS.items():
        samples: dict[str, list[float]] = {c: [] for c in candidates if c not in absent}
        for _ in range(repeats):
            for cand in samples:
                apply(name, cand)
                samples[cand].append(sum(measure(p) for p in probes))
        med = {c: statistics.median(s) * 1e3 for c, s in samples.items()}
        best = min(med, key=med.get)
        pick = defaults[name]
        if med[best] < med[pick] * (1 - margin):
            pick = best
        apply(name, pick)
        chosen[name] = pick
        medians[name] = {c: round(v, 3) for c, v in med.items()}
    return chosen, medians


@contextlib.contextmanager
def use_settings(lib: ctypes.CDLL, **chosen: str):
    """Run the block with the named settings set to the named candidates (`build` for the
    build's rule), for every call in the process; each is restored after. For tests and
    benchmarks. Raises ValueError naming an unknown setting or candidate."""
    before = {}
    for name, cand in chosen.items():
        if name not in SETTINGS or (cand not in SETTINGS[name][1] and cand != "build"):
            raise ValueError(f"{name}={cand!r}: settings are {', '.join(SETTINGS)}, with "
                             "the candidates in calibrate.SETTINGS or 'build'")
    try:
        for name, cand in chosen.items():
            sid, values, _ = SETTINGS[name]
            before[sid] = lib.dropless_setting(sid)
            lib.dropless_set_setting(sid, 0 if cand == "build" else values[cand])
        yield
    finally:
        for sid, value in before.items():
            lib.dropless_set_setting(sid, value)


class _Probes:
    """The probes' operands (float32, small values) and a timed call of each on the library."""

    def __init__(self, lib: ctypes.CDLL):
        g, r, k, n = PROBE["groups"], PROBE["rows"], PROBE["k"], PROBE["n"]
        m = g * r
        rng = np.random.default_rng(0)
        f32 = lambda *s: rng.standard_normal(s).astype(np.float32) * 0.1
        self.lib, self.dims = lib, (g, m, k, n)
        self.x, self.w, self.w2, self.dy = f32(m, k), f32(g, k, n), f32(g, k, n), f32(m, n)
        self.sizes = np.full(g, r, np.int32)
        self.out = {"forward": np.empty((m, n), np.float32), "dlhs": np.empty((m, k), np.float32),
                    "drhs": np.empty((g, k, n), np.float32)}
        self.gate_up = [np.empty((m, n), np.float32) for _ in range(3)]
        # the fused backward's [M, F] operands (F = N, D = K) and its outputs
        self.hidden = [f32(m, n), f32(m, n)]
        self.w_down = f32(g, n, k)
        self.backward = {"swiglu_dlhs": [np.empty((m, n), np.float32) for _ in range(2)],
                         "dual_dlhs": [np.empty((m, k), np.float32)]}
        for fn in ("dropless_run_grouped_gemm", "dropless_run_gate_up",
                   "dropless_run_swiglu_dlhs", "dropless_run_dual_dlhs"):
            getattr(lib, fn).restype = None

    def __call__(self, probe: str) -> float:
        g, m, k, n = self.dims
        p = lambda a: a.ctypes.data_as(ctypes.c_void_p)
        i64 = ctypes.c_int64
        t = time.perf_counter()
        dims = (p(self.sizes), i64(g), i64(m), i64(k), i64(n))
        if probe == "gate_up":
            self.lib.dropless_run_gate_up(p(self.x), p(self.w), p(self.w2), *dims,
                                          *map(p, self.gate_up))
        elif probe == "swiglu_dlhs":   # dy [M, D], w_down [G, F, D], g and u [M, F]
            self.lib.dropless_run_swiglu_dlhs(p(self.x), p(self.w_down), *map(p, self.hidden),
                                              *dims, *map(p, self.backward[probe]))
        elif probe == "dual_dlhs":     # dg, du [M, F], w_gate and w_up [G, D, F]
            self.lib.dropless_run_dual_dlhs(p(self.hidden[0]), p(self.w), p(self.hidden[1]),
                                            p(self.w2), *dims, *map(p, self.backward[probe]))
        else:
            mode = ("forward", "dlhs", "drhs").index(probe)
            a = (self.x, self.dy, self.x)[mode]
            b = self.dy if mode == 2 else self.w
            self.lib.dropless_run_grouped_gemm(ctypes.c_int32(mode), p(a), p(b), p(self.sizes),
                                               i64(g), i64(m), i64(k), i64(n),
                                               p(self.out[probe]))
        return time.perf_counter() - t


def _absent(lib: ctypes.CDLL) -> frozenset[str]:
    """The OPTIONAL candidates this process cannot run: "mkl" where MKL is not open."""
    return frozenset() if int(lib.dropless_mkl_ready()) else frozenset(OPTIONAL)


def cache_file(folder: Path, key: str) -> Path:
    """The calibration file of `key` in `folder`."""
    return folder / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"


def _read(file: Path, key: str) -> Calibration | None:
    """The cached calibration of `key`, None where there is no file; a file that cannot be
    read or is not `key`'s whole record is reported in one warning line and ignored."""
    if not file.exists():
        return None
    try:
        entry = json.loads(file.read_text())
        ok = (isinstance(entry, dict) and entry.get("key") == key
              and entry.get("version") == VERSION
              and set(entry.get("chosen", {})) == set(SETTINGS)
              and all(entry["chosen"][s] in SETTINGS[s][1] for s in SETTINGS))
    except (OSError, ValueError):
        ok = False
    if not ok:
        warnings.warn(f"{file}: not a whole calibration of this CPU and build; measuring again",
                      RuntimeWarning, stacklevel=3)
        return None
    return Calibration(dict(entry["chosen"]), entry.get("medians_ms", {}),
                       f"read from {file} (measured {entry.get('measured', '?')})", key)


def calibrate(lib: ctypes.CDLL, key: str, folder: Path, *,
              measure: Callable[[str], float] | None = None) -> Calibration:
    """This CPU's and build's choices, applied to `lib`: read from `folder`'s file for `key`, or
    measured (`measure(probe)`, default: timing the library's own probes) and written there
    whole. DROPLESS_NATIVE_CALIBRATION=off: the build's rules, nothing measured or written.
    Raises ValueError naming the variable for another value than on or off."""
    setting = os.environ.get(CALIBRATION_ENV, "on") or "on"
    if setting not in ("on", "off"):
        raise ValueError(f"{CALIBRATION_ENV}={setting!r}: use on or off (or leave it unset)")
    defaults = _default_candidates(int(lib.dropless_vector_floats()))

    def apply(name: str, cand: str) -> None:
        sid, values, _ = SETTINGS[name]
        lib.dropless_set_setting(sid, values[cand])

    if setting == "off":
        for name in SETTINGS:
            lib.dropless_set_setting(SETTINGS[name][0], 0)
        return Calibration(defaults, {}, f"the build's rules ({CALIBRATION_ENV}=off)", key)
    for name in SETTINGS:   # pack_b and stream are timed under the tiled kernel
        if name.startswith("kernel_"):
            apply(name, "own")
    file = cache_file(folder, key)
    found = _read(file, key)
    if found is not None and not set(found.chosen.values()) & _absent(lib):
        for name, cand in found.chosen.items():
            apply(name, cand)
        return found
    chosen, medians = choose(measure or _Probes(lib), apply, defaults, absent=_absent(lib))
    measured = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    entry = {"key": key, "version": VERSION, "chosen": chosen, "medians_ms": medians,
             "measured": measured, "probe": PROBE, "repeats": REPEATS, "margin": MARGIN}
    how = f"measured {measured}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        files.write_text(file, json.dumps(entry, indent=1))
        how += f", cached in {file}"
    except OSError as e:   # an unwritable cache: this process keeps what it measured
        how += f", not cached ({e.strerror or e})"
    return Calibration(chosen, medians, how, key)
