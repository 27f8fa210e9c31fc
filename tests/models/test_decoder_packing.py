"""Packing with document masks, model side: every document inside a packed batch gives the
logits (and MTP logits) it gives run alone from position 0, for MLA, MHA and GQA, unrolled and
scanned; the packed loss's gradient is the count-weighted sum of the documents' own losses'
gradients; a position outside the loss mask gets exactly zero gradient; padding is finite.

Legend: B rows, S sequence, D model dim, N = B * S positions.

The reference for "run alone" is a batch with one document per row starting at position 0 and
filler after it (one segment per row, positions 0..S-1): causality makes the filler invisible
to the document, and `test_one_segment_per_row_is_the_plain_row` checks that such a row gives
the plain causal row's logits and those of the document at exactly its own length. Packed and
alone batches have the same shape, so each case compiles once.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.config import ModelConfig, MoEConfig, TrainConfig
from dropless.data.batch import Batch
from dropless.models import decoder
from dropless.train import step

S = 12
# rows of (document length, loss mask of its targets or None = all counted); the rest padding.
# Row 0: two documents and padding; row 1: two documents filling it, the first a prompt (not
# counted), a completion and a last target not counted; rows 2 and 3: padding only.
ROWS = [[(5, None), (4, None)],
        [(7, [0, 0, 0, 1, 1, 1, 0]), (5, None)],
        [], []]


def model_cfg(attention: str, scan: bool, **kw) -> ModelConfig:
    moe = MoEConfig(num_experts=4, top_k=2, d_model=16, d_ff=8, num_shared_experts=1,
                    gmm_backend="ragged_dot")
    heads = {"mla": dict(num_heads=2), "mha": dict(num_heads=2, num_kv_heads=2, head_dim=4),
             "gqa": dict(num_heads=4, num_kv_heads=2, head_dim=4)}[attention]
    fields = dict(vocab_size=32, d_model=16, num_layers=3, d_ff=24,
                  attention="mla" if attention == "mla" else "mha", first_k_dense=1, moe=moe,
                  kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6,
                  mtp_depth=1, scan_layers=scan, **heads)
    return ModelConfig(**{**fields, **kw})


def documents(seed: int = 0):
    """[(row, start, tokens_n, targets_n, mask_n)] for ROWS, with random token ids."""
    rng = np.random.default_rng(seed)
    docs = []
    for r, row in enumerate(ROWS):
        start = 0
        for n, mask in row:
            ids = rng.integers(0, 30, n + 1)
            docs.append((r, start, ids[:-1], ids[1:],
                         np.ones(n, np.float32) if mask is None else np.float32(mask)))
            start += n
    return docs


def packed_batch(docs) -> Batch:
    """The packed rows (as many as `alone_batch` has, the last ones padding only): segment ids
    1.. per document, positions from 0 per document, padding (segment 0, token and target 31,
    not counted) after the documents."""
    b = len(ROWS)
    assert b == len(docs)   # as many rows as documents: the alone batch's shape
    tok, tgt = np.full((b, S), 31, np.int32), np.full((b, S), 31, np.int32)
    seg, pos, mask = (np.zeros((b, S), np.int32), np.zeros((b, S), np.int32),
                      np.zeros((b, S), np.float32))
    for i, (r, start, x, y, m) in enumerate(docs):
        sl = slice(start, start + len(x))
        tok[r, sl], tgt[r, sl], mask[r, sl] = x, y, m
        seg[r, sl] = 1 + sum(1 for d in docs[:i] if d[0] == r)
        pos[r, sl] = np.arange(len(x))
    return Batch(tok, tgt, seg, pos, mask)


def alone_batch(docs) -> Batch:
    """One document per row from position 0, filler tokens (not counted) after it: one segment
    per row, positions 0..S-1 (what the plain causal row computes, see
    `test_one_segment_per_row_is_the_plain_row`)."""
    n = len(docs)
    tok, tgt = np.full((n, S), 7, np.int32), np.full((n, S), 7, np.int32)
    mask = np.zeros((n, S), np.float32)
    for i, (_, _, x, y, m) in enumerate(docs):
        tok[i, :len(x)], tgt[i, :len(x)], mask[i, :len(x)] = x, y, m
    return Batch(tok, tgt, np.ones((n, S), np.int32),
                 np.broadcast_to(np.arange(S, dtype=np.int32), (n, S)).copy(), mask)


def by_position(params, batch: Batch):
    """(params, batch) with one embedding row per position (tokens 0..N-1 index a table of the
    batch's embeddings): the gradient of the table's row j is the gradient of the input
    embedding at position j. The output head (untied) still predicts the real targets."""
    b, s = batch.tokens_BS.shape
    table_ND = params["embed"]["w_VD"][batch.tokens_BS].reshape(b * s, -1)
    return (dict(params, embed={"w_VD": table_ND}),
            batch._replace(tokens_BS=np.arange(b * s, dtype=np.int32).reshape(b, s)))


def doc_logits(params, batch: Batch, m: ModelConfig):
    """(logits_BSV, MTP depth-1 logits_BSV) of the document path."""
    kw = dict(segment_ids_BS=batch.segment_ids_BS, positions_BS=batch.positions_BS)
    logits, h, _ = decoder.forward(params, batch.tokens_BS, m, **kw)
    (mtp,), _ = decoder.mtp_logits(params, h, batch.tokens_BS, m, **kw)
    return logits, mtp


# (attention, scanned, gradients too, layers): every attention kind (GQA is mha with fewer kv
# heads), unrolled and scanned; gradients on MLA unrolled and GQA scanned (a scanned run of two
# MoE layers), MoE layers and MTP in every case. Compile time is what limits the cases.
CASES = [("mla", False, True, 2), ("mla", True, False, 2), ("mha", False, False, 2),
         ("mha", True, False, 2), ("gqa", False, False, 2), ("gqa", True, True, 3)]


@pytest.fixture(scope="module", params=CASES, ids=[
    f"{a}-{'scan' if s else 'unrolled'}{'-grad' if g else ''}" for a, s, g, _ in CASES])
def case(request):
    """One compile per case, run on the packed rows and on the documents alone: logits, MTP
    logits and, for the `-grad` cases, the loss and its gradient (per position for the
    embedding, `by_position`)."""
    attention, scan, grads, layers = request.param
    cfg = TrainConfig(model=model_cfg(attention, scan, num_layers=layers), packing="documents")
    params = decoder.init_params(jax.random.key(1), cfg.model)
    docs = documents()

    @jax.jit
    def run(params, batch):
        logits, mtp = doc_logits(params, batch, cfg.model)
        if not grads:
            return logits, mtp, None, None
        (loss, _), g = jax.value_and_grad(step.loss_fn, has_aux=True)(params, batch, cfg)
        return logits, mtp, loss, g
    if grads:
        return docs, [jax.device_get(run(*by_position(params, b)))
                      for b in (packed_batch(docs), alone_batch(docs))]
    return docs, [jax.device_get(run(params, b)) for b in (packed_batch(docs), alone_batch(docs))]


def test_every_document_packed_gives_its_logits_alone(case):
    docs, ((lp, mp, _, _), (la, ma, _, _)) = case
    for i, (r, start, x, _, _) in enumerate(docs):
        n = len(x)
        np.testing.assert_allclose(lp[r, start:start + n], la[i, :n], rtol=1e-5, atol=1e-5)
        # MTP depth 1 at position j reads token j + 1: kept where that is the same document
        np.testing.assert_allclose(mp[r, start:start + n - 1], ma[i, :n - 1],
                                   rtol=1e-5, atol=1e-5)
    assert np.isfinite(lp).all() and np.isfinite(mp).all()   # rows 2 and 3 are padding only


def test_packed_gradient_is_the_weighted_sum_of_the_documents_alone(case):
    """The alone batch's loss is sum_d (counted_d / counted) * loss_d, its gradient the same
    weighted sum of the documents' own gradients (rows do not interact: dropless MoE, no
    balance loss here); the packed batch must give that loss and every gradient, the input
    embeddings' position by position."""
    docs, ((*_, loss_p, g_p), (*_, loss_a, g_a)) = case
    if loss_p is None:
        pytest.skip("gradients are checked in the -grad cases")
    assert loss_p == pytest.approx(loss_a, rel=1e-6)
    rest_p, rest_a = ({k: v for k, v in g.items() if k != "embed"} for g in (g_p, g_a))
    for gp, ga in zip(jax.tree.leaves(rest_p), jax.tree.leaves(rest_a), strict=True):
        np.testing.assert_allclose(gp, ga, rtol=2e-4, atol=1e-6)
    emb_p, emb_a = (g["embed"]["w_VD"].reshape(len(docs), S, -1) for g in (g_p, g_a))
    for i, (r, start, x, _, _) in enumerate(docs):
        np.testing.assert_allclose(emb_p[r, start:start + len(x)], emb_a[i, :len(x)],
                                   rtol=2e-4, atol=1e-6)
    assert np.abs(emb_p).max() > 0


def test_a_target_outside_the_loss_mask_has_exactly_zero_gradient(case):
    """d loss / d (input embedding at position j) is exactly 0.0 where no counted target of
    j's document lies at or after j (a document's last token after a prompt-only tail,
    padding), and not 0 where one does (a prompt token before its counted completion):
    through attention, the MoE layer and MTP."""
    docs, ((*_, g_p), _) = case
    if g_p is None:
        pytest.skip("gradients are checked in the -grad cases")
    packed = packed_batch(docs)
    b, s = packed.tokens_BS.shape
    norms = np.linalg.norm(np.asarray(g_p["embed"]["w_VD"]), axis=-1).reshape(b, s)
    seg, mask = packed.segment_ids_BS, packed.loss_mask_BS
    for r in range(b):
        for j in range(s):
            later = (seg[r] == seg[r, j]) & (np.arange(s) >= j)
            if seg[r, j] > 0 and mask[r][later].any():
                assert norms[r, j] > 0, (r, j)
            else:
                assert norms[r, j] == 0.0, (r, j, norms[r, j])
    assert mask[1, 0] == 0 and norms[1, 0] > 0   # a prompt token: its target is not counted
    assert mask[1, 6] == 0 and norms[1, 6] == 0.0   # the last, after the completion


def test_one_segment_per_row_is_the_plain_row():
    """The oracle's reference: a document alone in a row (one segment, positions 0..S-1,
    filler after it) gives under the document path the logits of the plain causal row, and
    those of the document run at exactly its own length."""
    cfg = model_cfg("mla", False, mtp_depth=0, moe=None, first_k_dense=0, num_layers=2)
    params = decoder.init_params(jax.random.key(1), cfg)
    _, _, x, _, _ = documents()[2]
    alone = alone_batch(documents())
    forward = jax.jit(lambda p, t, **kw: decoder.forward(p, t, cfg, **kw)[0])
    docs = forward(params, alone.tokens_BS, segment_ids_BS=alone.segment_ids_BS,
                   positions_BS=alone.positions_BS)
    plain = forward(params, alone.tokens_BS)
    np.testing.assert_allclose(docs, plain, rtol=1e-5, atol=1e-6)
    own = forward(params, jnp.asarray(x, jnp.int32)[None])
    np.testing.assert_allclose(plain[2, :len(x)], own[0], rtol=1e-5, atol=1e-6)


def test_segment_ids_shaped_unlike_the_tokens_are_refused():
    cfg = model_cfg("mla", False)
    params = decoder.init_params(jax.random.key(1), cfg)
    tokens = jnp.zeros((2, 4), jnp.int32)
    with pytest.raises(ValueError, match="segment_ids_BS"):
        decoder.forward(params, tokens, cfg, segment_ids_BS=jnp.zeros((2, 3), jnp.int32))
    with pytest.raises(ValueError, match="positions_BS"):
        decoder.forward(params, tokens, cfg, positions_BS=jnp.zeros((2, 4), jnp.float32))
