"""overflow="error": the host-side check of the dispatcher's overflow flag, every N steps."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from dropless.config import MoEConfig


class BufferOverflowError(RuntimeError):
    """A static receive buffer overflowed under overflow="error"; the step must not apply."""


def should_check_overflow(step: int, cfg: MoEConfig) -> bool:
    """Whether the host reads the overflow flag at `step` (every overflow_check_every_n_steps)."""
    return cfg.overflow == "error" and step % cfg.overflow_check_every_n_steps == 0


def check_overflow(aux: dict[str, Any], *, layer: str, cfg: MoEConfig) -> None:
    """Raise BufferOverflowError if the layer's buffers dropped rows (host sync: call it every
    overflow_check_every_n_steps). The message names the layer, the rows that overflowed and
    the ragged_buffer_factor that would have been enough."""
    dropped = int(np.asarray(aux.get("dropped_rows", 0)))
    if dropped <= 0:
        return
    need = float(np.asarray(aux["sufficient_buffer_factor"]))
    enough = math.ceil(need * 10) / 10
    raise BufferOverflowError(
        f"{layer}: {dropped} rows overflowed the expert-parallel receive buffers "
        f"(MoEConfig.ragged_buffer_factor={cfg.ragged_buffer_factor}); "
        f"ragged_buffer_factor={enough} would have been enough, or use overflow='rounds'")
