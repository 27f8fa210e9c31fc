"""The trainer held step by step against transformers + torch.optim.AdamW.

The fixtures (tests/fixtures/hf/trajectory/<family>/, see tests/_support/trajectory.py) hold a
tiny DeepSeek-V3 (MLA, q low-rank, group-limited sigmoid routing with a routing bias, a shared
expert, routed scaling, a dense and an MoE layer) and a tiny Qwen3-MoE (GQA, q/k norms,
softmax routing, a dense and an MoE layer), written by `hf.save`, with 30 batches and the
per-step loss, pre-clip gradient norm and lr of transformers 4.57.6, 5.24.0 and 5.25.0 training
them with AdamW at dropless's schedule, weight-decay mask and clipping (active on some steps only).

Here the trainer trains the same: the folder loaded through `init_from=hf:DIR`
(train.init_from.initial_params), init_state's optimizer (train.step.make_optimizer) and the
jitted train.step.train_step, as the loop runs them. Losses and gradient norms must agree at
relative 1e-5 on every step, the lr with the fixture's, and so must they with each step's
batch split into micro-batches (gradient accumulation). Mutations of the trainer, on the
DeepSeek-V3 model (the one with a routing bias) (no clipping, decay on the norms, the lr one step
late, eps inside the square root, the router-bias update on) must each break that agreement by
1e-4 or more; they share one compiled gradient (train.step.loss_fn's) and step their own
optimizer (train.step.make_optimizer under the mutation), with the harness itself checked to
reproduce train_step. The ragged_dot grouped matmul and XLA's backend optimisation level 0
keep the compiles short (neither changes a result here; the backends are checked against the
per-expert reference in tests/ops).
"""
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dropless.train import step as st
from dropless.train.init_from import initial_params
from tests._support import trajectory as tj

RTOL = 1e-5        # agreement with transformers, per step, loss and gradient norm
BROKEN = 1e-4      # the least disagreement a mutation must cause
FAST = {"xla_backend_optimization_level": 0}
FAMILIES = list(tj.MODELS)


def reference(family: str) -> dict:
    """{transformers version: {"lr", "loss", "grad_norm", "clipped": per step}}."""
    return json.loads((tj.folder(family) / "trajectory.json").read_text())


def windows(family: str) -> jax.Array:
    return jnp.asarray(np.load(tj.folder(family) / "batches.npy"))


def config(family: str, **changes):
    return tj.train_config(family, **{"model.moe.gmm_backend": "ragged_dot", **changes})


def start(cfg):
    """The loop's start from init_from: train.step.init_state's state and optimizer with the
    folder's parameters (train.init_from.initial_params). The random parameters init_state
    draws, replaced there, are not computed here (their random draws take seconds to compile):
    the state is built from make_optimizer, as init_state does, and checked against
    init_state's in structure, shapes and dtypes."""
    params = initial_params(cfg)
    opt = st.make_optimizer(cfg, params)
    state = {"params": params, "opt_state": opt.init(params), "step": jnp.zeros((), jnp.int32),
             "rng": jax.random.PRNGKey(cfg.seed)}
    like = jax.eval_shape(lambda: st.init_state(cfg)[0])
    assert jax.tree.structure(like) == jax.tree.structure(state)
    assert all(a.shape == b.shape and a.dtype == b.dtype
               for a, b in zip(jax.tree.leaves(like), jax.tree.leaves(state)))
    return state, opt


def worst(ours: list, theirs: list) -> float:
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    return float(np.max(np.abs(ours - theirs) / np.abs(theirs)))


@functools.lru_cache(maxsize=None)
def trained(family: str, accumulate: int = 1) -> dict:
    """The trainer's run: per step loss, grad_norm, lr (jit(train_step), 30 steps), each
    step's batch in `accumulate` micro-batches (gradient_accumulation_steps)."""
    cfg = config(family, per_device_batch_size=tj.BATCH // accumulate,
                 gradient_accumulation_steps=accumulate)
    state, opt = start(cfg)
    w = windows(family)
    step = jax.jit(functools.partial(st.train_step, cfg=cfg, opt=opt)).lower(
        state, w[0]).compile(compiler_options=FAST)
    out = {"loss": [], "grad_norm": [], "lr": []}
    for b in w:
        state, m = step(state, b)
        for k in out:
            out[k].append(float(m[k]))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_trajectory_matches_transformers(family):
    ours = trained(family)
    refs = reference(family)
    assert set(refs) == {"4.57.6", "5.24.0", "5.25.0"}
    clip = json.loads((tj.folder(family) / "setup.json").read_text())["grad_clip"]
    for version, ref in refs.items():
        assert len(ref["loss"]) == tj.STEPS
        assert worst(ours["loss"], ref["loss"]) <= RTOL, version
        assert worst(ours["grad_norm"], ref["grad_norm"]) <= RTOL, version
        # the lr the trainer used is the one the fixture holds (step 0's is 0: warmup from 0)
        np.testing.assert_allclose(ours["lr"], ref["lr"], rtol=1e-6, atol=1e-12)
        # clipping was active on some steps, not all, and on the same steps here
        assert 0 < sum(ref["clipped"]) < tj.STEPS
        near = np.isclose(ref["grad_norm"], clip, rtol=RTOL)
        assert ((np.asarray(ours["grad_norm"]) > clip) == ref["clipped"])[~near].all()


@pytest.mark.parametrize("family,accumulate", [("deepseek_v3", 2), ("qwen3_moe", 4)])
def test_accumulated_trajectory_matches_transformers(family, accumulate):
    """Each step's batch in micro-batches (gradient_accumulation_steps): the trajectory of
    transformers training on the whole batch, as closely as without accumulation."""
    ours = trained(family, accumulate)
    for version, ref in reference(family).items():
        assert worst(ours["loss"], ref["loss"]) <= RTOL, version
        assert worst(ours["grad_norm"], ref["grad_norm"]) <= RTOL, version


# --- mutations: each is a change to the trainer that the comparison must catch -------------

FAMILY = "deepseek_v3"   # the family with a routing bias: every mutation applies


def _no_clip(cfg, mp):
    return cfg.replace(grad_clip=0.0)


def _decay_norms(cfg, mp):
    mp.setattr(st, "_no_decay", st._is_frozen)   # every trained leaf decayed, norms included
    return cfg


def _lr_late(cfg, mp):
    schedule = st.lr_schedule
    mp.setattr(st, "lr_schedule", lambda c: (lambda n: schedule(c)(n + 1)))
    return cfg


def _eps_in_sqrt(cfg, mp):
    adamw = optax.adamw
    mp.setattr(optax, "adamw", lambda *a, eps, **k: adamw(*a, eps=0.0, eps_root=eps, **k))
    return cfg


def _bias_update(cfg, mp):
    return cfg.replace(model=cfg.model.replace(moe=cfg.model.moe.replace(
        bias_update_speed=0.001)))


MUTATIONS = {"none": lambda cfg, mp: cfg, "no_clip": _no_clip, "decay_norms": _decay_norms,
             "lr_one_step_late": _lr_late, "eps_inside_sqrt": _eps_in_sqrt,
             "router_bias_update": _bias_update}


@functools.lru_cache(maxsize=None)
def _grad_fn(cfg):
    """train.step.loss_fn and its gradient, compiled once for every mutation (none of them
    changes the loss)."""
    state, _ = start(cfg)
    loss = functools.partial(st.loss_fn, cfg=cfg)
    return jax.jit(jax.value_and_grad(loss, has_aux=True)).lower(
        state["params"], windows(FAMILY)[0]).compile(compiler_options=FAST)


def mutated_run(name: str, monkeypatch) -> dict:
    """train_step's body (gradient, optimizer update, router-bias update) with the optimizer
    and config `MUTATIONS[name]` makes; per step loss and grad_norm."""
    base = config(FAMILY)
    with monkeypatch.context() as mp:
        cfg = MUTATIONS[name](base, mp)
        state, opt = start(cfg)

    def update(params, opt_state, grads, metrics):
        updates, opt_state = opt.update(grads, opt_state, params)
        return st._update_biases(optax.apply_updates(params, updates), metrics, cfg), opt_state

    grad = _grad_fn(base)
    params, opt_state = state["params"], state["opt_state"]
    metrics, grads = grad(params, windows(FAMILY)[0])[0][1], params
    upd = jax.jit(update).lower(params, opt_state, grads, metrics).compile(
        compiler_options=FAST)
    out = {"loss": [], "grad_norm": []}
    for b in windows(FAMILY):
        (_, metrics), grads = grad(params, b)
        params, opt_state = upd(params, opt_state, grads, metrics)
        out["loss"].append(float(metrics["loss"]))
        out["grad_norm"].append(float(optax.tree.norm(grads)))
    return out


def test_harness_reproduces_train_step(monkeypatch):
    """The mutations' harness, unmutated, is train_step: the same losses."""
    ours, theirs = mutated_run("none", monkeypatch), trained(FAMILY)
    assert worst(ours["loss"], theirs["loss"]) <= 1e-6
    assert worst(ours["grad_norm"], theirs["grad_norm"]) <= 1e-6


@pytest.mark.parametrize("name", [m for m in MUTATIONS if m != "none"])
def test_mutation_breaks_agreement(name, monkeypatch):
    ours = mutated_run(name, monkeypatch)
    for version, ref in reference(FAMILY).items():
        off = max(worst(ours["loss"], ref["loss"]), worst(ours["grad_norm"], ref["grad_norm"]))
        assert off >= BROKEN, (name, version, off)
