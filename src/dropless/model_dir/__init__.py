"""Every model-folder format dropless reads or writes, in one place.

* `model_dir.folder` (re-exported here): the `hf:DIR` spec (`parse_spec`), a dropless
  directory's config.json (`read_dropless_config`), a run's config.json (`read_run_config`,
  `saved_run_config`), the tokenizer a folder implies (`folder_tokenizer`, `hf_tokenizer`) and
  what `init_from=` implies (`init_from_defaults`). File formats only: no weights, no JAX.
* `model_dir.weights`: the weights of a model folder: the loader of either kind (`load_model`),
  the one writer of a dropless directory (`write_dropless`), and the converters HF <-> dropless
  (`hf_to_dropless`, `dropless_to_hf`). The one reader of a dropless directory's weights is
  `train.init_from.load_dropless`: a run directory's weights are a training checkpoint, read by
  the trainer's restore.

Layers (docs/architecture.md): `folder` sits above `hf` and below `presets` / `config_file`
(which read folders through it); `weights` sits above `train` (it is imported by the CLI only).
This package module imports `folder` only, so `config_file` can import it.
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
