"""Model configs from flat test arguments (an MoE layer from num_experts, top_k, moe_d_ff, ...),
for hand counts."""
from dropless.config import ModelConfig, MoEConfig


def model_config(*, num_experts=0, top_k=0, moe_d_ff=0, num_shared_experts=0, n_groups=1,
                 topk_groups=1, **model) -> ModelConfig:
    """A ModelConfig with an MoE layer from flat test arguments (none without num_experts)."""
    moe = MoEConfig(num_experts=num_experts, top_k=top_k, d_model=model["d_model"],
                    d_ff=moe_d_ff, num_shared_experts=num_shared_experts, n_groups=n_groups,
                    topk_groups=topk_groups) if num_experts else None
    return ModelConfig(**model, moe=moe)
