"""The names config fields take: each field's allowed values, and the tables other layers build
from them (the dispatch registry from `DISPATCH_STRATEGIES`, the model's remat from
`REMAT_CHECKPOINT_POLICIES`, the mesh from `MESH_AXES`). Each name is written here once.
"""
from __future__ import annotations

SCORE_FUNCS = ("softmax", "sigmoid")
GMM_QUANTIZATIONS = ("none", "mxfp8", "nvfp4")
# The expert-parallel strategies, each with what it does. config sits below moe, so it names
# them and moe/dispatch/registry.py builds each one's spec from these names (its import fails
# when a name here has no implementation there)
DISPATCH_STRATEGIES: dict[str, str] = {
    "allgather": "gather all tokens, run local experts, reduce-scatter back",
    "a2a": "deduplicated rows over all_to_all in static per-peer chunks (every backend)",
    "ragged_a2a": "deduplicated rows over ragged_all_to_all (GPU/TPU; padding never travels)",
    "node_a2a": "node-level dedup: one row per (token, node) across nodes, fanned out inside "
                "the node",
}
# MoEConfig.dispatcher's values: "auto" (a strategy chosen per mesh and platform), "local" (no
# dispatcher: the single-device layer), then the strategies
DISPATCHERS = ("auto", "local", *DISPATCH_STRATEGIES)
OVERFLOW_POLICIES = ("rounds", "error")
# How documents fill a batch's rows (TrainConfig.packing): "documents" packs several per row with
# segment ids and positions that restart per document, attention and loss never crossing a
# boundary (MaxText's packing=true); "pad" holds one document per row, padded (packing=false);
# "stream" joins documents with EOS and lets windows run across them (runs made before packing).
PACKINGS = ("documents", "pad", "stream")
# ModelConfig.init's schemes (models/init.py holds each one's table: per parameter kind, the
# distribution and std) and the fields that only say how a model starts (they never change the
# parameter tree, so weights trained under one scheme load under another)
INIT_SCHEMES = ("fan_in", "normal", "maxtext", "legacy")
INIT_FIELDS = ("init", "init_std", "head_init_std", "embed_init_std", "init_residual_scaling")

MESH_AXES = ("data", "fsdp", "expert")   # the mesh axes, in mesh order
# the dtypes a model's activations and stored weights may have (ModelConfig / MoEConfig dtype,
# weight_dtype): float64 would run as float32 (JAX without jax_enable_x64) while the config said
# float64, and float8 / int types are what gmm_quantization is for, not a model's dtype
MODEL_DTYPES = ("float32", "bfloat16", "float16")

# the most decoder layers (and MTP modules) a model may have: the deepest published decoders have
# about 100-200; the model's layers are built, counted and planned one by one, so a larger
# value (a typo, 1e9) would only make those loops endless
MAX_LAYERS = 10_000
# sizes (vocabulary, widths, heads, ranks, batch rows, sequence length) are below this:
# positions, ids and shapes are int32 on the device, and a larger value (a typo, 1e18) would
# only overflow the planner's float arithmetic or an allocation
MAX_SIZE = 2 ** 31
# steps and step intervals (steps, warmup_steps, lr_decay_steps, eval_every, checkpoint_every,
# log_every, profile_steps) are below this: the state's step counter and optax's count are int32
# on the device (step 2**31 would wrap to a negative step), a warmup past it fails inside the
# jitted schedule after the model is compiled, and an interval past it is never reached
MAX_STEPS = 2 ** 31
# the most batches the loader builds ahead of the step (TrainConfig.prefetch): building a batch
# is a steady pure function of its index, so a queue only has to cover a stall of a few steps
# (a page-cache miss, a checkpoint competing for the disk), and each batch ahead holds the step's
# rows placed on the devices (20 bytes a token), memory the trainer's pre-flight does not count
MAX_PREFETCH = 16
# experts per MoE layer are at most this (the largest published mixture has about a million:
# "Mixture of A Million Experts", 2024); the planner draws router scores for every expert
MAX_EXPERTS = 2 ** 20

ATTENTION_KINDS = ("mla", "mha")
# the attention core's kernels (ops/attention.py): auto = cuDNN's flash attention where it takes
# the operands (an NVIDIA GPU, bfloat16), else xla (the S x S scores in float32)
ATTENTION_KERNELS = ("auto", "xla", "cudnn", "cudnn_thd")
ROPE_TYPES = ("default", "yarn")
LAYER_KINDS = {"D": "dense", "M": "moe"}
# Each remat policy -> the jax.checkpoint_policies policy it is (None: no rematerialisation);
# models/decoder.py builds the policy from that name
REMAT_CHECKPOINT_POLICIES: dict[str, str | None] = {
    "none": None,
    "full": "nothing_saveable",
    "minimal": "dots_with_no_batch_dims_saveable",   # and the grouped matmuls' named outputs
    "offload": "save_and_offload_only_these_names",   # attention's marked activations to host
}
REMAT_POLICIES = tuple(REMAT_CHECKPOINT_POLICIES)     # TrainConfig.remat's values
