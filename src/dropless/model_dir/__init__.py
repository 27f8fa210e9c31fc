"""Every model-folder format dropless reads or writes, in one place (one layer, importing
nothing from `train`).

* `model_dir.folder`: the `hf:DIR` spec (`parse_spec`), a dropless directory's config.json
  (`read_dropless_config`), a run's config.json (`read_run_config`, `saved_run_config`), the
  tokenizer a folder implies (`folder_tokenizer`, `hf_tokenizer`) and what `init_from=` implies
  (`init_from_defaults`). File formats only: no weights, no JAX.
* `model_dir.run_config`: the config.json form of a TrainConfig (`to_dict`, `from_dict`,
  `upgrade`), which `config_file` builds on.
* `model_dir.weights`: the weights of a model folder: the loader of either kind
  (`load_model`), the reader and the writer of a dropless directory (`load_dropless`: a run
  directory's newest checkpoint through `checkpoint.read_params`; `write_dropless`), the dtype
  cast (`cast_like`) and the converters HF <-> dropless (`hf_to_dropless`, `dropless_to_hf`).
* `model_dir.kept_config`: the Hugging Face config.json keys a dropless directory keeps for the
  way back (`hf_kept_config.json`) and what an export writes where it keeps none.

Layer (docs/architecture.md): above `hf` and `checkpoint`, below `presets` / `config_file`
(which read folders through it) and `train`. Importing the package starts no JAX: the weights'
functions import JAX and orbax when called.
"""
from dropless.model_dir.folder import (HF_PREFIX, ModelSpec, data_vocab_size, folder_tokenizer,
                                       hf_model_config, hf_tokenizer, init_from_defaults, is_hf,
                                       names_architectures, parse_spec, prepared_vocab_size,
                                       read_dropless_config, read_json_object, read_run_config,
                                       resolve_tokenizer, saved_preset, saved_run_config,
                                       sentencepiece_howto)
from dropless.model_dir.run_config import from_dict, to_dict, upgrade
from dropless.model_dir.weights import (cast_like, dropless_to_hf, hf_to_dropless, load_dropless,
                                        load_model, tokenizer_files, write_dropless)

__all__ = ["HF_PREFIX", "ModelSpec", "cast_like", "data_vocab_size", "dropless_to_hf",
           "folder_tokenizer", "from_dict", "hf_model_config", "hf_to_dropless", "hf_tokenizer",
           "init_from_defaults", "is_hf", "load_dropless", "load_model", "names_architectures",
           "parse_spec", "prepared_vocab_size", "read_dropless_config", "read_json_object",
           "read_run_config", "resolve_tokenizer", "saved_preset", "saved_run_config",
           "sentencepiece_howto", "to_dict", "tokenizer_files", "upgrade", "write_dropless"]
