"""Typed, frozen, keyword-only configs, validated on construction.

Every error names the field and the value, e.g. `MoEConfig.top_k=9 must be <= num_experts=8`.
Every field carries its one-line description (`described`), from which `config_docs` writes the
configuration reference, docs/config.md.

`names` holds the values fields take, `fields` what every field shares (its description, its
scalar types, the checks), and one module each holds `MoEConfig`, `ModelConfig`, `MeshConfig`
and `TrainConfig`; import them from here.
"""
from dropless.config.fields import DOC, SCALAR_WORDS, described, scalar_fields, scalar_type_error
from dropless.config.mesh import MeshConfig
from dropless.config.model import ModelConfig
from dropless.config.moe import MoEConfig
from dropless.config.names import (ATTENTION_KINDS, DISPATCH_STRATEGIES, DISPATCHERS,
                                   GMM_QUANTIZATIONS, INIT_FIELDS, INIT_SCHEMES, LAYER_KINDS,
                                   MESH_AXES, OVERFLOW_POLICIES, PACKINGS,
                                   REMAT_CHECKPOINT_POLICIES, REMAT_POLICIES, ROPE_TYPES,
                                   SCORE_FUNCS)
from dropless.config.train import TrainConfig

__all__ = ["ModelConfig", "MoEConfig", "MeshConfig", "TrainConfig",
           "DOC", "described", "SCALAR_WORDS", "scalar_fields", "scalar_type_error",
           "SCORE_FUNCS", "GMM_QUANTIZATIONS", "DISPATCH_STRATEGIES", "DISPATCHERS",
           "OVERFLOW_POLICIES", "PACKINGS", "INIT_SCHEMES", "INIT_FIELDS", "MESH_AXES",
           "ATTENTION_KINDS", "ROPE_TYPES", "LAYER_KINDS", "REMAT_CHECKPOINT_POLICIES",
           "REMAT_POLICIES"]
