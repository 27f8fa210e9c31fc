"""The expert-parallel buffer-overflow policy, seen from the training loop.

Legend: L MoE layers whose dispatcher reports overflow (the model's MoE layers, then the MoE
blocks of the MTP modules).

`model.moe.overflow="rounds"` (the default) never drops a token: rows beyond a peer's static
buffer travel in extra rounds of the same step, and the step metrics count them
(`overflow_rounds`). Nothing here runs.

`overflow="error"` runs one round; rows that do not fit are dropped by the dispatcher and
counted per layer. Such a step must not be applied, and the run must stop naming the layer, the
rows and the `ragged_buffer_factor` that would have fitted. Reading a flag is a host sync, so
the loop reads it only every `overflow_check_every_n_steps` steps (MaxText's
`te_ep_overflow_check_every_n_steps`) and before each checkpoint. In between, the jitted step
keeps itself honest without the host: `OverflowGuard.wrap` makes the first overflowing step,
and every step after it, return the state it was given (a select on device), and remembers that
step's per-layer rows and sufficient buffer factors in `state["overflow"]`. When the loop finally
looks, the state is still the last good step's: it is checkpointed under that step number
(resumable as any other) and the run stops with BufferOverflowError. (The pattern, and the
`check` the loop calls, are `train.guards`.)

`state["overflow"]` exists only in memory (`attach` adds it): `strip` removes it before a
checkpoint, so runs with either policy read each other's checkpoints.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from dropless.config import TrainConfig
from dropless.train.guards import AFTER_RECORD, Guard, GuardStop, Tripped

KEY = "overflow"


class BufferOverflowError(GuardStop):
    """A receive buffer overflowed under overflow="error"; the run stopped at the last good
    step, which was checkpointed."""


def layer_names(cfg: TrainConfig) -> list[str]:
    """Names of the L layers, in the order of the metrics' `dropped_rows_L` then
    `mtp_dropped_rows_L`."""
    m = cfg.model
    names = [f"layer {i}" for i in range(m.num_layers) if m.is_moe_layer(i)]
    if m.moe is not None:
        names += [f"MTP module {k}" for k in range(1, m.mtp_depth + 1)]
    return names


def _per_layer(metrics: dict, name: str, size: int) -> jax.Array:
    """[L] float32 of metric `name` over the model's MoE layers then the MTP blocks (zeros
    where the dispatcher reports nothing, e.g. on one device)."""
    parts = [jnp.asarray(metrics[k], jnp.float32).reshape(-1)
             for k in (f"{name}_L", f"mtp_{name}_L") if k in metrics]
    v = jnp.concatenate(parts) if parts else jnp.zeros((0,), jnp.float32)
    return jnp.zeros((size,), jnp.float32).at[: v.shape[0]].set(v[:size])


class OverflowGuard(Guard):
    """The loop's side of overflow="error" (inactive, every method a pass-through, otherwise).
    Read every `overflow_check_every_n_steps` steps, after the step is recorded; a refused
    first step leaves the initial state, which is checkpointed as step 0."""

    stage = AFTER_RECORD
    error = BufferOverflowError
    save_initial = True

    def __init__(self, cfg: TrainConfig):
        moe = cfg.model.moe
        self.cfg = cfg
        self.active = moe is not None and moe.overflow == "error"
        self.every = moe.overflow_check_every_n_steps if moe is not None else 1
        self.names = layer_names(cfg)

    def attach(self, state: dict) -> dict:
        """`state` plus the on-device record of the first overflowing step (none yet)."""
        if not self.active:
            return state
        n = len(self.names)
        return {**state, KEY: {"step": jnp.zeros((), jnp.int32),
                               "rows_L": jnp.zeros((n,), jnp.float32),
                               "factor_L": jnp.zeros((n,), jnp.float32)}}

    def strip(self, state: dict) -> dict:
        """`state` without the overflow record (what checkpoints hold), active or not."""
        return {k: v for k, v in state.items() if k != KEY}

    def wrap(self, step_fn):
        """step_fn(state, batch) -> (state, metrics), made to return its input state unchanged
        when this step, or an earlier one, overflowed. Metrics gain `overflow_skipped` (1: the
        step was not applied)."""
        if not self.active:
            return step_fn
        n = len(self.names)

        def guarded(state, batch):
            rec, inner = state[KEY], self.strip(state)
            new, metrics = step_fn(inner, batch)
            rows_L = _per_layer(metrics, "dropped_rows", n)
            first = (jnp.sum(rows_L) > 0) & (rec["step"] == 0)
            skip = first | (rec["step"] > 0)
            new = jax.tree.map(lambda old, upd: jnp.where(skip, old, upd), inner, new)
            factor_L = _per_layer(metrics, "sufficient_buffer_factor", n)
            new[KEY] = {"step": jnp.where(first, inner["step"] + 1, rec["step"]),
                        "rows_L": jnp.where(first, rows_L, rec["rows_L"]),
                        "factor_L": jnp.where(first, factor_L, rec["factor_L"])}
            metrics["overflow_skipped"] = skip.astype(jnp.int32)
            return new, metrics

        return guarded

    def due(self, step: int) -> bool:
        """Whether the loop reads the flag after `step` (1-based): every n-th step."""
        return self.active and step % self.every == 0

    def tripped(self, state: dict, step: int, metrics) -> Tripped | None:
        """Read the on-device record: the first overflowing step, if any (a host sync)."""
        rec = jax.device_get(state[KEY])
        bad = int(rec["step"])
        return Tripped(bad=bad, detail=rec) if bad else None

    def describe(self, found: Tripped, *, state, metrics, batch) -> str:
        return self.message(found.bad, found.detail["rows_L"], found.detail["factor_L"])

    def saved_words(self, good: int, run_dir) -> str:
        return f"; step {good} (the last good one) is checkpointed, resume from it"

    def message(self, bad: int, rows_L, factor_L) -> str:
        """The one-line stop message: layers, rows, the buffer factor that would have fitted."""
        hit = [(name, int(r), float(f)) for name, r, f in zip(self.names, rows_L, factor_L)
               if r > 0]
        moe = self.cfg.model.moe
        need = max(f for _, _, f in hit)
        enough = max(math.ceil(need * 10 - 1e-6) / 10, moe.ragged_buffer_factor + 0.1)
        layers = ", ".join(f"{name} ({r} rows)" for name, r, _ in hit)
        return (f"step {bad}: expert-parallel receive buffers overflowed in {layers} with "
                f"model.moe.ragged_buffer_factor={moe.ragged_buffer_factor} and "
                f"overflow='error'; the step was not applied. ragged_buffer_factor="
                f"{enough:.1f} would have fitted (or set model.moe.overflow=rounds: extra rounds, "
                f"nothing dropped)")


def startup_notes(cfg: TrainConfig) -> list[str]:
    """A line when the overflow check interval is set but the policy never checks."""
    moe = cfg.model.moe
    if moe is not None and moe.overflow == "rounds" and moe.overflow_check_every_n_steps != 1:
        return [f"overflow_check_every_n_steps={moe.overflow_check_every_n_steps} (MaxText "
                "te_ep_overflow_check_every_n_steps) changes nothing with "
                "model.moe.overflow='rounds': nothing is dropped, extra rounds are counted"]
    return []
