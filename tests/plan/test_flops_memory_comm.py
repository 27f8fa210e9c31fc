"""FLOPs, activation bytes and EP/FSDP bytes: hand counts and independent references
(XLA's cost analysis of the real layer, a Monte Carlo of real routing)."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.config import MeshConfig, ModelConfig
from dropless.machine import get_profile
from dropless.models import arithmetic as ar
from dropless.plan import comm, flops, memory
from dropless.plan.layout import group, groups, node_size
from dropless.presets import get_preset
from tests._support.model_configs import model_config
from tests.plan.plans import plan_of

TINY = model_config(vocab_size=10, d_model=8, num_layers=2, num_heads=2, num_kv_heads=1,
                  head_dim=4, d_ff=16, attention="mha", first_k_dense=1, num_experts=4,
                  top_k=2, moe_d_ff=6, num_shared_experts=1)


def test_layer_flops_hand_count():
    # per token forward, S=8: projections 2*192=384; causal attention 2*(8/2)*H2*(4+4)=128
    dense = ar.layer_forward_flops(TINY, 8, False)
    assert dense == {"gemm": 384 + 2 * 3 * 8 * 16, "gmm": 0.0, "attention": 128.0}
    moe = ar.layer_forward_flops(TINY, 8, True)
    # router 2*8*4=64, shared 2*3*8*6=288, routed 2*3*8*6*K2=576
    assert moe == {"gemm": 384 + 64 + 288, "gmm": 576.0, "attention": 128.0}
    # model: both layers + head 2*8*10=160, x3 for training
    total = sum(dense.values()) + sum(moe.values()) + 160
    assert ar.model_flops_per_token(TINY, 8) == 3 * total


def test_ffn_flops_match_xla_cost_analysis():
    from dropless.config import MoEConfig
    from dropless.moe import init_params
    from dropless.moe.ffn import swiglu_ffn
    cfg = MoEConfig(num_experts=4, top_k=2, d_model=64, d_ff=96, num_shared_experts=2)
    p = init_params(jax.random.key(0), cfg)["shared"]
    x = jnp.ones((128, 64), jnp.float32)
    cost = jax.jit(lambda x: swiglu_ffn(p, x, cfg.dtype)).lower(x).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    s = model_config(vocab_size=2, d_model=64, num_layers=1, num_heads=1, d_ff=8,
                   num_experts=4, top_k=2, moe_d_ff=96, num_shared_experts=2)
    planned = 2 * 3 * s.d_model * s.moe.d_ff * s.moe.num_shared_experts * 128
    # XLA counts the matmuls plus a few elementwise flops of silu*up
    assert planned <= cost["flops"] < planned * 1.05


def test_saved_activations_by_policy_hand_count():
    b = 2
    tensors = memory.layer_tensors(TINY, b, False)
    names = {t.name: t for t in tensors}
    # full: only the layer input (D=8 elements of 2 bytes)
    assert memory.saved_bytes_per_token(tensors, "full", (), 1.0) == (16, 0)
    # offload: input on device; query (H*Kh=8) and value (G*Kh=4) on host
    assert memory.saved_bytes_per_token(tensors, "offload", ("query", "value"), 1.0) == (16, 24)
    # none keeps everything; minimal keeps input + matmul outputs
    every = sum(t.elems * t.nbytes for t in tensors)
    assert memory.saved_bytes_per_token(tensors, "none", (), 1.0) == (every, 0)
    dots = sum(t.elems * t.nbytes for t in tensors if t.kind in ("input", "dot"))
    assert memory.saved_bytes_per_token(tensors, "minimal", (), 1.0) == (dots, 0)
    assert names["attn_lse"].nbytes == 4


def test_buffer_factor_scales_expert_side_only():
    tensors = memory.layer_tensors(TINY, 2, True)
    d1, _ = memory.saved_bytes_per_token(tensors, "none", (), 1.0)
    d2, _ = memory.saved_bytes_per_token(tensors, "none", (), 2.0)
    expert = sum(t.elems * t.nbytes for t in tensors if t.kind.startswith("expert"))
    assert d2 - d1 == expert > 0


def test_parameter_memory_hand_count():
    hw = get_profile("h100")
    # vocabulary 12: every FSDP dim divides fsdp x expert = 4, as the trainer needs to split it
    model = TINY.replace(vocab_size=12, dtype="bfloat16", weight_dtype="float32")
    cfg = plan_of(model, fsdp=2, ep=2, seq=8, optimizer_dtype="float32")
    m = memory.memory_per_device(cfg, hw)
    experts = 4 * 3 * 8 * 6           # one MoE layer's routed experts: over expert x fsdp
    replicated = 8 + 2 * 16 + 8 * 4 + 4   # final norm, the layers' norms, router and bias
    rest = 96 + 96 + 8 + 592 + 964 - experts - replicated   # over fsdp x expert too
    per_dev = experts / 4 + rest / 4 + replicated
    assert per_dev == 496
    assert m["parameters"] == pytest.approx(per_dev * 4)
    assert m["optimizer_state"] == pytest.approx((per_dev - 4) * 8)   # the bias: no moments


def test_expected_devices_hand_case():
    # E=4 on 2 devices, K=2: P(device hit) = 1 - C(2,2)/C(4,2) = 5/6; two devices -> 5/3
    s = model_config(vocab_size=2, d_model=2, num_layers=1, num_heads=1, d_ff=2,
                   num_experts=4, top_k=2, moe_d_ff=2)
    assert comm.expected_devices_per_token(s, 2) == pytest.approx(5 / 3)
    assert comm.expected_devices_per_token(s, 1) == 1.0
    assert comm.expected_devices_per_token(s, 4) == pytest.approx(2.0)  # one expert a device


def _routed_devices(s: ModelConfig, ep: int, n: int = 4096) -> float:
    """Distinct devices per token from the real router (sigmoid scores, group limiting) on
    random logits: an independent reference for the planner's expectation."""
    from dropless.config import MoEConfig
    from dropless.moe.router import route
    cfg = MoEConfig(num_experts=s.moe.num_experts, top_k=s.moe.top_k, d_model=8, d_ff=8,
                    score_func="sigmoid", n_groups=s.moe.n_groups, topk_groups=s.moe.topk_groups)
    logits = jax.random.normal(jax.random.key(1), (n, s.moe.num_experts))
    ids = np.asarray(route(logits, jnp.zeros((s.moe.num_experts,)), cfg).ids_TK)
    dev = ids // (s.moe.num_experts // ep)
    return float(np.mean([len(set(r)) for r in dev]))


@pytest.mark.parametrize("groups_, topk_groups, ep", [(1, 1, 8), (8, 4, 8), (8, 4, 64)])
def test_expected_devices_match_real_routing(groups_, topk_groups, ep):
    s = model_config(vocab_size=2, d_model=2, num_layers=1, num_heads=1, d_ff=2,
                   num_experts=256, top_k=8, moe_d_ff=2, n_groups=groups_,
                   topk_groups=topk_groups)
    assert comm.expected_devices_per_token(s, ep) == pytest.approx(_routed_devices(s, ep),
                                                                  rel=0.03)


def test_group_limited_routing_caps_devices():
    # DeepSeek-V3 at EP=8: one group per device, 4 groups chosen -> at most 4 devices
    s = model_config(vocab_size=2, d_model=2, num_layers=1, num_heads=1, d_ff=2,
                   num_experts=256, top_k=8, moe_d_ff=2, n_groups=8, topk_groups=4)
    assert 3.5 < comm.expected_devices_per_token(s, 8) <= 4.0
    s1 = s.replace(moe=s.moe.replace(n_groups=1, topk_groups=1))
    assert comm.expected_devices_per_token(s1, 8) > 4.5   # unrestricted: ~5.3


def test_ring_bytes_and_groups():
    hw = get_profile("gb300")
    cfg = plan_of(get_preset("deepseek3-671b"), fsdp=16, ep=8)
    assert node_size(cfg, hw) == 64            # NVL72 runs 64 of 72 for 128 GPUs
    assert node_size(cfg, get_profile("h100")) == 8
    g = groups(cfg, hw)
    assert (g["expert"].inner, g["expert"].outer) == (8, 1)
    # the routed experts' FSDP dim: fsdp 16 at stride 8, 8 of them in a node of 64
    assert (g["experts_gather"].size, g["experts_gather"].inner) == (16, 8)
    # the other matrices' FSDP dim: fsdp x expert, all 128 devices, 64 in a node
    g_sharded = g["sharded_gather"]
    assert (g_sharded.size, g_sharded.stride, g_sharded.inner, g_sharded.outer) == (128, 1, 64, 2)
    # every gradient shard's replicas: the data axis (1 here), for experts and the others alike
    assert g["experts_replicas"] == g["sharded_replicas"] == group(1, 128, 64)
    # 16 devices, 8 per node, 2 nodes: all-gather of 160 bytes
    rb = comm.ring_bytes(160.0, group(16, 8, 64))
    assert rb == {"intra": 160 * 7 / 8, "inter": 160 * 1 / 16}


def test_ep_bytes_dedup_and_padding():
    hw = get_profile("h100")
    s = model_config(vocab_size=2, d_model=4, num_layers=2, num_heads=1, d_ff=2,
                   num_experts=4, top_k=2, moe_d_ff=2, dtype="bfloat16")
    cfg = plan_of(s, ep=2, seq=6).replace_moe(ragged_buffer_factor=2.0, dispatcher="a2a")
    # without dedup: K=2 rows per token, half leave the device: 6 tokens * 1 row * (4*2 + 8)
    nd = comm.ep_bytes_per_transfer(cfg, hw, dedup=False, padded=False)
    assert nd == {"intra": 6 * 1 * 16, "inter": 0.0}
    # with dedup: 5/3 rows per token, 5/6 leave; row carries K ids+weights: 4*2 + 16
    d = comm.ep_bytes_per_transfer(cfg, hw, dedup=True, padded=False)
    assert d["intra"] == pytest.approx(6 * 5 / 6 * 24)
    padded = comm.ep_bytes_per_transfer(cfg, hw, dedup=True, padded=True)
    assert padded["intra"] == pytest.approx(2 * d["intra"])
    ragged = comm.ep_bytes_per_transfer(cfg.replace_moe(dispatcher="ragged_a2a"), hw)
    assert ragged["intra"] == pytest.approx(d["intra"])


def test_padding_fraction():
    s = model_config(vocab_size=2, d_model=2, num_layers=1, num_heads=1, d_ff=2,
                   num_experts=8, top_k=2, moe_d_ff=2)
    # 4 local experts x 64 rows of padding over 1000*2 rows
    assert flops.padding_fraction(s, 1000, 2, 128) == pytest.approx(4 * 64 / 2000)
    assert math.isclose(flops.padding_fraction(s, 1000, 8, 128), 64 / 2000)


@pytest.mark.parametrize("name", ["tiny", "deepseek3-test"])
def test_parameter_memory_matches_the_trainers_arrays(name):
    """Weight bytes on one device = the bytes of the trainer's real parameter tree (f32)."""
    presets = pytest.importorskip("dropless.presets")
    from dropless.models.decoder import init_params
    cfg = presets.get_preset(name)
    shapes = jax.eval_shape(lambda k: init_params(k, cfg), jax.random.key(0))
    real = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(shapes))
    plan = plan_of(cfg, seq=16)   # the model's own weight dtype
    m = memory.memory_per_device(plan, get_profile("h100"))
    assert m["parameters"] == real
    # fsdp 2 x ep 2: each array's shard as the trainer places it (parallel.sharding)
    from dropless.parallel import make_mesh, param_shardings
    mesh = MeshConfig(fsdp=2, expert=2)
    placed = param_shardings(shapes, make_mesh(mesh, jax.devices()[:4]))
    leaves = zip(jax.tree_util.tree_leaves(shapes), jax.tree_util.tree_leaves(placed))
    local = sum(math.prod(p.shard_shape(x.shape)) * x.dtype.itemsize for x, p in leaves)
    m4 = memory.memory_per_device(plan.replace_run(mesh=mesh), get_profile("h100"))
    assert m4["parameters"] == local


def test_ep_rows_match_the_measured_a2a_dispatcher():
    """Against a measurement: `dropless bench dispatch` (branch ep, benchmarks/results/
    dispatch_cpu8.jsonl) ran the a2a dispatcher with dedup on 8 host devices, 2 nodes of 4,
    4096 tokens, 64 experts, top-8 under uniform-ish routing and counted 22,195 rows sent,
    8,261 to other devices of the node and 11,166 to the other node."""
    s = model_config(vocab_size=2, d_model=256, num_layers=1, num_heads=1, d_ff=2,
                   num_experts=64, top_k=8, moe_d_ff=256)
    cfg = plan_of(s, ep=8, seq=512).replace_run(mesh=MeshConfig(expert=8, dcn_expert=2))
    rows = comm.ep_rows(cfg, get_profile("h100"))
    assert rows["per_token"] * 4096 == pytest.approx(22195, rel=0.02)
    assert rows["intra"] * 4096 == pytest.approx(8261, rel=0.03)
    assert rows["inter"] * 4096 == pytest.approx(11166, rel=0.03)
    # and its DeepSeek-V3 projection from a routing sample: 7.47 devices per token at EP 64
    from dropless.presets import get_preset
    ds = get_preset("deepseek3-671b")
    assert comm.expected_devices_per_token(ds, 64) == pytest.approx(7.473, rel=0.02)
