"""`check_nan`: stop at the first step whose loss, gradients or new parameters are not finite,
naming the step, the layer and the parameter where the non-finite value first appeared.

Legend: B batch, S sequence (+1 for the batch's next-token column), D model dim.

Detection costs the host nothing: the loop already reads every step's loss and grad_norm, and
grad_norm is finite only when every gradient is. On device `NonFiniteGuard.wrap` adds one
all-finite reduction over the updated parameters and, when anything is not finite, returns the
state it was given (a select, as the overflow guard does). So the state the loop holds after a
bad step is the last good step's: it is checkpointed, and `locate` runs the failing step again,
piece by piece outside the compiled step, to say where the first non-finite value came from:
  1. parameters that are already non-finite (e.g. loaded that way);
  2. else the forward pass: the embedding, then each layer's attention half and FFN/MoE half in
     order, then the output head, then the MTP modules: the first output that is not finite;
  3. else the backward pass: the parameters whose gradients are not finite, the one nearest the
     loss first (the backward pass reaches it first);
  4. else the optimizer update: gradients finite, the new parameters not.
(The pattern, and the `check` the loop calls, are `train.guards`.)
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from dropless.config import TrainConfig
from dropless.train.guards import BEFORE_RECORD, Guard, GuardStop, Tripped

FLAG = "nonfinite"


class NonFiniteError(GuardStop):
    """A step produced a non-finite loss, gradient or parameter under check_nan=true; the run
    stopped at the last good step, which was checkpointed."""


def _all_finite(tree: Any) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
              if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def _name(path) -> str:
    return jax.tree_util.keystr(path, simple=True, separator="/")


def nonfinite_leaves(tree: Any) -> list[tuple[str, int]]:
    """[(path, number of non-finite values)] of the floating leaves of `tree`, in tree order.
    Counted on device in one jitted call: only the counts come to the host."""
    flat = [(path, x) for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
            if jnp.issubdtype(x.dtype, jnp.inexact)]
    counts = jax.device_get(_count_nonfinite([x for _, x in flat]))
    return [(_name(path), int(n)) for (path, _), n in zip(flat, counts) if n]


@jax.jit
def _count_nonfinite(xs: list[jax.Array]) -> list[jax.Array]:
    return [jnp.sum(~jnp.isfinite(x)) for x in xs]


class NonFiniteGuard(Guard):
    """The loop's side of check_nan (inactive, every method a pass-through, otherwise). Read
    after every step, from its metrics, before the step is recorded: a refused step never is.
    `opt` and `mesh` (the step's optimizer and model mesh) are what `locate` runs the step
    again with."""

    stage = BEFORE_RECORD
    error = NonFiniteError

    def __init__(self, cfg: TrainConfig, *, opt=None, mesh=None):
        self.cfg, self.opt, self.mesh = cfg, opt, mesh
        self.active = cfg.check_nan

    def wrap(self, step_fn):
        """step_fn(state, batch) -> (state, metrics), made to return its input state when the
        loss, a gradient (via grad_norm) or a new parameter is not finite; metrics gain
        `nonfinite` (1: the step was not applied)."""
        if not self.active:
            return step_fn

        def guarded(state, batch):
            new, metrics = step_fn(state, batch)
            ok = (jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"])
                  & _all_finite(new["params"]))
            new = jax.tree.map(lambda old, upd: jnp.where(ok, upd, old), state, new)
            metrics[FLAG] = (~ok).astype(jnp.int32)
            return new, metrics

        return guarded

    def tripped(self, state: dict, step: int, metrics) -> Tripped | None:
        """Step `step` itself was refused when its metrics say so (read already: no sync)."""
        return Tripped(bad=step) if int(metrics.get(FLAG, 0)) else None

    def describe(self, found: Tripped, *, state, metrics, batch) -> str:
        """The loss and grad_norm of the refused step and where its first non-finite value
        came from (`locate`: runs the step again, piece by piece)."""
        where = locate(state["params"], state["opt_state"], batch, cfg=self.cfg, opt=self.opt,
                       mesh=self.mesh)
        return (f"step {found.bad}: loss {float(metrics['loss']):.4g}, grad_norm "
                f"{float(metrics['grad_norm']):.4g}; {where}; the step was not applied")

    def saved_words(self, good: int, run_dir) -> str:
        return (f"; step {good}, the last with finite values, is checkpointed in {run_dir} "
                "(its parameters may already be on the way to diverging)")


def _bad(x) -> bool:
    return not bool(jnp.all(jnp.isfinite(x)))


def _first(names: list[tuple[str, int]], more: str = "") -> str:
    head = ", ".join(f"{p} ({n} values)" for p, n in names[:3])
    rest = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return head + rest + more


def _backward_order(name: str) -> tuple:
    """Sort key: the backward pass meets MTP modules, then the output head, then the layers
    from the last to the first, then the embedding."""
    parts = name.split("/")
    if parts[0] == "mtp":
        return (0, -int(parts[1]))
    if parts[0] in ("final_norm", "lm_head"):
        return (1, 0)
    if parts[0] == "layers":
        return (2, -int(parts[1]))
    return (3, 0)


def locate(params: Any, opt_state: Any, batch_BS1: jax.Array, *, cfg: TrainConfig, opt,
           mesh: Any = None) -> str:
    """Where a step from `params` on `batch_BS1` first produces a non-finite value, as words
    (see the module docstring for the order of the checks). `params` in any layout."""
    from dropless.models.scan import to_canonical_layout
    from dropless.train import step as step_lib
    canon = to_canonical_layout(params)
    bad = nonfinite_leaves(canon)
    if bad:
        return f"parameters were already non-finite before the step: {_first(bad)}"
    k = cfg.gradient_accumulation_steps
    parts = [batch_BS1] if k == 1 else [
        jax.tree.map(lambda a, m=m: a[m], step_lib.micro_batches(batch_BS1, k))
        for m in range(k)]
    for m, part in enumerate(parts, start=1):
        forward = _locate_forward(canon, step_lib.step_inputs(part, cfg), cfg.model, mesh)
        if forward:
            where = f" (micro-batch {m} of {k})" if k > 1 else ""
            return f"first non-finite value in the forward pass{where}: {forward}"
    metrics, grads = jax.jit(functools.partial(step_lib.loss_and_grads, cfg=cfg, mesh=mesh))(
        params, batch_BS1)
    value = metrics["loss"]
    if _bad(value):
        return "the forward pass is finite but the loss is not (the balance losses?)"
    bad = sorted(nonfinite_leaves(to_canonical_layout(grads)),
                 key=lambda pn: _backward_order(pn[0]))
    if bad:
        return ("forward pass finite; first non-finite value in the backward pass: the "
                f"gradient of {_first(bad)}")
    new = jax.jit(lambda g, s, p: jax.tree.map(
        lambda a, u: a + u, p, opt.update(g, s, p)[0]))(grads, opt_state, params)
    bad = nonfinite_leaves(to_canonical_layout(new))
    if bad:
        return (f"loss and gradients finite; the optimizer update made {_first(bad)} "
                f"non-finite (learning_rate={cfg.learning_rate})")
    return "not reproduced when the step was run again piece by piece"


def _locate_forward(params: dict, inputs, m, mesh) -> str:
    """The first non-finite output of the forward pass on `inputs` (`step.StepInputs`), in words
    ("" when all are finite). Each piece is jitted on its own; same-kind layers share one
    compiled function."""
    from dropless.models import decoder
    dt = jnp.dtype(m.dtype)
    tokens_BS, seg_BS = inputs.tokens_BS, inputs.segment_ids_BS
    cos, sin = decoder.rope_for(tokens_BS, m, inputs.positions_BS)
    x = params["embed"]["w_VD"][tokens_BS].astype(dt)
    if _bad(x):
        return "the embedding of the batch's tokens"
    attn = jax.jit(functools.partial(decoder.attention_residual, cfg=m))
    ffn = jax.jit(functools.partial(decoder.ffn_residual, cfg=m, mesh=mesh))
    for i, p in enumerate(params["layers"]):
        x = attn(p, x, cos, sin, seg_BS)
        if _bad(x):
            return f"layer {i}, attention (layers/{i}/attn)"
        x, _ = ffn(p, x)
        if _bad(x):
            part = "MoE" if "moe" in p else "dense FFN"
            return f"layer {i}, {part} (layers/{i}/{'moe' if 'moe' in p else 'ffn'})"
    logits = jax.jit(functools.partial(decoder.logits_from_hidden, cfg=m))(
        params, x, params["final_norm"]["w_D"])
    if _bad(logits):
        return "the output head (final_norm, lm_head)"
    if params.get("mtp"):
        outs, _ = jax.jit(functools.partial(decoder.mtp_logits, cfg=m, mesh=mesh))(
            params, x, tokens_BS, segment_ids_BS=seg_BS, positions_BS=inputs.positions_BS)
        for k, lg in enumerate(outs, start=1):
            if _bad(lg):
                return f"MTP module {k} (mtp/{k - 1})"
    return ""
