"""The model, one decoder for every family dropless trains: DeepSeek-V3 (MLA, dense-first layers,
MoE layers with shared experts, sigmoid routing, optional multi-token prediction), Mixtral and
Qwen3-MoE (standard attention, softmax routing) are configurations of the same blocks (their
presets in `presets`, their Hugging Face layouts in `hf`), so no family has code of its own. Math only: the mesh (a `parallel.NodeMesh`, which
carries its node size, or a plain jax mesh) is passed through to the MoE layer.

Legend: B batch, S sequence, D model dim, F dense hidden, V vocabulary, E experts, Lm MoE layers.

Packed rows: `forward` and `mtp_logits` take optional `segment_ids_BS` (attention stays inside a
segment) and `positions_BS` (rotary positions per document); None keeps the plain causal row
with positions 0..S-1 (the "stream" packing), chosen at trace time.

Parameters: {"embed": {"w_VD"}, "layers": [block, ...], "final_norm": {"w_D"},
"lm_head": {"w_DV"} (untied only), "mtp": [module, ...] (mtp_depth > 0 only)}; a block is
{"attn_norm_D", "attn": {...}, "ffn_norm_D", "ffn": {...dense...} | "moe": {...moe layer...}}.
With `scan_layers=True`, "layer_runs" (stacked runs of same-kind layers, see models/scan.py)
replaces "layers"; `models.scan.to_layout` converts either way.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from dropless import moe as moe_lib
from dropless.config import REMAT_CHECKPOINT_POLICIES, REMAT_POLICIES, ModelConfig
from dropless.models.attention import ATTENTION, rms_norm, rope_at, rope_tables
from dropless.models.init import initializer
from dropless.models.scan import PER_LAYER, SCANNED, run_layers, stack_layers
from dropless.moe.ffn import Draw, init_swiglu_ffn, swiglu_ffn
from dropless.parallel.mesh import AnyMesh

Params = dict[str, Any]


def init_block(key: jax.Array, cfg: ModelConfig, is_moe: bool, draw: Draw) -> Params:
    """One block's parameters (attention, then the dense FFN or the MoE layer), each weight
    from `draw`; the norms start at one."""
    wdt = jnp.dtype(cfg.weight_dtype)
    k_a, k_f = jax.random.split(key)
    block = {"attn_norm_D": jnp.ones((cfg.d_model,), wdt),
             "attn": ATTENTION[cfg.attention].init(k_a, cfg, draw),
             "ffn_norm_D": jnp.ones((cfg.d_model,), wdt)}
    if is_moe:
        block["moe"] = moe_lib.init_params(k_f, cfg.moe, draw)
    else:
        block["ffn"] = init_swiglu_ffn(k_f, cfg.d_model, cfg.d_ff, wdt, draw)
    return block


def init_params(key: jax.Array, cfg: ModelConfig) -> Params:
    """Random parameters for `cfg` (use jax.eval_shape(init_params, key, cfg) to plan big ones),
    in the scanned layout when `cfg.scan_layers`; every weight drawn as cfg.init (and its
    overrides) says (models/init.py)."""
    wdt = jnp.dtype(cfg.weight_dtype)
    draw = initializer(cfg)
    d, v = cfg.d_model, cfg.vocab_size
    k_e, k_h, k_l, k_m = jax.random.split(key, 4)
    layer_keys = jax.random.split(k_l, cfg.num_layers)
    params: Params = {
        "embed": {"w_VD": draw(k_e, "embed", (v, d), d, wdt)},
        "layers": [init_block(layer_keys[i], cfg, cfg.is_moe_layer(i), draw)
                   for i in range(cfg.num_layers)],
        "final_norm": {"w_D": jnp.ones((d,), wdt)},
    }
    if not cfg.tie_embeddings:
        params["lm_head"] = {"w_DV": draw(k_h, "head", (d, v), d, wdt)}
    if cfg.mtp_depth:
        mtp_keys = jax.random.split(k_m, cfg.mtp_depth)
        params["mtp"] = [init_mtp_module(mtp_keys[i], cfg, draw) for i in range(cfg.mtp_depth)]
    # the same values in either layout (one key per layer), so the layouts are interchangeable
    return stack_layers(params) if cfg.scan_layers else params


def init_mtp_module(key: jax.Array, cfg: ModelConfig, draw: Draw) -> Params:
    """One DeepSeek-V3 MTP module: norms for hidden and embedding, a 2D -> D projection, a block
    (MoE when the model has MoE layers) and its own output norm; embedding and head are shared."""
    wdt = jnp.dtype(cfg.weight_dtype)
    k_p, k_b = jax.random.split(key)
    d = cfg.d_model
    return {"hidden_norm_D": jnp.ones((d,), wdt), "embed_norm_D": jnp.ones((d,), wdt),
            "proj_2DD": draw(k_p, "mtp_proj", (2 * d, d), 2 * d, wdt),
            "block": init_block(k_b, cfg, cfg.moe is not None, draw),
            "out_norm_D": jnp.ones((d,), wdt)}


def remat_policy(remat: str, cfg: ModelConfig):
    """The jax.checkpoint policy that remat policy `remat` names (config's
    REMAT_CHECKPOINT_POLICIES), None for "none". `minimal` also keeps the MoE layer's grouped
    matmul outputs (`moe.SAVED_NAMES`: custom calls, which the dots policy does not see), as
    MaxText's `minimal` keeps its `mlpwi_0`, `mlpwi_1`, `mlpwo`; the offloading one moves the
    activations the model's attention marks (AttentionSpec.offloaded) to pinned host memory.
    Raises ValueError for an unknown name."""
    if remat not in REMAT_CHECKPOINT_POLICIES:
        raise ValueError(f"remat={remat!r} must be one of {REMAT_POLICIES}")
    name = REMAT_CHECKPOINT_POLICIES[remat]
    if name is None:
        return None
    policy = getattr(jax.checkpoint_policies, name)
    if remat == "minimal":   # the matmuls: dots, and the grouped matmuls' named outputs
        return jax.checkpoint_policies.save_from_both_policies(
            policy, jax.checkpoint_policies.save_only_these_names(*moe_lib.SAVED_NAMES))
    if name == "save_and_offload_only_these_names":   # a policy built from the names it moves
        return policy(names_which_can_be_saved=[],
                      names_which_can_be_offloaded=list(ATTENTION[cfg.attention].offloaded),
                      offload_src="device", offload_dst="pinned_host")
    return policy


def block(p: Params, x_BSD: jax.Array, cos, sin, segment_ids_BS=None, *, cfg: ModelConfig,
          mesh: AnyMesh | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Pre-norm block: x + attn(norm(x)), then + ffn(norm(.)) (dense SwiGLU or MoE layer).
    `cos`, `sin`: rotary tables ([S, R2] or per row [B, S, R2]); `segment_ids_BS`: attention
    stays inside each segment (None: plain causal).

    Returns (y_BSD, aux); aux is empty for dense blocks and the MoE layer's aux otherwise.
    """
    h = attention_residual(p, x_BSD, cos, sin, segment_ids_BS, cfg=cfg)
    return ffn_residual(p, h, cfg=cfg, mesh=mesh)


def attention_residual(p: Params, x_BSD: jax.Array, cos, sin, segment_ids_BS=None, *,
                       cfg: ModelConfig) -> jax.Array:
    """The block's first half: x + attn(norm(x))."""
    attn_fn = ATTENTION[cfg.attention].apply
    with jax.named_scope("attention"):
        return x_BSD + attn_fn(p["attn"], rms_norm(x_BSD, p["attn_norm_D"], cfg.norm_eps), cfg,
                               cos, sin, segment_ids_BS)


def ffn_residual(p: Params, h: jax.Array, *, cfg: ModelConfig, mesh: AnyMesh | None = None
                 ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The block's second half: h + ffn(norm(h)), and the MoE layer's aux (empty if dense)."""
    z = rms_norm(h, p["ffn_norm_D"], cfg.norm_eps)
    if "moe" in p:
        with jax.named_scope("moe"):
            y, aux = moe_lib.apply(p["moe"], z, cfg.moe, mesh=mesh)
        return h + y.astype(h.dtype), aux
    with jax.named_scope("dense_ffn"):
        return h + swiglu_ffn(p["ffn"], z, z.dtype).astype(z.dtype), {}


def compute_weights(blocks: Any, cfg: ModelConfig) -> Any:
    """`blocks` (a block, a list of blocks or of stacked runs) with every matmul weight in the
    dtype its matmul reads it in: the MoE layer's (`cfg.moe.dtype`) inside "moe", else
    `cfg.dtype`. A matmul weight is a leaf whose name starts with "w", outside the router
    (whose logits are float32); norms and biases are left as they are, and so is a weight the
    cast would not narrow (float32 compute: nothing changes).

    Every use casts its weight to that dtype anyway (`.astype(dt)`, once per weight in a
    block), so the values are the same bit for bit; cast here, once a step before the blocks
    run (on one device: `casts_weights_once`), the rematerialised backward pass does not cast
    every weight again, and scanned runs slice bfloat16 stacks instead of float32 ones. The
    float32 gradient is the cast's, as before. The cost: the narrowed copies live through the
    step (2 bytes a parameter of the blocks in bfloat16)."""
    def view(path, leaf):
        keys = [getattr(k, "key", None) for k in path]
        name = keys[-1] if keys and isinstance(keys[-1], str) else ""
        if not name.startswith("w") or "router" in keys:
            return leaf
        dt = jnp.dtype(cfg.moe.dtype if "moe" in keys and cfg.moe is not None else cfg.dtype)
        narrows = (jnp.issubdtype(leaf.dtype, jnp.floating)
                   and dt.itemsize < jnp.dtype(leaf.dtype).itemsize)
        return leaf.astype(dt) if narrows else leaf
    return jax.tree_util.tree_map_with_path(view, blocks)


def casts_weights_once(mesh: AnyMesh | None) -> bool:
    """Whether `forward` casts the blocks' weights once a step (`compute_weights`): on one
    device (no mesh, as the trainer runs one, or a mesh of one). Across devices the cast's
    gradient would be summed over the replicas (or reduce-scattered over FSDP) in the compute
    dtype: XLA:GPU reduces the bfloat16 weight gradient before the cast back (4 compile-only
    H100s, jax 0.11.2: tests/train/test_step_accumulation_gpu_compile.py), where each use's
    cast keeps that sum in float32."""
    if mesh is None:
        return True
    return getattr(mesh, "mesh", mesh).size == 1


def _block_fn(cfg: ModelConfig, mesh: AnyMesh | None, remat: str):
    policy = remat_policy(remat, cfg)
    fn = functools.partial(block, cfg=cfg, mesh=mesh)
    return fn if policy is None else jax.checkpoint(fn, policy=policy)


_SUMMED_AUX = {"loss": "moe_loss", "dropped_tokens": "dropped_tokens",
               "overflow_rounds": "overflow_rounds"}
MEAN_AUX = ("load_balance_loss", "seq_aux_loss", "z_loss")


def stacked_aux_name(key: str) -> str:
    """Name of a per-layer aux value stacked over MoE layers: a leading L joins its shape
    suffix (`rows_E` -> `rows_LE`, `tokens_per_expert` [E] -> `tokens_per_expert_LE`), a
    suffix-less per-layer value gets `_L` (`dropped_rows` -> `dropped_rows_L`)."""
    if key == "tokens_per_expert":
        return "tokens_per_expert_LE"
    head, _, tail = key.rpartition("_")
    if head and tail.isalpha() and tail.isupper():
        return f"{head}_L{tail}"
    return f"{key}_L"


def _merge_aux(auxes: list[dict[str, jax.Array]]) -> dict[str, jax.Array]:
    """Merge the MoE layers' aux dicts (in layer order): the losses and counters summed over
    layers (`loss` as `moe_loss`), the balance losses averaged, and every other per-layer value
    stacked along a leading layer axis (see `stacked_aux_name`), so no key is dropped."""
    if not auxes:
        return {"moe_loss": jnp.zeros((), jnp.float32), "dropped_tokens": jnp.zeros((), jnp.int32)}
    out = {}
    for key in auxes[0]:
        values = [a[key] for a in auxes]
        if key in _SUMMED_AUX:
            out[_SUMMED_AUX[key]] = sum(values)
        elif key in MEAN_AUX:
            out[key] = sum(values) / len(values)
        else:
            out[stacked_aux_name(key)] = jnp.stack(values)
    if "rounds" in auxes[0]:   # rounds beyond the first: overflow="rounds" at work
        out["overflow_rounds"] = sum(a["rounds"] - 1 for a in auxes)
    return out


def logits_from_hidden(params: Params, h_BSD: jax.Array, norm_w_D: jax.Array,
                       cfg: ModelConfig) -> jax.Array:
    """Final norm and output head (the embedding, transposed, when tied); float32 logits."""
    z = rms_norm(h_BSD, norm_w_D, cfg.norm_eps)
    w_DV = params["embed"]["w_VD"].T if cfg.tie_embeddings else params["lm_head"]["w_DV"]
    if z.dtype == jnp.float32:
        return jnp.dot(z, w_DV.astype(z.dtype), preferred_element_type=jnp.float32)
    return head_logits(z, w_DV.astype(z.dtype))


@jax.custom_vjp
def head_logits(z_BSD: jax.Array, w_DV: jax.Array) -> jax.Array:
    """z @ w with float32 accumulation -> float32 logits [B, S, V], for z and w in a narrower
    compute dtype. Its backward pass rounds the logits' float32 cotangent to the compute dtype
    before its two products, as every other product's backward does (attention's `_dot`):
    autodiff would hand both products a float32 operand, and a GPU runs them, each as big as
    the forward's, at float32 rate, reading the [B, S, V] cotangent at 4 bytes an element.
    (MaxText and transformers compute the logits themselves in bfloat16; the forward here keeps
    them float32.) Each product accumulates in float32 and is rounded once, as autodiff's."""
    return jnp.dot(z_BSD, w_DV, preferred_element_type=jnp.float32)


def _head_fwd(z_BSD, w_DV):
    return head_logits(z_BSD, w_DV), (z_BSD, w_DV)


def _head_bwd(res, g_BSV):
    z_BSD, w_DV = res
    g_BSV = g_BSV.astype(z_BSD.dtype)
    d_z = jnp.einsum("bsv,dv->bsd", g_BSV, w_DV, preferred_element_type=jnp.float32)
    d_w = jnp.einsum("bsd,bsv->dv", z_BSD, g_BSV, preferred_element_type=jnp.float32)
    return d_z.astype(z_BSD.dtype), d_w.astype(w_DV.dtype)


head_logits.defvjp(_head_fwd, _head_bwd)


def rope_for(tokens_BS: jax.Array, cfg: ModelConfig, positions_BS: jax.Array | None = None
             ) -> tuple[jax.Array, jax.Array]:
    """The model's rotary tables for a [B, S] batch: [S, R2] for positions 0..S-1, or gathered
    at `positions_BS` ([B, S, R2], each position in [0, S))."""
    cos, sin = rope_tables(tokens_BS.shape[1], cfg.rope_dim, cfg.rope_theta, cfg)
    return (cos, sin) if positions_BS is None else rope_at(cos, sin, positions_BS)


def check_documents(tokens_BS: jax.Array, segment_ids_BS: jax.Array | None,
                    positions_BS: jax.Array | None) -> None:
    """ValueError unless token ids are a 2-D integer array and the segment ids and positions
    given are integer arrays of the same shape."""
    if tokens_BS.ndim != 2 or not jnp.issubdtype(tokens_BS.dtype, jnp.integer):
        raise ValueError(f"tokens must be an int array [batch, seq]; got {tokens_BS.dtype}"
                         f"{tuple(tokens_BS.shape)}")
    for name, a in (("segment_ids_BS", segment_ids_BS), ("positions_BS", positions_BS)):
        if a is not None and (a.shape != tokens_BS.shape
                              or not jnp.issubdtype(a.dtype, jnp.integer)):
            raise ValueError(f"{name} must be an int array shaped like the tokens "
                             f"{tuple(tokens_BS.shape)}; got {a.dtype}{tuple(a.shape)}")


def forward(params: Params, tokens_BS: jax.Array, cfg: ModelConfig, *,
            segment_ids_BS: jax.Array | None = None, positions_BS: jax.Array | None = None,
            mesh: AnyMesh | None = None, remat: str = "none"
            ) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """Token ids [B, S] -> (logits_BSV float32, last hidden h_BSD, aux): `hidden`, then the
    final norm and the output head (`logits_from_hidden`)."""
    h_BSD, aux = hidden(params, tokens_BS, cfg, segment_ids_BS=segment_ids_BS,
                        positions_BS=positions_BS, mesh=mesh, remat=remat)
    return logits_from_hidden(params, h_BSD, params["final_norm"]["w_D"], cfg), h_BSD, aux


def hidden(params: Params, tokens_BS: jax.Array, cfg: ModelConfig, *,
           segment_ids_BS: jax.Array | None = None, positions_BS: jax.Array | None = None,
           mesh: AnyMesh | None = None, remat: str = "none"
           ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Token ids [B, S] -> (last hidden h_BSD, before the final norm; aux): the model without
    its output head, for a loss that runs the head itself (train/cross_entropy.py).

    Packed rows: `segment_ids_BS` confines attention to each segment (causal AND same
    segment), `positions_BS` (in [0, S)) gives the rotary positions; either None: a plain
    causal row, positions 0..S-1.

    aux: `moe_loss` (the summed weighted balance losses to add to the objective),
    `dropped_tokens`, `tokens_per_expert_LE` (one row per MoE layer), mean balance losses, and
    every other per-layer MoE aux value stacked over MoE layers (`_merge_aux`). The layers run
    unrolled or, for parameters in the scanned layout, under one lax.scan per run of same-kind
    layers; both give the same numbers.
    Raises ValueError for token ids that are not a 2-D integer array, or segment ids /
    positions not shaped like them.
    """
    check_documents(tokens_BS, segment_ids_BS, positions_BS)
    dt = jnp.dtype(cfg.dtype)
    cos, sin = rope_for(tokens_BS, cfg, positions_BS)
    x = params["embed"]["w_VD"][tokens_BS].astype(dt)
    once = casts_weights_once(mesh)
    layers = {k: compute_weights(params[k], cfg) if once else params[k]
              for k in (PER_LAYER, SCANNED) if k in params}
    x, auxes = run_layers(layers, x, _block_fn(cfg, mesh, remat), cos, sin, segment_ids_BS)
    return x, _merge_aux(auxes)


def mtp_logits(params: Params, h_BSD: jax.Array, tokens_BS: jax.Array, cfg: ModelConfig, *,
               segment_ids_BS: jax.Array | None = None, positions_BS: jax.Array | None = None,
               mesh: AnyMesh | None = None, remat: str = "none"
               ) -> tuple[list[jax.Array], dict]:
    """DeepSeek-V3 multi-token prediction: `mtp_hidden`, then each module's output norm and the
    shared output head. Returns ([logits_BSV per depth], aux)."""
    hs, aux = mtp_hidden(params, h_BSD, tokens_BS, cfg, segment_ids_BS=segment_ids_BS,
                         positions_BS=positions_BS, mesh=mesh, remat=remat)
    return [logits_from_hidden(params, h, m["out_norm_D"], cfg)
            for h, m in zip(hs, params.get("mtp", []))], aux


def mtp_hidden(params: Params, h_BSD: jax.Array, tokens_BS: jax.Array, cfg: ModelConfig, *,
               segment_ids_BS: jax.Array | None = None, positions_BS: jax.Array | None = None,
               mesh: AnyMesh | None = None, remat: str = "none"
               ) -> tuple[list[jax.Array], dict]:
    """DeepSeek-V3 multi-token prediction. Module k (1-based) at position i combines the previous
    depth's hidden state with the embedding of token i+k and predicts token i+k+1; its block
    attends with the row's segment ids and rotary positions of position i, as `forward`.

    Returns ([hidden h_BSD per depth, before its module's `out_norm_D`], aux); positions
    i >= S - k see wrapped tokens, and in a packed row positions whose token i+k lies in
    another segment see another document: both must be masked out of the loss (see
    `dropless.train.step.loss_fn`). Positions that are kept never attend to those.
    """
    check_documents(tokens_BS, segment_ids_BS, positions_BS)
    dt = jnp.dtype(cfg.dtype)
    cos, sin = rope_for(tokens_BS, cfg, positions_BS)
    fn = _block_fn(cfg, mesh, remat)
    out, auxes = [], []
    for k, m in enumerate(params.get("mtp", []), start=1):
        e = params["embed"]["w_VD"][jnp.roll(tokens_BS, -k, axis=1)].astype(dt)
        cat = jnp.concatenate([rms_norm(h_BSD, m["hidden_norm_D"], cfg.norm_eps),
                               rms_norm(e, m["embed_norm_D"], cfg.norm_eps)], axis=-1)
        h_BSD = jnp.dot(cat, m["proj_2DD"].astype(dt), preferred_element_type=dt)
        block = compute_weights(m["block"], cfg) if casts_weights_once(mesh) else m["block"]
        h_BSD, aux = fn(block, h_BSD, cos, sin, segment_ids_BS)
        if aux:
            auxes.append(aux)
        out.append(h_BSD)
    return out, _merge_aux(auxes)
