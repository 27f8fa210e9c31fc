"""Planning cluster runs: memory, FLOPs, bytes and step time from first principles.

`predict(model, PlanConfig(...), get_profile("gb300"))` is the whole model, where `model` is
the trainer's `dropless.config.ModelConfig` (e.g. `get_shape("deepseek3-671b")`); `dropless plan`
is its command line. Pure Python arithmetic: nothing is compiled or allocated on a device
(calibrate.py, which times real runs, is imported only by `--calibrate`).
"""
from dropless.machine import PROFILES, HardwareProfile, get_profile
from dropless.plan.layout import PlanConfig
from dropless.plan.model import predict
from dropless.plan.presets import PRESETS, get_shape
from dropless.plan.shape import model_config, param_counts
from dropless.plan.sweep import suggest, sweep_gpus

__all__ = ["HardwareProfile", "PlanConfig", "PRESETS", "PROFILES", "get_profile", "get_shape",
           "model_config", "param_counts", "predict", "suggest", "sweep_gpus"]
