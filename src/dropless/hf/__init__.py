"""Hugging Face checkpoints: `load(path) -> (ModelConfig, params)` and `save(cfg, params, path)`
for DeepseekV3ForCausalLM, MixtralForCausalLM and Qwen3MoeForCausalLM, in the config formats of
transformers 4.x and 5.x (see docs/hf.md)."""
from dropless.hf.config_formats import BadCheckpoint, BadConfig, UnsupportedCheckpoint
from dropless.hf.convert import load, read_config
from dropless.hf.destination import DestinationError
from dropless.hf.round_trip import NotCarriedWarning
from dropless.hf.save import save

__all__ = ["load", "save", "read_config", "UnsupportedCheckpoint", "BadCheckpoint", "BadConfig",
           "DestinationError", "NotCarriedWarning"]
