"""A Flax NNX module around the functional MoE layer, for models written with Flax.

Legend: D model dim, E experts, F expert hidden dim, 2F gate and up side by side.

The router bias is an `RouterBias` variable, not an `nnx.Param`: DeepSeek-V3 updates it outside
the optimizer (`MoE.update_bias`), so optimizers built on `nnx.Param` leave it alone.
"""
from __future__ import annotations

import jax
from flax import nnx

from dropless.config import MoEConfig
from dropless.moe import layer
from dropless.moe import router as rt
from dropless.parallel.mesh import AnyMesh


class RouterBias(nnx.Variable):
    """The aux-loss-free balancing bias: changes which experts are picked, never the weights."""


class MoE(nnx.Module):
    """`y, aux = MoE(cfg, rngs=nnx.Rngs(0))(x)` for x of shape [T, D] or [B, S, D]."""

    def __init__(self, cfg: MoEConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        p = layer.init_params(rngs.params(), cfg)
        self.w_DE = nnx.Param(p["router"]["w_DE"])
        self.bias_E = RouterBias(p["router"]["bias_E"])
        if cfg.prefuse_moe_weights:
            self.w_gate_up_ED2F = nnx.Param(p["experts"]["w_gate_up_ED2F"])
        else:
            self.w_gate_EDF = nnx.Param(p["experts"]["w_gate_EDF"])
            self.w_up_EDF = nnx.Param(p["experts"]["w_up_EDF"])
        self.w_down_EFD = nnx.Param(p["experts"]["w_down_EFD"])
        if cfg.num_shared_experts > 0:
            self.w_shared_gate_DF = nnx.Param(p["shared"]["w_gate_DF"])
            self.w_shared_up_DF = nnx.Param(p["shared"]["w_up_DF"])
            self.w_shared_down_FD = nnx.Param(p["shared"]["w_down_FD"])

    def params_dict(self) -> layer.Params:
        """The functional layer's parameter tree (same names as `dropless.moe.init_params`)."""
        params = {"router": {"w_DE": self.w_DE[...], "bias_E": self.bias_E[...]},
                  "experts": {"w_down_EFD": self.w_down_EFD[...]}}
        if self.cfg.prefuse_moe_weights:
            params["experts"]["w_gate_up_ED2F"] = self.w_gate_up_ED2F[...]
        else:
            params["experts"].update(w_gate_EDF=self.w_gate_EDF[...], w_up_EDF=self.w_up_EDF[...])
        if self.cfg.num_shared_experts > 0:
            params["shared"] = {"w_gate_DF": self.w_shared_gate_DF[...],
                                "w_up_DF": self.w_shared_up_DF[...],
                                "w_down_FD": self.w_shared_down_FD[...]}
        return params

    def __call__(self, x: jax.Array, *, mesh: AnyMesh | None = None) -> tuple[jax.Array, dict]:
        """The layer on x [T, D] or [B, S, D]: (y like x, aux), as `dropless.moe.apply`."""
        return layer.apply(self.params_dict(), x, self.cfg, mesh=mesh)

    def update_bias(self, tokens_per_expert_E: jax.Array) -> None:
        """Apply the DeepSeek-V3 bias rule with `cfg.bias_update_speed` (call once per step)."""
        self.bias_E[...] = rt.update_bias(self.bias_E[...], tokens_per_expert_E,
                                          self.cfg.bias_update_speed)
