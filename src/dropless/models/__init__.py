"""Models built from the MoE layer: the DeepSeek-V3 / Mixtral / Qwen3-MoE decoder, and the
arithmetic model of its parameters and FLOPs (`arithmetic`).

The names below are imported when first used (PEP 562), so that `dropless config show`, which
reads only `arithmetic`, never imports JAX; `forward` and `init_params` bring in the decoder
(and JAX) when asked for.
"""
from __future__ import annotations

import typing

from dropless.runtime.lazy_names import lazy_names

if typing.TYPE_CHECKING:
    from dropless.models.arithmetic import flops_per_token, param_counts
    from dropless.models.decoder import forward, init_params

# each name -> the module it comes from
_HOME = {"flops_per_token": "dropless.models.arithmetic",
         "param_counts": "dropless.models.arithmetic",
         "forward": "dropless.models.decoder", "init_params": "dropless.models.decoder"}
__all__ = sorted(_HOME)

__getattr__, __dir__ = lazy_names(__name__, _HOME, globals())
