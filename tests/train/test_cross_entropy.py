"""Vocabulary tiling (`TrainConfig.num_vocab_tiling`, train/cross_entropy.py): the loss's
per-position cross-entropy computed tiles of the sequence at a time equals, to rounding, the
reference: the whole logits from the model's head and optax's integer-label cross-entropy, in
value and gradient (hidden state, final norm, head weight; tied and untied heads, float32 and
bfloat16 compute). The train step's loss, metrics and gradients (MTP, packed documents,
gradient accumulation) and the eval sums are the untiled step's. No [B, S, V] array is made,
the compiled backward pass holds a tile's logits at a time, and a tile count that does not
divide the sequence is refused in one line, from the API and the command line."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dropless.cli.main import main
from dropless.config import ModelConfig
from dropless.config_file import build_config
from dropless.data.batch import Batch
from dropless.models import decoder
from dropless.train import cross_entropy as ce
from dropless.train import step

from tests._support.jaxpr_walk import traced
from tests._support.train_mini import STEP_KEYS

B, S, D, V = 2, 16, 24, 96


def head_params(tied: bool, dtype: str, seed: int = 0):
    cfg = ModelConfig(vocab_size=V, d_model=D, num_layers=1, num_heads=2, d_ff=64,
                      tie_embeddings=tied, dtype=dtype, weight_dtype="float32")
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    params = {"embed": {"w_VD": jax.random.normal(k[0], (V, D)) * 0.3},
              "final_norm": {"w_D": 1 + 0.1 * jax.random.normal(k[1], (D,))}}
    if not tied:
        params["lm_head"] = {"w_DV": jax.random.normal(k[2], (D, V)) * 0.3}
    h = jax.random.normal(k[3], (B, S, D)).astype(dtype)
    targets = jax.random.randint(jax.random.PRNGKey(seed + 1), (B, S), 0, V)
    return cfg, params, h, targets


def reference_nll(params, h, norm_w, targets, cfg):
    """The whole head's logits and optax's cross-entropy: what tiling must not change."""
    logits = decoder.logits_from_hidden(params, h, norm_w, cfg).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets)


def value_and_grads(fn, params, h, targets, cfg, cot):
    def loss(p, h):
        return jnp.sum(fn(p, h, p["final_norm"]["w_D"], targets, cfg) * cot)
    return jax.jit(jax.value_and_grad(loss, (0, 1)))(params, h)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tiles", [2, 4, S])
def test_tiles_are_the_whole_heads_cross_entropy(tiles, dtype, tied):
    cfg, params, h, targets = head_params(tied, dtype)
    cot = jax.random.uniform(jax.random.PRNGKey(7), (B, S))   # a masked mean's weights
    got = jax.jit(lambda p, h: ce.nll_from_hidden(p, h, p["final_norm"]["w_D"], targets, cfg,
                                                  tiles))(params, h)
    want = jax.jit(lambda p, h: reference_nll(p, h, p["final_norm"]["w_D"], targets, cfg))(
        params, h)
    assert got.shape == (B, S) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    tiled = value_and_grads(lambda *a: ce.nll_from_hidden(*a, tiles), params, h, targets, cfg,
                            cot)
    whole = value_and_grads(reference_nll, params, h, targets, cfg, cot)
    tol = 1e-5 if dtype == "float32" else 2e-2    # bf16: the head's cotangent is rounded
    for g, w in zip(jax.tree.leaves(tiled[1]), jax.tree.leaves(whole[1])):
        np.testing.assert_allclose(np.float32(g), np.float32(w), rtol=tol,
                                   atol=tol * float(np.abs(np.float32(w)).max()))


def test_one_tile_is_the_untiled_arithmetic_bit_for_bit():
    cfg, params, h, targets = head_params(False, "float32")
    got = ce.nll_from_hidden(params, h, params["final_norm"]["w_D"], targets, cfg, 1)
    logits = decoder.logits_from_hidden(params, h, params["final_norm"]["w_D"], cfg)
    np.testing.assert_array_equal(got, ce.token_nll(logits, targets))


def test_a_tiled_loss_never_makes_the_whole_logits():
    cfg, params, h, targets = head_params(False, "float32")

    def loss(p, h):
        return ce.nll_from_hidden(p, h, p["final_norm"]["w_D"], targets, cfg, 4).sum()
    shapes = {tuple(v.aval.shape) for e in traced(jax.grad(loss, (0, 1)), params, h)
              for v in e.outvars}
    assert (B, S // 4, V) in shapes                       # a tile's logits are made
    logits_like = {s for s in shapes if len(s) >= 2 and s[-1] == V and s != (D, V)}
    assert all(np.prod(s[:-1]) <= B * S // 4 for s in logits_like), sorted(logits_like)


def test_the_compiled_backward_holds_a_tile_of_logits():
    """XLA's temporaries for the gradient: the whole head holds its [B, S, V] float32 logits
    and their cotangent; 8 tiles hold one tile's and the head weight's float32 gradient."""
    b, s, d, v = 2, 256, 64, 8192
    cfg = ModelConfig(vocab_size=v, d_model=d, num_layers=1, num_heads=2, d_ff=64,
                      dtype="float32", weight_dtype="float32")
    params = {"lm_head": {"w_DV": jnp.full((d, v), 0.01)}, "final_norm": {"w_D": jnp.ones(d)}}
    h, t = jnp.ones((b, s, d)), jnp.zeros((b, s), jnp.int32)

    def temp(tiles):
        def loss(p, h):
            return ce.nll_from_hidden(p, h, p["final_norm"]["w_D"], t, cfg, tiles).sum()
        compiled = jax.jit(jax.grad(loss, (0, 1))).lower(params, h).compile()
        return compiled.memory_analysis().temp_size_in_bytes
    logits, weight = b * s * v * 4, d * v * 4
    whole, tiled = temp(1), temp(8)
    assert whole >= 2 * logits, (whole, logits)
    assert tiled <= 2 * logits / 8 + 2 * weight, (tiled, logits, weight)


def test_tiles_must_divide_the_sequence():
    cfg, params, h, targets = head_params(False, "float32")
    with pytest.raises(ValueError, match=r"num_vocab_tiling=3 must divide the sequence's 16 "):
        ce.nll_from_hidden(params, h, params["final_norm"]["w_D"], targets, cfg, 3)


KEYS = STEP_KEYS   # the train step: an MLA model, a dense and an MoE layer, MTP 1


def packed(rows: int, seq: int) -> Batch:
    rng = np.random.default_rng(0)
    seg = np.ones((rows, seq), np.int32)
    seg[:, seq // 2:] = 2
    seg[0, -3:] = 0                                       # padding
    pos = np.where(seg == 2, np.arange(seq) - seq // 2, np.arange(seq)).astype(np.int32)
    mask = (seg > 0) & (rng.random((rows, seq)) > 0.2)
    return Batch(rng.integers(0, 200, (rows, seq), dtype=np.int32),
                 rng.integers(0, 200, (rows, seq), dtype=np.int32), seg, pos,
                 mask.astype(np.float32))


def test_the_train_steps_loss_and_gradients_are_the_untiled_steps():
    """In 2 micro-batches, whose cross-entropy sums divide by the whole batch's targets (the
    one-pass step's arithmetic is the same `mean_nll` of the same tiles)."""
    base = build_config(list({**KEYS, "gradient_accumulation_steps": 2}.items()))
    params = step.init_state(base)[0]["params"]
    batch = packed(8, 12)
    out = {}
    for tiles in (1, 4):
        cfg = base.replace(num_vocab_tiling=tiles)
        out[tiles] = jax.jit(lambda p, b, c=cfg: step.loss_and_grads(p, b, cfg=c))(params, batch)
    (m1, g1), (m4, g4) = out[1], out[4]
    for key in ("loss", "ce_loss", "mtp_loss", "moe_loss"):
        np.testing.assert_allclose(m4[key], m1[key], rtol=1e-6, err_msg=key)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g4), jax.tree.leaves(g1)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * float(np.abs(b).max()) + 1e-12,
                                   err_msg=jax.tree_util.keystr(path))
    e1 = step.eval_sums(params, batch, cfg=base)
    e4 = step.eval_sums(params, batch, cfg=base.replace(num_vocab_tiling=4))
    np.testing.assert_allclose(e4.nll, e1.nll, rtol=1e-6)
    assert float(e4.targets) == float(e1.targets)


@pytest.mark.parametrize("value, why", [
    (5, "must divide seq_len=12"), (0, "must be a positive int"),
    (-2, "must be a positive int"), (True, "must be an int, not a boolean")])
def test_a_bad_tile_count_is_refused_in_one_line(value, why, capsys):
    with pytest.raises(ValueError, match=f"num_vocab_tiling.*{why}"):
        build_config(list({**KEYS, "num_vocab_tiling": value}.items()))
    assert main(["config", "show", "--preset", "tiny", "seq_len=12",
                 f"num_vocab_tiling={str(value).lower()}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "num_vocab_tiling" in err[0] and why in err[0], err


def test_maxtexts_key_reads_and_writes_back():
    from dropless.compat import maxtext, maxtext_out
    cfg = build_config([("preset", "deepseek3-1gpu"), ("num_vocab_tiling", 4)])
    said = dict(maxtext_out.items(cfg))
    assert said["num_vocab_tiling"] == 4
    assert dict(maxtext.translate([("num_vocab_tiling", 6)]))["num_vocab_tiling"] == 6
