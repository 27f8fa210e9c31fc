"""One protocol for the loop's step guards: `overflow="error"` (overflow.OverflowGuard) and
`check_nan` (nonfinite.NonFiniteGuard) are one pattern, written once here:

  0. `attach(state)` adds what the guard keeps on device from step to step (the overflow
     record), `strip(state)` takes it off again before a checkpoint (the default: nothing);
  1. on device, `wrap(step_fn)` adds a select: a step that must not be applied returns the state
     it was given, so the state the loop holds is still the last good step's;
  2. on the host, `check(state, step, ...)` reads (when `due`, or when `force`d before a
     checkpoint or a stop) whether a step was refused: `tripped` -> a `Tripped` or None;
  3. if one was, `check` saves the last good step through `save` (the loop's Saver, see
     `train.loop`), and raises the guard's `GuardStop` subclass with one line: what happened
     (`describe`), then where the last good step is (`saved_words`).

A guard that is not active (its setting is off) is a pass-through: `attach` and `wrap` return
what they are given, `check` returns at once. The loop holds its guards as a tuple and uses them
only through `attach_all`, `wrap_all`, `strip_all`, `check_all` and `due`.

The loop calls every guard at its `stage`: BEFORE_RECORD guards decide from the step's own
metrics, so a refused step is never recorded (check_nan); AFTER_RECORD guards read a flag the
device kept since the first refused step, so the steps up to the read are recorded as run, with
their skip flag (overflow, read every n-th step).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, ClassVar, Mapping

BEFORE_RECORD = "before_record"
AFTER_RECORD = "after_record"

# (good step, state as the loop holds it) -> the run directory it is checkpointed in
SaveLastGood = Callable[[int, dict], Path]


class GuardStop(RuntimeError):
    """A guard stopped the run at the last good step (the base of BufferOverflowError and
    NonFiniteError)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Tripped:
    """What a guard's host check found: step `bad` (1-based) was the first not applied, so the
    state the loop holds is step `good` = bad - 1's (0: nothing was applied)."""

    bad: int
    detail: Any = None          # what the host check read, for the guard's `describe`

    def __post_init__(self) -> None:
        if not isinstance(self.bad, int) or self.bad < 1:
            raise ValueError(f"Tripped.bad={self.bad!r} must be a step number >= 1")

    @property
    def good(self) -> int:
        return self.bad - 1


class Guard:
    """The shared half of a step guard. A subclass sets `active`, the class attributes below,
    and implements `wrap`, `due`, `tripped`, `describe` and `saved_words`; `attach` and
    `strip` when it keeps a record in the state."""

    stage: ClassVar[str] = AFTER_RECORD
    error: ClassVar[type[GuardStop]] = GuardStop
    # the words when step 0 is the last good one and `save_initial` is False
    nothing_saved: ClassVar[str] = "; no step had completed, nothing is checkpointed"
    save_initial: ClassVar[bool] = False    # checkpoint step 0 (the initial state) when good == 0
    active: bool = False

    def attach(self, state: dict) -> dict:
        """`state` plus what this guard keeps on device from step to step (here: nothing)."""
        return state

    def strip(self, state: dict) -> dict:
        """`state` without what `attach` added: what a checkpoint holds (here: `state`)."""
        return state

    def wrap(self, step_fn: Callable) -> Callable:
        """step_fn(state, batch) -> (state, metrics), made to return its input state for a step
        that must not be applied."""
        return step_fn

    def due(self, step: int) -> bool:
        """Whether `check` reads after `step` (1-based) without being forced."""
        return self.active

    def tripped(self, state: dict, step: int, metrics: Mapping[str, Any]) -> Tripped | None:
        """The host check: which step was refused, if one was."""
        raise NotImplementedError

    def describe(self, found: Tripped, *, state: dict, metrics: Mapping[str, Any],
                 batch: Any) -> str:
        """The stop message, without where the last good step went."""
        raise NotImplementedError

    def saved_words(self, good: int, run_dir: Path) -> str:
        """The words that end the message once step `good` is checkpointed in `run_dir`."""
        raise NotImplementedError

    def check(self, state: dict, step: int, *, metrics: Mapping[str, Any] | None = None,
              batch: Any = None, force: bool = False, save: SaveLastGood | None = None) -> None:
        """After `step` (1-based; `metrics` its host metrics, `batch` its input): when due or
        `force`d, run the host check; when a step was refused, save the last good step with
        `save` (none given: nothing is saved) and raise the guard's `error`."""
        if not self.active or not (force or self.due(step)):
            return
        metrics = {} if metrics is None else metrics
        found = self.tripped(state, step, metrics)
        if found is None:
            return
        words = ""
        if save is not None:
            if found.good == 0 and not self.save_initial:
                words = self.nothing_saved
            else:
                words = self.saved_words(found.good, save(found.good, state))
        raise self.error(self.describe(found, state=state, metrics=metrics, batch=batch) + words)


def attach_all(guards, state: dict) -> dict:
    """`state` with each guard's `attach`, in order."""
    for guard in guards:
        state = guard.attach(state)
    return state


def strip_all(guards, state: dict) -> dict:
    """`state` without what `attach_all` added (each guard's `strip`, the last guard's first):
    what a checkpoint holds."""
    for guard in reversed(guards):
        state = guard.strip(state)
    return state


def wrap_all(guards, step_fn: Callable) -> Callable:
    """`step_fn` wrapped by each guard in order: the first guard wraps the step, the next one
    wraps that."""
    for guard in guards:
        step_fn = guard.wrap(step_fn)
    return step_fn


def check_all(guards, stage: str, state: dict, step: int, *, metrics: Mapping[str, Any],
              batch: Any, force: bool, save: SaveLastGood) -> None:
    """Run `check` of each guard of `guards` whose stage is `stage`, in order."""
    for guard in guards:
        if guard.stage == stage:
            guard.check(state, step, metrics=metrics, batch=batch, force=force, save=save)
