"""Planning cluster runs: memory, FLOPs, bytes and step time from first principles.

`predict(PlanConfig(run=train_config, ...), get_profile("gb300"))` is the whole model, where
`train_config` is the trainer's `dropless.config.TrainConfig` (its model, e.g.
`get_preset("deepseek3-671b")`, counted by the arithmetic model `dropless.models.arithmetic`,
its mesh, batch and remat policy) and the rest of PlanConfig the planner's own settings;
`build_plan(settings)` makes one from `dropless plan`'s settings; `dropless plan` is its command
line. Pure Python arithmetic: nothing is compiled or allocated on a device. `dropless plan
--calibrate` times real runs against it; that is a benchmark (`bench/calibrate.py`, above the
trainer it times).
"""
from dropless.machine import PROFILES, HardwareProfile, get_profile
from dropless.models.arithmetic import param_counts
from dropless.plan.from_train import build_plan
from dropless.plan.layout import PlanConfig
from dropless.plan.model import predict
from dropless.plan.sweep import suggest, sweep_gpus
from dropless.presets import PRESETS, get_preset

__all__ = ["HardwareProfile", "PlanConfig", "PRESETS", "PROFILES", "build_plan", "get_preset",
           "get_profile", "param_counts", "predict", "suggest", "sweep_gpus"]
