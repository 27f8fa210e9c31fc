"""The training step: loss (cross-entropy + MTP + MoE balance losses), AdamW with warmup +
cosine and global-norm clipping, then the aux-loss-free router-bias update outside the optimizer.

Legend: B batch, S sequence, V vocabulary, E experts, Lm MoE layers.

State is a plain dict pytree {"params", "opt_state", "step", "rng"} so it checkpoints as is.

The step takes a `data.batch.Batch` (or, the same as `batch.from_windows` of it, a [B, S + 1]
array of stream windows). Under `TrainConfig.packing` "documents" and "pad" the model sees the
batch's segment ids and positions (attention and rope per document) and the loss is the mean
over `loss_mask_BS`; under "stream" (and for a windows array) attention runs across the row
with positions 0..S-1 and every target counts (sft needs "documents" or "pad": the config
refuses "stream" with it): the computation of the runs made before packing (the loss and gradients bit for bit, tested; a
Batch's eval loss may differ from a windows array's in the last bit, where XLA fuses the mean
over targets that arrive as their own array differently). The choice is made at trace time
from the config and the batch's type, never from its values.

Gradient accumulation (`TrainConfig.gradient_accumulation_steps` k > 1): the step's batch is
split into k micro-batches (rows m, m + k, m + 2k, ...: each device's rows stay on it), one
forward and backward pass each under a lax.scan, their float32 gradients added up, then the
optimizer runs once. Each micro-batch divides its cross-entropy sums by the whole batch's
target counts (`TargetCounts`), so the cross-entropy terms and their gradients are the whole
batch's to rounding; the balance losses are each micro-batch's own, averaged (as MaxText
does), and the router-bias update reads the whole batch's expert loads.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from dropless.config import TrainConfig
from dropless.data.batch import Batch
from dropless.models import attention, decoder
from dropless.moe import update_bias
from dropless.moe.dispatch.overlap import NOT_SUMMED
from dropless.parallel.mesh import AnyMesh
from dropless.train.cross_entropy import mean_nll, nll_from_hidden

State = dict[str, Any]


def lr_schedule(cfg: TrainConfig) -> optax.Schedule:
    """Linear warmup to learning_rate, cosine decay to learning_rate * min_lr_ratio at
    `lr_decay_steps` (0: at `steps`), constant after that."""
    horizon = cfg.lr_decay_steps or cfg.steps
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
        decay_steps=max(horizon, cfg.warmup_steps + 1),
        end_value=cfg.learning_rate * cfg.min_lr_ratio)


def _is_frozen(path) -> bool:
    """Router biases are not trained by the optimizer (DeepSeek-V3 aux-loss-free balancing)."""
    return any(getattr(k, "key", None) == "bias_E" for k in path)


def _no_decay(path) -> bool:
    """Norm weights (1-D *_D / *_Q / *_L / *_K vectors) and biases are not weight-decayed."""
    last = getattr(path[-1], "key", "")
    return "norm" in last or last == "w_D" or _is_frozen(path)


def make_optimizer(cfg: TrainConfig, params) -> optax.GradientTransformation:
    """AdamW (decoupled decay on matrices only) with clipping; router biases get zero updates."""
    labels = jax.tree_util.tree_map_with_path(
        lambda p, _: "frozen" if _is_frozen(p) else "train", params)
    decay_mask = jax.tree_util.tree_map_with_path(lambda p, _: not _no_decay(p), params)
    adamw = optax.adamw(lr_schedule(cfg), b1=cfg.adam_b1, b2=cfg.adam_b2, eps=cfg.adam_eps,
                        weight_decay=cfg.weight_decay, mask=decay_mask)
    chain = [optax.clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip > 0 else []
    return optax.multi_transform({"train": optax.chain(*chain, adamw),
                                  "frozen": optax.set_to_zero()}, labels)


def init_state(cfg: TrainConfig) -> tuple[State, optax.GradientTransformation]:
    """Fresh parameters and optimizer state from cfg.seed."""
    k_init, k_run = jax.random.split(jax.random.PRNGKey(cfg.seed))
    params = decoder.init_params(k_init, cfg.model)
    opt = make_optimizer(cfg, params)
    return new_state(params, opt, k_run), opt


def new_state(params, opt: optax.GradientTransformation, rng: jax.Array) -> State:
    """The state at step 0 of `params` under `opt` (fresh optimizer state), `rng` its key."""
    return {"params": params, "opt_state": opt.init(params),
            "step": jnp.zeros((), jnp.int32), "rng": rng}


class StepInputs(NamedTuple):
    """What the model and the loss read of a batch; the document fields are None where the
    computation does not use them (see the module docstring)."""
    tokens_BS: jax.Array
    targets_BS: jax.Array
    segment_ids_BS: jax.Array | None
    positions_BS: jax.Array | None
    loss_mask_BS: jax.Array | None


class TargetCounts(NamedTuple):
    """What a micro-batch's loss divides by: the targets the whole step's batch counts for the
    cross-entropy and for each MTP depth, and the number of micro-batches (the balance losses'
    share)."""
    ce: jax.Array                  # float32 []
    mtp: tuple[jax.Array, ...]     # float32 [] per MTP depth
    micro_batches: int


def attention_kernel(cfg: TrainConfig) -> str:
    """What the attention core runs as in this run in this process, "cudnn" or "xla"
    (models.attention.kernel_for at the run's sequence; rows carry segment ids unless
    packing=stream, `step_inputs`). Raises ops.attention.KernelUnavailable (a ValueError) for a
    model.attention_kernel that cannot run here."""
    return attention.kernel_for(cfg.model, cfg.seq_len, packed=cfg.packing != "stream")


def step_inputs(batch: Batch | jax.Array, cfg: TrainConfig) -> StepInputs:
    """The model's and the loss's view of `batch` (a Batch, or [B, S + 1] stream windows)
    under cfg.packing. Raises ValueError for anything else."""
    if isinstance(batch, Batch):
        if cfg.packing == "stream":
            return StepInputs(batch.tokens_BS, batch.targets_BS, None, None, None)
        return StepInputs(batch.tokens_BS, batch.targets_BS, batch.segment_ids_BS,
                          batch.positions_BS, batch.loss_mask_BS)
    if getattr(batch, "ndim", None) != 2:
        raise ValueError(f"a batch must be a data.batch.Batch or a [batch, seq + 1] array of "
                         f"token windows; got {type(batch).__name__}"
                         f"{tuple(getattr(batch, 'shape', ()))}")
    return StepInputs(batch[:, :-1], batch[:, 1:], None, None, None)


def mtp_mask(x: StepInputs, k: int) -> jax.Array:
    """[B, S] mask of MTP depth k's targets (target i + k at position i): inside the row
    (i < S - k), and, where the batch says, counted by the loss mask at i + k and in the same
    segment as position i (so no depth predicts across a document boundary)."""
    s = x.tokens_BS.shape[1]
    inside = jnp.broadcast_to((jnp.arange(s) < s - k)[None, :], x.targets_BS.shape)
    if x.loss_mask_BS is None and x.segment_ids_BS is None:
        return inside
    mask = inside.astype(jnp.float32)
    if x.loss_mask_BS is not None:
        mask = mask * jnp.roll(x.loss_mask_BS, -k, axis=1).astype(jnp.float32)
    if x.segment_ids_BS is not None:
        same = jnp.roll(x.segment_ids_BS, -k, axis=1) == x.segment_ids_BS
        mask = mask * same.astype(jnp.float32)
    return mask


def target_counts(batch: Batch | jax.Array, cfg: TrainConfig) -> TargetCounts:
    """The targets `batch` counts for the cross-entropy and for each MTP depth (`step_inputs`,
    `mtp_mask`), for splitting it into cfg.gradient_accumulation_steps micro-batches."""
    x = step_inputs(batch, cfg)
    ce = (jnp.asarray(x.targets_BS.size, jnp.float32) if x.loss_mask_BS is None
          else jnp.sum(x.loss_mask_BS.astype(jnp.float32)))
    mtp = tuple(jnp.sum(mtp_mask(x, k).astype(jnp.float32))
                for k in range(1, cfg.model.mtp_depth + 1))
    return TargetCounts(ce, mtp, cfg.gradient_accumulation_steps)


def real_tokens(batch: Batch | jax.Array, cfg: TrainConfig) -> jax.Array:
    """int32 []: the positions of `batch` that hold a document's token (segment id != 0, as
    `step_inputs` reads it), whether or not their target counts in the loss (a document's last
    token, an SFT prompt); every position where the rows carry no segment ids ("stream")."""
    x = step_inputs(batch, cfg)
    if x.segment_ids_BS is None:
        return jnp.asarray(x.tokens_BS.size, jnp.int32)
    return jnp.sum(x.segment_ids_BS != 0, dtype=jnp.int32)


def loss_fn(params, batch: Batch | jax.Array, cfg: TrainConfig, mesh: AnyMesh | None = None,
            counts: TargetCounts | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Objective = CE + mtp_loss_coef * mean MTP CE + MoE balance losses (aux["loss"] summed:
    the decoder's `moe_loss` and the MTP blocks' `mtp_moe_loss`, each a metric);
    the CE terms are means over the targets the loss mask counts (`step_inputs`).
    `mesh`: the trainer's (`parallel.mesh.train_mesh`: the mesh with its node size).
    `counts`: `batch` is one of `counts.micro_batches` micro-batches of a step whose batch
    counts these targets: the CE terms are its sums over those counts and the balance losses
    are divided by the number of micro-batches, so the micro-batches' objectives (and
    `ce_loss`, `mtp_loss`, `loss`) add up to the step's."""
    m = cfg.model
    x = step_inputs(batch, cfg)
    share = (lambda v: v) if counts is None else (lambda v: v / counts.micro_batches)
    docs = {"segment_ids_BS": x.segment_ids_BS, "positions_BS": x.positions_BS}
    h, aux = decoder.hidden(params, x.tokens_BS, m, **docs, mesh=mesh, remat=cfg.remat)
    nll = nll_from_hidden(params, h, params["final_norm"]["w_D"], x.targets_BS, m,
                          cfg.num_vocab_tiling)
    ce = mean_nll(nll, x.loss_mask_BS, None if counts is None else counts.ce)
    total = ce + share(aux["moe_loss"])
    metrics = {"ce_loss": ce, **aux}
    if m.mtp_depth:
        mtp, mtp_aux = decoder.mtp_hidden(params, h, x.tokens_BS, m, **docs, mesh=mesh,
                                           remat=cfg.remat)
        losses = []
        for k, (h_k, module) in enumerate(zip(mtp, params["mtp"]), start=1):
            targets = jnp.roll(x.targets_BS, -k, axis=1)
            nll = nll_from_hidden(params, h_k, module["out_norm_D"], targets, m,
                                  cfg.num_vocab_tiling)
            losses.append(mean_nll(nll, mtp_mask(x, k),
                                   None if counts is None else counts.mtp[k - 1]))
        metrics["mtp_loss"] = sum(losses) / len(losses)
        metrics["mtp_moe_loss"] = mtp_aux["moe_loss"]   # the MTP blocks' own balance losses
        total = total + m.mtp_loss_coef * metrics["mtp_loss"] + share(mtp_aux["moe_loss"])
        for k in ("tokens_per_expert_LE", "dropped_rows_L", "sufficient_buffer_factor_L"):
            if k in mtp_aux:   # the MTP blocks' own MoE layers
                metrics[f"mtp_{k}"] = mtp_aux[k]
    metrics["loss"] = total
    return total, metrics


def _update_biases(params, metrics, cfg: TrainConfig):
    """bias_E += speed * sign(mean load - load) for every MoE layer (and MTP MoE block)."""
    moe = cfg.model.moe
    if moe is None or moe.bias_update_speed == 0:
        return params
    params = jax.tree_util.tree_map(lambda x: x, params)  # shallow structural copy
    rows = iter(metrics.get("tokens_per_expert_LE", []))
    for blk in params.get("layers", []):
        if "moe" in blk:
            r = blk["moe"]["router"]
            r["bias_E"] = update_bias(r["bias_E"], next(rows), moe.bias_update_speed)
    done = 0   # scanned layout (models/scan.py): one [L, E] bias per MoE run, rows in order
    for run in params.get("layer_runs", []):
        if "moe" in run:
            r = run["moe"]["router"]
            n = r["bias_E"].shape[0]
            r["bias_E"] = jax.vmap(update_bias, (0, 0, None))(
                r["bias_E"], metrics["tokens_per_expert_LE"][done:done + n],
                moe.bias_update_speed)
            done += n
    mtp_rows = iter(metrics.get("mtp_tokens_per_expert_LE", []))
    for mod in params.get("mtp", []):
        if "moe" in mod["block"]:
            r = mod["block"]["moe"]["router"]
            r["bias_E"] = update_bias(r["bias_E"], next(mtp_rows), moe.bias_update_speed)
    return params


# Metrics that are each micro-batch's own mean (averaged over micro-batches); the others are
# sums (counts, and `loss_fn`'s shares of the step's CE terms) except the traffic statistics
# that combine as NOT_SUMMED says.
_MICRO_MEAN = (*decoder.MEAN_AUX, "moe_loss")
_MICRO_NOT_SUMMED = {decoder.stacked_aux_name(k): f for k, f in NOT_SUMMED.items()}


def micro_batches(batch: Batch | jax.Array, k: int) -> Batch | jax.Array:
    """Every [k * b, ...] leaf of `batch` as [k, b, ...]: micro-batch m holds rows m, m + k,
    m + 2k, ... (a device's contiguous block of the batch's rows holds the same share of every
    micro-batch, so splitting moves no data between devices). Raises ValueError when k does
    not divide the rows."""
    def split(a):
        if a.shape[0] % k:
            raise ValueError(f"gradient_accumulation_steps={k} does not divide the batch's "
                             f"{a.shape[0]} rows")
        return jnp.swapaxes(a.reshape((a.shape[0] // k, k) + a.shape[1:]), 0, 1)
    return jax.tree.map(split, batch)


def merge_micro_metrics(stacked: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """The step's metrics from its micro-batches' (each stacked along a leading axis)."""
    out = {}
    for key, v in stacked.items():
        base = key.removeprefix("mtp_")
        fn = jnp.mean if base in _MICRO_MEAN else _MICRO_NOT_SUMMED.get(base, jnp.sum)
        out[key] = fn(v, axis=0).astype(v.dtype)
    return out


def loss_and_grads(params, batch: Batch | jax.Array, *, cfg: TrainConfig,
                   mesh: AnyMesh | None = None,
                   loss: Callable[..., tuple[jax.Array, dict]] = loss_fn
                   ) -> tuple[dict[str, jax.Array], Any]:
    """(metrics, gradients) of `loss` on the step's batch: one pass, or, with
    cfg.gradient_accumulation_steps k > 1, the sum of k micro-batches' gradients (accumulated
    in float32, returned in each parameter's dtype) under a lax.scan, `loss` called with the
    whole batch's `TargetCounts` as its fifth argument."""
    k = cfg.gradient_accumulation_steps
    grad_fn = jax.value_and_grad(loss, has_aux=True)
    if k == 1:
        (_, metrics), grads = grad_fn(params, batch, cfg, mesh)
        return metrics, grads
    counts = target_counts(batch, cfg)

    def one(acc, micro):
        (_, m), g = grad_fn(params, micro, cfg, mesh, counts)
        return jax.tree.map(lambda a, b: a + b.astype(a.dtype), acc, g), m

    zeros = jax.tree.map(
        lambda p: jnp.zeros(p.shape, jnp.promote_types(p.dtype, jnp.float32)), params)
    acc, stacked = lax.scan(one, zeros, micro_batches(batch, k))
    grads = jax.tree.map(lambda a, p: a.astype(p.dtype), acc, params)
    return merge_micro_metrics(stacked), grads


def train_step(state: State, batch: Batch | jax.Array, *, cfg: TrainConfig,
               opt: optax.GradientTransformation, mesh: AnyMesh | None = None,
               loss: Callable[..., tuple[jax.Array, dict]] = loss_fn) -> tuple[State, dict]:
    """One optimizer step on a batch (a Batch or [B, S + 1] windows, see `step_inputs`; B is
    the global batch, split into micro-batches where cfg accumulates, `loss_and_grads`);
    returns (new state, metrics: `loss`'s, "grad_norm", "lr" and, under `loss_fn`, "real_tokens",
    the batch's `real_tokens`). `loss(params, batch, cfg, mesh[, counts]) ->
    (objective, metrics)` is the language model's `loss_fn` unless a benchmark trains another
    model with this step (its metrics need `tokens_per_expert_LE` where the router biases
    learn)."""
    metrics, grads = loss_and_grads(state["params"], batch, cfg=cfg, mesh=mesh, loss=loss)
    with jax.named_scope("optimizer"):   # the kernel tables' "optimizer" group
        updates, opt_state = opt.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
    params = _update_biases(params, metrics, cfg)
    metrics["grad_norm"] = optax.tree.norm(grads)
    metrics["lr"] = lr_schedule(cfg)(state["step"])
    if loss is loss_fn:     # a token batch (a benchmark's own model reads its own batches)
        metrics["real_tokens"] = real_tokens(batch, cfg)
    new_state = {"params": params, "opt_state": opt_state, "step": state["step"] + 1,
                 "rng": jax.random.fold_in(state["rng"], state["step"])}
    return new_state, metrics


class EvalSums(NamedTuple):
    """A batch's held-out next-token cross-entropy as a sum and the targets it is over, so
    batches that count different numbers of targets (packing "documents" and "pad", SFT) add
    up to the per-token mean of them all: sum of `nll` / sum of `targets`."""
    nll: jax.Array                 # float32 []: the counted targets' summed cross-entropy
    targets: jax.Array             # float32 []: the targets counted (`target_counts(...).ce`)


def eval_sums(params, batch: Batch | jax.Array, *, cfg: TrainConfig,
              mesh: AnyMesh | None = None) -> EvalSums:
    """`EvalSums` of `batch` (no MTP, no balance losses): the batch read as `step_inputs`
    says, in cfg.gradient_accumulation_steps micro-batches as the step reads its batch (their
    sums added up)."""
    k = cfg.gradient_accumulation_steps
    if k == 1:
        return _eval_sums(params, batch, cfg, mesh)

    def one(acc, micro):
        return jax.tree.map(jnp.add, acc, _eval_sums(params, micro, cfg, mesh)), None
    zero = jnp.zeros((), jnp.float32)
    return lax.scan(one, EvalSums(zero, zero), micro_batches(batch, k))[0]


def eval_loss(params, batch: Batch | jax.Array, *, cfg: TrainConfig,
              mesh: AnyMesh | None = None) -> jax.Array:
    """Held-out next-token cross-entropy of `batch`, the mean over its counted targets
    (`eval_sums`' sum over their count; 0 where none is counted)."""
    s = eval_sums(params, batch, cfg=cfg, mesh=mesh)
    return s.nll / jnp.maximum(s.targets, 1)


def _eval_sums(params, batch, cfg: TrainConfig, mesh: AnyMesh | None) -> EvalSums:
    x = step_inputs(batch, cfg)
    h, _ = decoder.hidden(params, x.tokens_BS, cfg.model, segment_ids_BS=x.segment_ids_BS,
                          positions_BS=x.positions_BS, mesh=mesh)
    nll = nll_from_hidden(params, h, params["final_norm"]["w_D"], x.targets_BS, cfg.model,
                          cfg.num_vocab_tiling)
    if x.loss_mask_BS is None:
        return EvalSums(jnp.sum(nll), jnp.asarray(nll.size, jnp.float32))
    mask = x.loss_mask_BS.astype(jnp.float32)
    return EvalSums(jnp.sum(nll * mask), jnp.sum(mask))
