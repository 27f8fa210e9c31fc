"""Every model-folder format dropless reads or writes, in one place.

* `model_dir.folder` (re-exported here): the `hf:DIR` spec (`parse_spec`), a dropless
  directory's config.json (`read_dropless_config`), a run's config.json (`read_run_config`,
  `saved_run_config`), the tokenizer a folder implies (`folder_tokenizer`, `hf_tokenizer`) and
  what `init_from=` implies (`init_from_defaults`). File formats only: no weights, no JAX.
* `model_dir.weights`: the weights: the one reader (`load_dropless`, `load_model`) and the one
  writer (`write_dropless`) of a dropless directory, and the converters HF <-> dropless
  (`hf_to_dropless`, `dropless_to_hf`).

Layers: `folder` sits above `hf` and below `presets` / `config_file` (which read folders through
it); `weights` sits above `config_file`, `models` and `hf`, and imports `train.checkpoint` and
`train.step` to restore a run directory's orbax checkpoint (it is imported by `train.init_from`
and the CLI, never by `folder`, `presets` or `config_file`: no import circle). This package
module imports `folder` only, so `config_file` can import it.
"""
from dropless.model_dir.folder import (HF_PREFIX, ModelSpec, folder_tokenizer, hf_model_config,
                                       hf_tokenizer, init_from_defaults, is_hf,
                                       names_architectures, parse_spec, read_dropless_config,
                                       read_json_object, read_run_config, saved_preset,
                                       saved_run_config, sentencepiece_howto)

__all__ = ["HF_PREFIX", "ModelSpec", "folder_tokenizer", "hf_model_config", "hf_tokenizer",
           "init_from_defaults", "is_hf", "names_architectures", "parse_spec",
           "read_dropless_config", "read_json_object", "read_run_config", "saved_preset",
           "saved_run_config", "sentencepiece_howto"]
