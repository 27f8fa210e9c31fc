"""The memory model's two layer layouts (plan/memory.py's module docstring), counted by hand on
a two-layer dense model; against XLA's compiled step: tests/train/test_preflight*_gpu_compile.py.

The model: vocabulary 10, d 8, 2 dense layers, MHA with 2 query heads and 1 key/value head of 4,
d_ff 16, sequence 8, batch 1 (T = 8 tokens), flash attention. Parameters: embedding 80, head 80,
final norm 8, a layer 592 (attention 8x8 + 8x4 + 8x4 + 8x8 = 192, two norms 16, SwiGLU 3 x 8 x
16 = 384): 1352 in all, 160 in the embedding and head, 1192 in the rest (the blocks and the
final norm: what the planner counts as cast to the compute dtype, `compute_weight_params`).
Activations per token in bf16 (2 bytes an element): the attention block's layer_input 8,
attn_norm 8, query 8, key 4, value 4, qk_rope (2+1) x 4 = 12, attn_out 8, out_proj 8 = 60
elements, 120 bytes, plus the float32 attn_lse of 2 heads, 8 bytes: 128; the feed-forward's
mlp_input 8, mlp_norm 8, gate 16, up 16, hidden 16, down 8 = 72 elements: 144. Kept by
remat=minimal (inputs and matmul outputs): 8 + 8 + 4 + 4 + 8 + 16 + 16 + 8 = 72 elements, 144
bytes; by remat=full the layer input alone, 16 bytes. Logits: 8 tokens x 10 x (2 + 4) = 480.
"""
import pytest

from dropless.machine import get_profile
from dropless.plan import memory
from tests._support.model_configs import model_config
from tests.plan.plans import plan_of

DENSE = model_config(vocab_size=10, d_model=8, num_layers=2, num_heads=2, num_kv_heads=1,
                     head_dim=4, d_ff=16, attention="mha")
PARTS = ("parameters", "gradients", "grad_accumulator", "optimizer_state", "gathered_weights",
         "compute_weights", "activations", "layer_workspace", "logits", "ep_buffers")


def _memory(scan: bool, remat: str, weight_dtype: str, vocab: int = 10) -> dict:
    model = DENSE.replace(scan_layers=scan, dtype="bfloat16", weight_dtype=weight_dtype,
                          vocab_size=vocab)
    return memory.memory_per_device(plan_of(model, seq=8, remat=remat), get_profile("h100"))


def _parts(m: dict) -> dict:
    return {p: m[p] for p in PARTS}


def test_scanned_holds_all_activations_all_gradients_a_layer_and_the_logits():
    # float32 weights cast once to bf16 on one device; float32 Adam moments
    m = _memory(True, "minimal", "float32")
    assert _parts(m) == {
        "parameters": 1352 * 4, "gradients": 1352 * 4, "grad_accumulator": 0.0,
        "optimizer_state": 1352 * 8,
        "gathered_weights": 2 * 592 * 2,          # two layers' weights in bf16
        "compute_weights": 1192 * 2,
        "activations": 2 * 144 * 8,               # both layers' kept tensors, 8 tokens
        "layer_workspace": 2 * (128 + 144) * 8,   # one whole layer and its gradients
        "logits": 480.0, "ep_buffers": 0.0}
    assert m["total"] == 33520 == sum(_parts(m).values())


def test_unrolled_frees_activations_for_gradients_and_runs_one_block_at_a_time():
    """Cast once: a block's bf16 gradients take its freed cast weights' place; at the start of
    the layers' backward only the embedding's and head's float32 gradients (160 x 4) are
    written. The workspace is the larger block (the feed-forward, 144 a token)
    twice; the logits (480) are under it, so they add nothing."""
    m = _memory(False, "minimal", "float32")
    assert _parts(m) == {
        "parameters": 1352 * 4, "gradients": 160 * 4, "grad_accumulator": 0.0,
        "optimizer_state": 1352 * 8, "gathered_weights": 2 * 592 * 2,
        "compute_weights": 1192 * 2, "activations": 2 * 144 * 8,
        "layer_workspace": 2 * 144 * 8, "logits": 0.0, "ep_buffers": 0.0}
    assert m["total"] == 26224 == sum(_parts(m).values())
    assert m["total"] < _memory(True, "minimal", "float32")["total"]


def test_unrolled_peak_at_the_end_of_the_backward_where_gradients_outweigh_activations():
    """bf16 weights (nothing cast): the blocks' gradients (1192 x 2 = 2384 bytes) exceed the
    kept activations of remat=full (2 layers x 16 bytes x 8 tokens = 256); the peak is the end
    of the backward pass, and `gradients` is the embedding's and head's (160 x 2) plus the 2128
    the blocks' add beyond the activations they replace."""
    m = _memory(False, "full", "bfloat16")
    assert _parts(m) == {
        "parameters": 1352 * 2, "gradients": 160 * 2 + 2384 - 256, "grad_accumulator": 0.0,
        "optimizer_state": 1352 * 8, "gathered_weights": 2 * 592 * 2,
        "compute_weights": 0.0, "activations": 256.0,
        "layer_workspace": 2 * 144 * 8, "logits": 0.0, "ep_buffers": 0.0}
    assert m["total"] == 20896
    # activations and gradients together: the larger end of the backward pass, 2384 + 320
    assert m["activations"] + m["gradients"] == 2384 + 320


def test_unrolled_logits_count_where_they_exceed_a_blocks_workspace():
    # vocabulary 1000: logits 8 x 1000 x 6 = 48000 bytes, over the workspace's 2304
    m = _memory(False, "minimal", "float32", vocab=1000)
    assert m["layer_workspace"] == 2304 and m["logits"] == 48000 - 2304
    scanned = _memory(True, "minimal", "float32", vocab=1000)
    assert scanned["logits"] == 48000 and scanned["layer_workspace"] == 4352


def test_unrolled_naive_attention_holds_three_of_its_four_s_by_s_products():
    """attention_impl=naive, S = 8: the float32 scores (2 heads x 8 x 4 bytes = 64 a token)
    and the bf16 probabilities (32) replace the 8-byte lse: the attention block is 120 + 64 +
    32 = 216 bytes a token. Its workspace is twice that less the probabilities' gradient
    (2 x 216 - 32 = 400, over the feed-forward's 288), 8 tokens: 3200. Scanned: twice the whole
    layer, 2 x (216 + 144) x 8 = 5760."""
    model = DENSE.replace(dtype="bfloat16", weight_dtype="float32")
    plan = plan_of(model, seq=8, remat="minimal", attention_impl="naive")
    m = memory.memory_per_device(plan, get_profile("h100"))
    assert m["layer_workspace"] == 3200
    assert m["activations"] == 2 * 144 * 8   # minimal keeps no S x S product
    scanned = plan_of(model.replace(scan_layers=True), seq=8, remat="minimal",
                      attention_impl="naive")
    assert memory.memory_per_device(scanned, get_profile("h100"))["layer_workspace"] == 5760


@pytest.mark.parametrize("scan", [False, True])
def test_the_total_is_the_sum_of_the_parts(scan):
    m = _memory(scan, "minimal", "float32")
    assert m["total"] == sum(_parts(m).values())
    assert m["fits"] and m["headroom"] == m["usable"] - m["total"]


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_the_plan_names_the_layout_its_memory_follows(scan):
    from dropless.plan.model import predict
    from dropless.plan.report import format_plan
    result = predict(plan_of(DENSE.replace(scan_layers=scan), seq=8), get_profile("h100"))
    assert result["layout"]["scan_layers"] is scan
    layout_line = format_plan(result).splitlines()[1]
    assert layout_line.endswith(", layers scanned" if scan else ", layers unrolled")
