"""Multi-process start-up: MaxText's `hardware: gpu_multiprocess`, our `distributed=true`.

`jax.distributed.initialize()` with no arguments finds the coordinator, the process count and
this process's id from the cluster environment (SLURM, Open MPI, Kubernetes JobSet, or the
explicit JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID). It must run before JAX
creates a backend. `decide` is the pure decision (testable without a cluster); `initialize`
acts on it.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Mapping, Sequence

# cluster -> variables that must all be present for jax's auto-detection to find it
CLUSTERS: dict[str, tuple[str, ...]] = {
    "explicit (JAX_COORDINATOR_ADDRESS)": ("JAX_COORDINATOR_ADDRESS",),
    "SLURM": ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
              "SLURM_LOCALID"),
    "Open MPI": ("OMPI_MCA_orte_hnp_uri",),
    "Kubernetes": ("KUBERNETES_SERVICE_HOST", "JOB_COMPLETION_INDEX"),
}


@dataclasses.dataclass(frozen=True)
class Decision:
    """Whether to call jax.distributed.initialize(), and the line that says why."""

    initialize: bool
    cluster: str | None
    message: str


def detect_cluster(environ: Mapping[str, str]) -> str | None:
    """The first cluster of CLUSTERS whose variables are all set, or None."""
    for name, needed in CLUSTERS.items():
        if all(environ.get(v) for v in needed):
            return name
    return None


def decide(distributed: bool, environ: Mapping[str, str] | None = None) -> Decision:
    """What `initialize` will do for TrainConfig.distributed and this environment.

    distributed=False: one process (nothing to do). distributed=True and a cluster found:
    initialize from it. distributed=True and none found: one process, and the message says
    the setting changes nothing here (so a laptop or a one-GPU box runs the recipe unchanged).
    """
    environ = os.environ if environ is None else environ
    if not distributed:
        return Decision(False, None, "")
    cluster = detect_cluster(environ)
    if cluster is None:
        return Decision(False, None, "distributed=true (hardware: gpu_multiprocess): no cluster "
                        "environment found (SLURM, Open MPI, Kubernetes or "
                        "JAX_COORDINATOR_ADDRESS); running as one process, it changes nothing")
    return Decision(True, cluster, f"distributed=true: jax.distributed.initialize() from the "
                    f"{cluster} environment")


def initialize(distributed: bool) -> str:
    """Act on `decide(distributed)`; returns the start-up line ('' when not distributed).

    Raises RuntimeError when jax.distributed cannot reach the coordinator (jax's own message).
    """
    d = decide(distributed)
    if d.initialize:
        import jax
        jax.distributed.initialize()
        return (f"{d.message}: process {jax.process_index()} of {jax.process_count()}, "
                f"{jax.local_device_count()} local / {jax.device_count()} devices")
    return d.message


def start(cfg, notes: Sequence[str] = (), echo=print, *,
          late_notes: Sequence[str] = ()) -> None:
    """Process start-up for `dropless train`, in the order it must happen: XLA flags and
    environment variables (before any backend exists), jax.distributed (before devices are
    listed), then one line for each accepted setting that changes nothing on this platform:
    `notes` (from config translation) first, then the platform's, then `late_notes` (the
    caller's own, e.g. the trainer's `train.overflow.startup_notes`: runtime imports nothing
    above it, so whoever knows such a setting passes its line in).

    Raises ValueError for an XLA flag this XLA does not know, RuntimeError when a backend
    already exists or the coordinator cannot be reached.
    """
    from dropless.runtime import xla_flags
    for line in xla_flags.apply_startup(cfg):
        echo(line)
    lines = list(notes)
    d = decide(cfg.distributed)
    if d.initialize:
        echo(initialize(True))
    elif d.message:
        lines.append(d.message)
    import jax
    lines += xla_flags.platform_notes(cfg, jax.default_backend()) + list(late_notes)
    for text in dict.fromkeys(lines):   # once each
        echo(f"note: {text}")
