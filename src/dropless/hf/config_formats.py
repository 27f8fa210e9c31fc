"""Both `config.json` formats of transformers, read into one canonical dict, with every value
checked for its type before use.

transformers 4.x and 5.x write the same model differently (read from their configuration
classes, `transformers/models/{deepseek_v3,mixtral,qwen3_moe}/configuration_*.py` and
`modeling_rope_utils.py`, 4.57.6, 5.24.0 and 5.25.0):

| what                | 4.x                                 | 5.x                                 |
|---------------------|-------------------------------------|-------------------------------------|
| RoPE base           | top-level `rope_theta`              | `rope_parameters.rope_theta`        |
| RoPE scaling (YaRN) | `rope_scaling` {type/rope_type,...} | `rope_parameters` {rope_type, ...}  |
| Qwen3-MoE experts   | `num_experts`                       | `num_local_experts` (attribute_map) |
| DeepSeek-V3 experts | `n_routed_experts`                  | same (alias `num_local_experts`)    |
| DeepSeek-V3 MTP     | `num_nextn_predict_layers`          | same (alias `num_mtp_layers`)       |
| dtype               | `torch_dtype` (`dtype` from 4.56)   | `dtype` (`torch_dtype` still read)  |

`canonical(hf)` turns either into the 4.x spelling; where one file holds both spellings with
different values it refuses, naming both keys (transformers itself would silently prefer one: 5.x
takes `rope_scaling` over `rope_parameters` and `dtype` over `torch_dtype`).

`Fields` reads the canonical dict: a required key that is missing, a value of the wrong type or
a null where a number goes is a `BadConfig` naming the file, the key and the value. Missing
optional keys take transformers' class defaults (`DEFAULTS`, the same in 4.57.6, 5.24.0 and
5.25.0; tests/hf/test_config_formats.py checks them against
tests/fixtures/hf/transformers_defaults.json, which tools/make_hf_fixtures.py writes from each
version).
"""
from __future__ import annotations

from typing import Any

DEEPSEEK, MIXTRAL, QWEN3 = "DeepseekV3ForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM"
ARCHITECTURES = (DEEPSEEK, MIXTRAL, QWEN3)
MODEL_TYPES = {DEEPSEEK: "deepseek_v3", MIXTRAL: "mixtral", QWEN3: "qwen3_moe"}

# transformers' defaults for the optional keys we read (4.57.6 == 5.24.0 == 5.25.0; Mixtral's
# RoPE base is its `default_theta` / `rope_theta` default 1e6, the others 1e4)
DEFAULTS: dict[str, dict[str, Any]] = {
    DEEPSEEK: {"n_shared_experts": 1, "routed_scaling_factor": 2.5,
               "q_lora_rank": 1536, "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3,
               "norm_topk_prob": True, "hidden_act": "silu", "rms_norm_eps": 1e-6,
               "tie_word_embeddings": False, "rope_theta": 10000.0, "rope_interleave": True,
               "attention_bias": False, "max_position_embeddings": 4096},
    MIXTRAL: {"num_key_value_heads": 8, "head_dim": None, "hidden_act": "silu",
              "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "rope_theta": 1e6,
              "sliding_window": None, "router_aux_loss_coef": 0.001,
              "max_position_embeddings": 131072},
    QWEN3: {"num_key_value_heads": 4, "head_dim": None, "norm_topk_prob": False,
            "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
            "rope_theta": 10000.0, "attention_bias": False, "sliding_window": None,
            "use_sliding_window": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "router_aux_loss_coef": 0.001, "max_position_embeddings": 32768},
}
# one concept, two spellings: (4.x / canonical key, other key) per architecture
ALIASES: dict[str, tuple[tuple[str, str], ...]] = {
    DEEPSEEK: (("n_routed_experts", "num_local_experts"),
               ("num_nextn_predict_layers", "num_mtp_layers"), ("torch_dtype", "dtype")),
    MIXTRAL: (("num_local_experts", "num_experts"), ("torch_dtype", "dtype")),
    QWEN3: (("num_experts", "num_local_experts"), ("torch_dtype", "dtype")),
}
ROPE_GLOBAL_KEYS = ("rope_theta", "partial_rotary_factor")   # 5.x keeps them in rope_parameters
REQUIRED = object()


class UnsupportedCheckpoint(ValueError):
    """A checkpoint (or a config to save) uses a feature we do not implement."""


class BadCheckpoint(ValueError):
    """A checkpoint file that is not what transformers writes: a truncated or unparsable
    safetensors file, a tensor of the wrong dtype or shape, an index that does not match its
    shards. The message names the file and the tensor or key."""


class BadConfig(BadCheckpoint):
    """A config.json that is not what transformers writes: a missing required key, a value of
    the wrong type, two keys that contradict each other, a file that is not JSON."""


def read_json(path) -> Any:
    """The JSON in `path`; BadConfig naming the file (and where the text stops being JSON)."""
    import json
    try:
        return json.loads(open(path, "rb").read())
    except json.JSONDecodeError as e:
        raise BadConfig(f"{path}: is not valid JSON ({e.msg} at line {e.lineno} column "
                        f"{e.colno})") from None
    except UnicodeDecodeError as e:
        raise BadConfig(f"{path}: is not UTF-8 text ({e.reason} at byte {e.start})") from None


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def architecture(hf: dict, where: str = "config.json") -> str:
    """The one supported architecture named in `architectures` (or, when that key is absent, by
    `model_type`); raises naming the value, or both keys when they contradict each other."""
    archs = hf.get("architectures")
    mtype = hf.get("model_type")
    if archs is None and mtype in MODEL_TYPES.values():
        return next(a for a, t in MODEL_TYPES.items() if t == mtype)
    if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise UnsupportedCheckpoint(f"{where}: architectures={_show(archs)} must name one of "
                                    f"{ARCHITECTURES}")
    arch = archs[0]
    if mtype is not None and mtype != MODEL_TYPES[arch]:
        raise BadConfig(f"{where}: model_type={mtype!r} contradicts architectures={archs!r} "
                        f"(which is model_type {MODEL_TYPES[arch]!r})")
    return arch


def _rope_object(hf: dict, key: str, where: str) -> dict | None:
    """hf[key] (rope_scaling or rope_parameters) checked as a rope object, or None."""
    value = hf.get(key)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise BadConfig(f"{where}: {key}={_show(value)} must be an object such as "
                        f'{{"rope_type": "yarn", "factor": 40, ...}} or null')
    kinds = {value[k] for k in ("type", "rope_type") if k in value}
    if len(kinds) > 1:
        raise BadConfig(f"{where}: {key}.type={value['type']!r} and {key}.rope_type="
                        f"{value['rope_type']!r} contradict each other")
    return value


def _canonical_rope(hf: dict, arch: str, where: str) -> dict:
    """rope_theta (top level) and rope_scaling (None for plain RoPE) from either format."""
    scaling = _rope_object(hf, "rope_scaling", where)
    params = _rope_object(hf, "rope_parameters", where)
    out: dict[str, Any] = {}
    for key in ROPE_GLOBAL_KEYS:   # top level, in rope_parameters, or (5.x) in rope_scaling
        found = {name: d[key] for name, d in (("rope_parameters", params),
                                              ("rope_scaling", scaling)) if d and key in d}
        if key in hf:
            found[key] = hf[key]
        values = list(found.values())
        if any(v != values[0] for v in values[1:]):   # 1e6 == 1000000: not a contradiction
            shown = " and ".join(f"{k if k == key else k + '.' + key}={_show(v)}"
                                 for k, v in found.items())
            raise BadConfig(f"{where}: {shown} contradict each other")
        if found:
            out[key] = next(iter(found.values()))
    strip = (lambda d: None if d is None else
             {k: v for k, v in d.items() if k not in ROPE_GLOBAL_KEYS})
    scaling, params = strip(scaling), strip(params)
    if scaling is not None and params is not None and scaling != params:
        raise BadConfig(f"{where}: rope_scaling={_show(scaling)} and rope_parameters="
                        f"{_show(params)} contradict each other (transformers 4.x reads "
                        "rope_scaling, 5.x rope_parameters; keep one)")
    chosen = scaling if scaling is not None else params
    if chosen is not None and chosen.get("rope_type", chosen.get("type")) in (None, "default") \
            and set(chosen) <= {"type", "rope_type"}:
        chosen = None
    out.setdefault("rope_theta", DEFAULTS[arch]["rope_theta"])
    out["rope_scaling"] = chosen
    return out


def canonical(hf: dict, where: str = "config.json") -> dict:
    """`hf` in the 4.x spelling (see the module table): aliases folded into one key, RoPE
    base and scaling out of `rope_parameters`. Raises BadConfig naming both keys when the
    two spellings disagree, UnsupportedCheckpoint for an unknown architecture."""
    if not isinstance(hf, dict):
        raise BadConfig(f"{where}: must hold a JSON object, not {type(hf).__name__}")
    arch = architecture(hf, where)
    out = {k: v for k, v in hf.items() if k not in ("rope_parameters", "rope_scaling")
           and k not in ROPE_GLOBAL_KEYS}
    for main, other in ALIASES[arch]:
        if main in hf and other in hf and hf[main] != hf[other]:
            raise BadConfig(f"{where}: {main}={_show(hf[main])} and {other}={_show(hf[other])} "
                            "contradict each other")
        if other in out:   # equal to out[main] when both are there
            out.setdefault(main, out.pop(other))
    out.update(_canonical_rope(hf, arch, where))
    out["architectures"] = [arch]
    return out


class Fields:
    """Typed reads of a canonical config dict: each raises BadConfig naming file, key and value."""

    def __init__(self, hf: dict, arch: str, where: str = "config.json"):
        self.hf, self.arch, self.where = hf, arch, where

    def _raw(self, key: str, default: Any) -> Any:
        if key in self.hf:
            return self.hf[key]
        if default is REQUIRED:
            default = DEFAULTS[self.arch].get(key, REQUIRED)
        if default is REQUIRED:
            raise BadConfig(f"{self.where}: {key} is missing (required for {self.arch})")
        return default

    def _bad(self, key: str, value: Any, want: str) -> BadConfig:
        return BadConfig(f"{self.where}: {key}={_show(value)} must be {want}")

    def int(self, key: str, default: Any = REQUIRED, *, nullable: bool = False, low: int = 1
            ) -> int | None:
        """An integer >= `low` (JSON 4 or 4.0); None only when `nullable`."""
        v = self._raw(key, default)
        if v is None and nullable:
            return None
        ok = isinstance(v, int) or (isinstance(v, float) and v.is_integer())
        if isinstance(v, bool) or not ok or v < low:
            raise self._bad(key, v, f"an integer >= {low}" + (" or null" if nullable else ""))
        return int(v)

    def float(self, key: str, default: Any = REQUIRED, *, positive: bool = False) -> float:
        v = self._raw(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (positive and v <= 0):
            raise self._bad(key, v, "a positive number" if positive else "a number")
        return float(v)

    def bool(self, key: str, default: Any = REQUIRED) -> bool:
        v = self._raw(key, default)
        if not isinstance(v, bool):
            raise self._bad(key, v, "true or false")
        return v

    def int_list(self, key: str, default: Any = REQUIRED) -> list[int]:
        v = self._raw(key, default)
        v = [] if v is None else v
        if not isinstance(v, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                               for i in v):
            raise self._bad(key, v, "a list of layer indices")
        return v

    def get(self, key: str, default: Any = REQUIRED) -> Any:
        """The raw value (any type), for keys compared with a fixed value."""
        return self._raw(key, default)


__all__ = ["canonical", "architecture", "Fields", "BadConfig", "BadCheckpoint", "read_json",
           "UnsupportedCheckpoint",
           "DEFAULTS", "ALIASES", "ARCHITECTURES", "MODEL_TYPES", "DEEPSEEK", "MIXTRAL", "QWEN3"]
