"""`TrainConfig`: one training run (the model, mesh, optimizer, data, checkpoints, metrics)."""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from dropless.config.fields import (_check_types, _fail, _one_of, _positive_ints, _sizes,
                                     described)
from dropless.config.mesh import MeshConfig
from dropless.config.model import ModelConfig
from dropless.config.names import MAX_PREFETCH, MAX_STEPS, PACKINGS, REMAT_POLICIES
from dropless.runtime.environment import check_environment
from dropless.runtime.xla_flags import RECIPES, check_flags


# seeds jax.random.PRNGKey tells apart (it keeps the low 32 bits; 2**63 and up overflow it)
SEED_LIMIT = 2 ** 32
# the fields counted in steps, each below MAX_STEPS
STEP_FIELDS = ("steps", "warmup_steps", "lr_decay_steps", "eval_every", "checkpoint_every",
               "log_every", "profile_steps")


def decay_per_step(learning_rate: float, weight_decay: float) -> float:
    """learning_rate x weight_decay: the share of each decayed weight that one step's decay
    takes away at the schedule's peak, rounded as the optimizer's float32 arithmetic rounds it.

    AdamW's decoupled decay (train/step.make_optimizer: optax.adamw, on matrices; norm weights
    and router biases are masked out) adds weight_decay x w to the update, which the learning
    rate then scales: w becomes w x (1 - learning_rate x weight_decay), so a product of 1 zeroes
    every matrix and one above flips its sign. The peak is learning_rate itself: the warmup
    rises to it, the cosine falls from it to learning_rate x min_lr_ratio (<= 1). Float32
    because the schedule's value and float32 weights are: 0.5 x 1.9999999999999998 is below 1
    in float64 and exactly 1 there."""
    with np.errstate(over="ignore"):     # learning_rate=1e39 is inf: refused like any >= 1
        return float(np.float32(learning_rate) * np.float32(weight_decay))


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training run: the model, optimizer, data, parallelism, checkpoints and metrics.

    The global batch is `per_device_batch_size * number of devices in the mesh *
    gradient_accumulation_steps` (devices: data * fsdp * expert, `mesh`), as in MaxText: each
    forward and backward pass sees `micro_batch_size` rows and a step adds up the gradients of
    `gradient_accumulation_steps` of them before the optimizer runs once.
    """

    model: ModelConfig = described(doc="the model; its keys start from the preset's values")
    mesh: MeshConfig = described(
        MeshConfig(), doc="parallelism (MaxText's `ici_*` x `dcn_*` parallelism)")
    preset: str = described(
        "", doc="the named preset the model came from (a key: picks the model to start from, "
                "tiny when none is named)")
    steps: int = described(400, doc="optimizer steps the run trains for")
    per_device_batch_size: int = described(
        16, doc="sequences per device in each forward and backward pass; the global batch is "
                "this x the mesh's devices x gradient_accumulation_steps")
    gradient_accumulation_steps: int = described(
        1, doc="micro-batches whose gradients a step adds up before its one optimizer update "
               "(the batch grows, the activations' memory does not)")
    seq_len: int = described(128, doc="tokens per sequence")
    num_vocab_tiling: int = described(
        1, doc="slices of the sequence the loss runs the output head on, one at a time "
               "(MaxText's key): the logits take 1/N of the memory, for one more head forward "
               "in the backward; must divide seq_len")
    learning_rate: float = described(3e-3, doc="peak learning rate, reached after the warmup")
    warmup_steps: int = described(20, doc="steps of linear warmup from 0 to learning_rate")
    min_lr_ratio: float = described(
        0.1, doc="the cosine decays to learning_rate x min_lr_ratio")
    lr_decay_steps: int = described(
        0, doc="step the cosine ends at (constant after); 0 = steps, and a resumed run keeps "
               "its first horizon")
    weight_decay: float = described(
        0.1, doc="AdamW's decoupled weight decay, on matrices only (not norms or biases); "
               "learning_rate x weight_decay must be < 1")
    adam_b1: float = described(0.9, doc="AdamW's beta1")
    adam_b2: float = described(0.95, doc="AdamW's beta2")
    adam_eps: float = described(1e-8, doc="AdamW's epsilon")
    grad_clip: float = described(1.0, doc="gradients clipped to this global norm; 0 = no clip")
    seed: int = described(
        0, doc="seed of the initial weights and of the data order (< 2^32: the weights' PRNG "
               "key holds 32 bits)")
    init_from: str = described(
        "", doc="start from these weights (fine-tuning): hf:DIR (a Hugging Face folder), a "
                "`dropless convert` output or a run directory")
    remat: str = described(
        "none", doc="rematerialisation: none, full, minimal, or offload (attention's marked "
                    "activations to host)")
    xla_recipe: str = described(
        "none", doc="XLA flags and environment set before JAX starts: none, gpu, or cpu8 (8 "
                    "host devices)")
    xla_flags: str = described(
        "", doc="extra XLA flags (\"--name=value ...\"); MaxText's `xla_*` keys add to them")
    environment: str = described(
        "", doc="\"NAME=value ...\" set before JAX starts; MaxText's environment keys add to it")
    distributed: bool = described(
        False, doc="start jax.distributed from the cluster environment (several processes)")
    # data
    data: str = described(
        "stdlib", doc="training data: stdlib (the Python standard library's .py files), or a "
                      "path: .txt/.py/.md, .jsonl, .npy, .bin, a folder or a prepared dataset")
    tokenizer: str = described(
        "byte", doc="byte (one token per byte), hf:DIR or a folder holding tokenizer.json, or a "
        "tokenizer.json path (as `data prepare --tokenizer` reads it)")
    bin_dtype: str = described(
        "uint16", doc="element type of pre-tokenized .bin files: uint8, uint16, int32 or uint32")
    eval_fraction: float = described(
        0.02, doc="share of the data's documents held out for evaluation, where eval_data is "
                  "empty")
    eval_every: int = described(50, doc="steps between evaluations (and one at the end)")
    eval_batches: int = described(2, doc="batches each evaluation reads")
    packing: str = described(
        "documents", doc="documents (several per row, attention and loss never crossing one), "
                         "pad (one per row, padded) or stream (joined with EOS, windows cross)")
    sft: bool = described(
        False, doc="supervised fine-tuning: records are prompt/completion or chat messages")
    sft_completion_only: bool = described(
        True, doc="with sft: the loss counts completion tokens only")
    eval_data: str = described(
        "", doc="held-out data, all of it evaluated (a path, as data); \"\" = eval_fraction "
        "of data")
    prefetch: int = described(
        2, doc=f"batches the loader builds ahead of the step, 0 to {MAX_PREFETCH} (0: each "
               "batch is built when the step asks for it; each batch ahead holds the step's rows "
               "on the devices)")
    # output
    run_dir: str = described("runs", doc="folder the run's directory is made in")
    run_name: str = described("", doc="the run directory's name; \"\" = a timestamped name")
    log_every: int = described(1, doc="steps between printed step lines")
    checkpoint_every: int = described(
        100, doc="steps between checkpoints; 0 = no periodic checkpoints (the last step is "
        "saved unless save_last_step=false)")
    save_last_step: bool = described(
        True, doc="checkpoint the run's last step; false: a finished run keeps only "
        "checkpoint_every's (a run stopped by a signal, a non-finite step or an overflow still "
        "saves its last good step)")
    keep_checkpoints: int = described(3, doc="newest checkpoints kept; older ones are deleted")
    async_checkpoints: bool = described(
        True, doc="write checkpoints in the background while training goes on")
    time_kernels: bool = described(
        True, doc="time the grouped matmul, dispatch and combine at start-up (the start record)")
    profile_steps: int = described(
        0, doc="a JAX profiler trace of this many steps, from the third; 0 = none")
    check_nan: bool = described(
        False, doc="stop at the first non-finite loss, gradient or parameter, naming the step, "
                   "layer and parameter (train/nonfinite.py)")

    def __post_init__(self) -> None:
        c = "TrainConfig"
        if not isinstance(self.model, ModelConfig):
            _fail(c, "model", type(self.model).__name__, "must be a ModelConfig")
        if not isinstance(self.mesh, MeshConfig):
            _fail(c, "mesh", type(self.mesh).__name__, "must be a MeshConfig")
        _check_types(self)
        _positive_ints(c, self, ("steps", "per_device_batch_size", "gradient_accumulation_steps",
                                 "seq_len", "eval_every",
                                 "eval_batches", "log_every", "keep_checkpoints"))
        _positive_ints(c, self, ("warmup_steps", "checkpoint_every", "seed", "profile_steps",
                                 "lr_decay_steps"),
                       allow_zero=True)
        _sizes(c, self, ("per_device_batch_size", "gradient_accumulation_steps", "seq_len"))
        _positive_ints(c, self, ("num_vocab_tiling",))
        if self.seq_len % self.num_vocab_tiling:
            _fail(c, "num_vocab_tiling", self.num_vocab_tiling,
                  f"must divide seq_len={self.seq_len}: each slice is seq_len / "
                  "num_vocab_tiling positions of every row; use a divisor of seq_len")
        for name in STEP_FIELDS:
            if getattr(self, name) >= MAX_STEPS:
                _fail(c, name, getattr(self, name), f"must be < 2**31 = {MAX_STEPS:,} (the step "
                      "counter is int32 on the device); a typo?")
        if self.seed >= SEED_LIMIT:
            _fail(c, "seed", self.seed, f"must be < 2**32 = {SEED_LIMIT} (jax.random.PRNGKey "
                  f"keeps 32 bits: seed {SEED_LIMIT} would draw seed 0's weights)")
        if self.model.mtp_depth >= self.seq_len:
            _fail(c, "model.mtp_depth", self.model.mtp_depth,
                  f"must be < seq_len={self.seq_len}: MTP depth k predicts the token k + 1 "
                  "ahead, which a row of seq_len tokens holds for k < seq_len only")
        if not self.learning_rate > 0:
            _fail(c, "learning_rate", self.learning_rate, "must be > 0")
        if not 0 <= self.min_lr_ratio <= 1:
            _fail(c, "min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")
        for name in ("weight_decay", "grad_clip", "adam_eps"):
            if getattr(self, name) < 0:
                _fail(c, name, getattr(self, name), "must be >= 0")
        for name in ("adam_b1", "adam_b2"):
            if not 0 <= getattr(self, name) < 1:
                _fail(c, name, getattr(self, name), "must be in [0, 1)")
        product = decay_per_step(self.learning_rate, self.weight_decay)
        if product >= 1:
            _fail(c, "learning_rate", self.learning_rate,
                  f"x weight_decay={self.weight_decay!r} = {product:.6g} must be < 1: AdamW's "
                  "decoupled decay multiplies the matrices by 1 - learning_rate x weight_decay "
                  "each step at the peak, which zeroes them or flips their sign; lower "
                  "learning_rate or weight_decay (weight_decay=0 turns the decay off)")
        _one_of(c, self, "remat", REMAT_POLICIES)
        if not 0 < self.eval_fraction < 1:
            _fail(c, "eval_fraction", self.eval_fraction, "must be in (0, 1)")
        _one_of(c, self, "bin_dtype", ("uint8", "uint16", "int32", "uint32"))
        _one_of(c, self, "packing", PACKINGS)
        if self.sft is True and self.packing == "stream":
            _fail(c, "packing", self.packing, "cannot hold SFT examples (attention would cross "
                  "them): use packing=documents or packing=pad with sft=true")
        _positive_ints(c, self, ("prefetch",), allow_zero=True)
        if self.prefetch > MAX_PREFETCH:
            _fail(c, "prefetch", self.prefetch,
                  f"must be <= {MAX_PREFETCH}: a deeper queue hides no longer stall, and each "
                  "batch ahead holds the step's rows in memory")
        _one_of(c, self, "xla_recipe", tuple(RECIPES))
        moe = self.model.moe
        if moe is not None and moe.num_experts % self.mesh.expert:
            _fail(c, "mesh.expert", self.mesh.expert,
                  f"must divide model.moe.num_experts={moe.num_experts}")
        for name in ("distributed", "check_nan", "sft", "sft_completion_only", "save_last_step"):
            if not isinstance(getattr(self, name), bool):
                _fail(c, name, getattr(self, name), "must be true or false")
        check_flags(self.xla_flags)
        check_environment(self.environment)

    def replace(self, **changes: Any) -> "TrainConfig":
        return dataclasses.replace(self, **changes)

    @property
    def num_devices(self) -> int:
        """Devices of the mesh (`mesh.num_devices`)."""
        return self.mesh.num_devices

    @property
    def micro_batch_size(self) -> int:
        """Rows one forward and backward pass sees, over all devices."""
        return self.per_device_batch_size * self.num_devices

    @property
    def global_batch_size(self) -> int:
        """Rows one optimizer step trains on: `micro_batch_size` x the accumulation steps."""
        return self.micro_batch_size * self.gradient_accumulation_steps
