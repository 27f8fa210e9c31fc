"""PlanConfigs for the planner's tests: a model on a mesh, with the planner's defaults of
`dropless plan` (per-device batch 1 x 4096, remat full) unless a test says otherwise."""
from dropless.config import MeshConfig, ModelConfig, TrainConfig
from dropless.plan.layout import PlanConfig


def plan_of(model: ModelConfig, *, data: int = 1, fsdp: int = 1, ep: int = 1, batch: int = 1,
            seq: int = 4096, remat: str = "full", **planner) -> PlanConfig:
    """`model` trained on data x fsdp x ep devices, `planner` the PlanConfig settings."""
    run = TrainConfig(model=model, mesh=MeshConfig(data=data, fsdp=fsdp, expert=ep),
                      per_device_batch_size=batch, seq_len=seq, remat=remat)
    return PlanConfig(run=run, **planner)


def bf16(model: ModelConfig) -> ModelConfig:
    """`model` with bfloat16 activations and weights (as the large presets have)."""
    return model.replace(dtype="bfloat16", weight_dtype="bfloat16")
