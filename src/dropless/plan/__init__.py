"""Planning cluster runs: memory, FLOPs, bytes and step time from first principles.

`predict(shape, PlanConfig(...), get_profile("gb300"))` is the whole model; `dropless plan` is
its command line. Pure Python arithmetic: nothing is compiled or allocated on a device
(calibrate.py, which times real runs, is imported only by `--calibrate`).
"""
from dropless.plan.hardware import PROFILES, HardwareProfile, get_profile
from dropless.plan.layout import PlanConfig
from dropless.plan.model import predict
from dropless.plan.presets import PRESETS, get_shape, shape_of
from dropless.plan.shape import ModelShape, param_counts
from dropless.plan.sweep import suggest, sweep_gpus

__all__ = ["HardwareProfile", "ModelShape", "PlanConfig", "PRESETS", "PROFILES", "get_profile",
           "get_shape", "param_counts", "predict", "shape_of", "suggest", "sweep_gpus"]
