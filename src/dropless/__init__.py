"""dropless: Mixture-of-Experts training in JAX without dropping tokens.

The names below are imported when first used (PEP 562), so that `import dropless.<module>` runs
only what that module needs: the command line's `report` and `config` (but for a Hugging Face
folder's model, `--preset hf:DIR`, read through `dropless.hf`), and `data prepare`'s tokenizing
processes, never import JAX (tests/cli/test_main_imports.py).
"""
from __future__ import annotations

import typing

from dropless.runtime.lazy_names import lazy_names

if typing.TYPE_CHECKING:
    from dropless import moe, ops
    from dropless.config import MeshConfig, ModelConfig, MoEConfig, TrainConfig
    from dropless.ops import grouped_matmul, grouped_matmul_backends

__version__ = "0.1.0"
# each name -> the module it comes from (a package's own submodule: itself)
_HOME = {"MoEConfig": "dropless.config", "MeshConfig": "dropless.config",
         "ModelConfig": "dropless.config", "TrainConfig": "dropless.config",
         "moe": "dropless.moe", "ops": "dropless.ops",
         "grouped_matmul": "dropless.ops", "grouped_matmul_backends": "dropless.ops"}
__all__ = list(_HOME)

__getattr__, __dir__ = lazy_names(__name__, _HOME, globals())
