"""dropless: Mixture-of-Experts training in JAX without dropping tokens."""
from dropless import moe, ops
from dropless.config import MeshConfig, ModelConfig, MoEConfig, TrainConfig
from dropless.ops import grouped_matmul, grouped_matmul_backends

__version__ = "0.1.0"
__all__ = ["MoEConfig", "MeshConfig", "ModelConfig", "TrainConfig", "moe", "ops",
           "grouped_matmul", "grouped_matmul_backends"]
