"""Models by preset name for the planner: the trainer's presets (`dropless.presets`), read as they
are, so the planner and the trainer plan and train the same model (one description per model).

`PUBLISHED_PARAMS` are the published (total, active) parameter counts the tests compare with.
"""
from __future__ import annotations

from dropless.config import ModelConfig
from dropless.presets import PRESETS, PUBLISHED_COUNTS, get_preset

PUBLISHED_PARAMS = PUBLISHED_COUNTS

__all__ = ["PRESETS", "PUBLISHED_PARAMS", "get_shape"]


def get_shape(name: str) -> ModelConfig:
    """The ModelConfig of preset `name`; raises ValueError listing the known names."""
    return get_preset(name)
