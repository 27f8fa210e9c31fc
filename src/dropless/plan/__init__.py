"""Planning cluster runs: memory, FLOPs, bytes and step time from first principles.

`predict(model, PlanConfig(...), get_profile("gb300"))` is the whole model, where `model` is
the trainer's `dropless.config.ModelConfig` (e.g. `get_preset("deepseek3-671b")`), counted by
the one arithmetic model (`dropless.models.arithmetic`); `plan_config(train_config)` is the
PlanConfig of a trainer's `TrainConfig`; `dropless plan` is its command line. Pure Python
arithmetic: nothing is compiled or allocated on a device. `dropless plan --calibrate` times real
runs against it; that is a benchmark (`bench/calibrate.py`, above the trainer it times).
"""
from dropless.machine import PROFILES, HardwareProfile, get_profile
from dropless.models.arithmetic import param_counts
from dropless.plan.from_train import plan_config
from dropless.plan.layout import PlanConfig
from dropless.plan.model import predict
from dropless.plan.sweep import suggest, sweep_gpus
from dropless.presets import PRESETS, get_preset

__all__ = ["HardwareProfile", "PlanConfig", "PRESETS", "PROFILES", "get_preset", "get_profile",
           "param_counts", "plan_config", "predict", "suggest", "sweep_gpus"]
