"""The GPU path without a GPU: `gmm_backend="auto"` functions lowered for CUDA on this CPU host.

Legend: G groups (experts), M routed rows, K contraction dim, N output dim, T tokens.

A CUDA module is right when its grouped matmuls are Pallas/Triton kernels
(`__gpu$xla.gpu.triton` custom calls), it holds no `ragged_dot` (XLA runs that zero-padded on
CUDA) and no [G, M, ...] intermediate (the padded product's shape), and every Triton module in
it parses and verifies as XLA parses it (tests/ops/gmm/test_triton_check.py shows that check
failing on invalid IR). Each structural check is also shown to fail on a module that has the
problem (the ragged_dot and padded backends), so it can fail. Lowering targets an abstract
H200 (`triton_check.cuda_lowered`): jax >= 0.11 asks for the target GPU.
"""
import functools
import re

import jax
import jax.numpy as jnp
import pytest

from dropless.config import MoEConfig
from dropless.config_file import build_config
from dropless.moe import apply, init_params
from dropless.ops import grouped_matmul
from dropless.ops.gpu import triton_check
from dropless.ops.gmm.registry import tokamax_available
from dropless.train import step

TRITON = triton_check.TRITON_TARGET


def cuda_text(fn, *args) -> str:
    """The CUDA module's text, after verifying every Triton kernel in it as XLA would."""
    lowered = triton_check.cuda_lowered(fn, *args)
    for kernel in triton_check.triton_kernels(lowered):
        triton_check.verify(kernel)
    return lowered.as_text()


def problems(text: str, g: int, m: int) -> list[str]:
    """What makes a CUDA module use the padded path: ragged_dot, or a [G, M, ...] tensor."""
    found = []
    if "ragged_dot" in text:
        found.append("ragged_dot op")
    if re.search(rf"tensor<{g}x{m}x", text):
        found.append(f"[{g}, {m}, ...] tensor")
    if TRITON not in text:
        found.append("no Triton kernel")
    return found


G, M, K, N = 6, 56, 24, 40
SIZES = jnp.array([9, 0, 20, 1, 3, 13], jnp.int32)  # sum 46 < M: 10 zero rows


def gmm_fwd_bwd(backend):
    def f(lhs, rhs, gs, dy):
        out, vjp = jax.vjp(lambda a, b: grouped_matmul(a, b, gs, backend=backend), lhs, rhs)
        return out, vjp(dy)
    return f


def gmm_args(dtype=jnp.bfloat16):
    return (jnp.ones((M, K), dtype), jnp.ones((G, K, N), dtype), SIZES, jnp.ones((M, N), dtype))


def test_grouped_matmul_auto_lowers_to_triton_kernels_for_cuda():
    text = cuda_text(gmm_fwd_bwd("auto"), *gmm_args())
    assert problems(text, G, M) == []
    if not tokamax_available():  # our three kernels: forward, dlhs, drhs
        for name in ("dropless_gmm", "dropless_gmm_dlhs", "dropless_gmm_drhs"):
            assert f'name = "{name}"' in text, name
    # and the CPU module of the same function is the tiled backend, with no Triton call
    cpu = jax.jit(gmm_fwd_bwd("auto")).trace(*gmm_args()).lower(
        lowering_platforms=("cpu",)).as_text()
    assert TRITON not in cpu and "ragged_dot" not in cpu


@pytest.mark.parametrize("backend,expected", [("ragged_dot", "ragged_dot op"),
                                              ("padded", f"[{G}, {M}, ...] tensor")])
def test_the_checks_catch_the_padded_paths(backend, expected):
    text = cuda_text(gmm_fwd_bwd(backend), *gmm_args())
    assert expected in problems(text, G, M)


def test_pallas_gpu_by_name_lowers_for_cuda_in_f32_and_f16():
    for dt in (jnp.float32, jnp.float16):
        text = cuda_text(gmm_fwd_bwd("pallas_gpu"), *gmm_args(dt))
        assert problems(text, G, M) == [] and text.count(TRITON) == 3, dt


def test_moe_layer_auto_lowers_for_cuda():
    cfg = MoEConfig(num_experts=G, top_k=2, d_model=16, d_ff=24, dtype="bfloat16",
                    weight_dtype="bfloat16")
    # lowering needs shapes only: abstract parameters, no random initialisation to compile
    params = jax.eval_shape(lambda: init_params(jax.random.PRNGKey(0), cfg))
    x_TD = jax.ShapeDtypeStruct((20, 16), jnp.bfloat16)  # T=20 tokens -> M = 40 routed rows

    def loss(p, x):
        y, aux = apply(p, x, cfg)
        return jnp.sum(y.astype(jnp.float32)) + aux["loss"]
    text = cuda_text(jax.value_and_grad(loss), params, x_TD)
    assert problems(text, G, 40) == []
    # gate, up, down forwards; drhs of all three; dlhs of down only (x is not differentiated,
    # so gate's and up's input gradients are not needed and XLA does not compute them)
    assert text.count(TRITON) == 3 + 3 + 1


@pytest.fixture(scope="module")
def train_cfg():
    items = {"model.d_model": 32, "model.num_layers": 2, "model.num_heads": 2,
             "model.d_ff": 64, "model.kv_lora_rank": 16, "model.qk_nope_head_dim": 8,
             "model.qk_rope_head_dim": 8, "model.v_head_dim": 8, "model.moe.d_ff": 16,
             "model.moe.num_experts": 6, "model.moe.gmm_backend": "auto",
             "per_device_batch_size": 2, "seq_len": 24}
    return build_config(list(items.items()))


def test_train_step_auto_lowers_for_cuda(train_cfg):
    cfg = train_cfg
    # shapes only (as the batch): eager initialisation compiled one random-normal program per
    # parameter shape, most of this test's time
    state = jax.eval_shape(lambda: step.init_state(cfg)[0])
    opt = step.make_optimizer(cfg, state["params"])
    batch = jax.ShapeDtypeStruct((2, 25), jnp.int32)
    text = cuda_text(functools.partial(step.train_step, cfg=cfg, opt=opt), state, batch)
    m = 2 * 24 * cfg.model.moe.top_k
    assert problems(text, cfg.model.moe.num_experts, m) == []
