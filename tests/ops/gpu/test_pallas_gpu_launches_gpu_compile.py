"""Kernels one `pallas_gpu` call launches, read from its module compiled for a compile-only H100.

Legend: M rows (sorted by group), K contraction dim, N output dim, G groups, W work items.

A launch is an instruction of the compiled entry computation that runs on the device: a fusion,
a custom call (our Triton kernels), a sort, a copy, a while loop (whose body's kernels run once
a step). Everything else (parameters, constants, tuples,
bitcasts) is free. Besides the 1 (forward) or 3 (forward and backward) Triton kernels, a call
builds its work list on device: the group offsets (a cumsum, which XLA splits in two passes
beyond a few dozen groups), the [W, G+1] comparison that finds each work item's group, and the
drhs order (an argsort). Finding the groups by binary search (`searchsorted`'s default) is a
while loop; the counts here are what the list costs, and a change that adds a launch has to
change them.

A call on aligned segments (`group_alignment=128`, a multiple of the row block) needs no work
list: its forward and dlhs grids are cdiv(M, bm) row tiles, each tile's group found by one
[T, G] comparison. Each Triton kernel's grid (`grid_x` of its custom call) is checked against
`pallas_plan`'s tile model, and the aligned grid against the work list's at the same call.
"""
import collections
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import SingleDeviceSharding

from dropless.ops import grouped_matmul
from dropless.ops.gpu import pallas_plan
from dropless.ops.gpu.triton_check import abstract_gpu_target
from tests._support import cuda_compile

cuda_compile.require_plugin()

FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast"}
_OP = re.compile(r"^\s*(?:ROOT )?%\S+ = .*? ([a-z][a-z0-9-]*)\(", re.M)


def compiled_text(fn, *args) -> str:
    with abstract_gpu_target("NVIDIA H100 80GB HBM3"):
        return jax.jit(fn).lower(*args).compile().as_text()


def launches(fn, *args, text: str | None = None) -> collections.Counter:
    """Device instructions of `fn`'s compiled entry computation (or of `text`), by opcode."""
    text = text or compiled_text(fn, *args)
    entry = text[text.index("\nENTRY"):]
    return collections.Counter(op for op in _OP.findall(entry) if op not in FREE)


def triton_grids(text: str) -> dict:
    """{kernel name: programs launched (grid_x)} of the Triton custom calls in `text`."""
    out = {}
    for line in text.splitlines():
        if "__gpu$xla.gpu.triton" in line and "custom-call(" in line:
            out[re.search(r'name = "([^"]+)"', line)[1]] = int(
                re.search(r"grid_x = (\d+)", line)[1])
    return out


def operands(g, m=8192, k=1024, n=1024):
    sh = SingleDeviceSharding(cuda_compile.devices("h100", 1)[0])
    return (jax.ShapeDtypeStruct((m, k), jnp.bfloat16, sharding=sh),
            jax.ShapeDtypeStruct((g, k, n), jnp.bfloat16, sharding=sh),
            jax.ShapeDtypeStruct((g,), jnp.int32, sharding=sh),
            jax.ShapeDtypeStruct((m, n), jnp.bfloat16, sharding=sh))


def fwd(lhs, rhs, gs, dy):
    return grouped_matmul(lhs, rhs, gs, backend="pallas_gpu")


def fwd_bwd(lhs, rhs, gs, dy, align=1):
    out, vjp = jax.vjp(lambda a, b: grouped_matmul(a, b, gs, backend="pallas_gpu",
                                                   group_alignment=align), lhs, rhs)
    return out, vjp(dy)


# (G, forward launches, forward+backward launches): the Triton kernels (1; 3) + the work list
EXPECTED = [(8, 1 + 3, 3 + 5), (64, 1 + 5, 3 + 6), (256, 1 + 7, 3 + 8)]


@pytest.mark.parametrize("g, n_fwd, n_fwd_bwd", EXPECTED)
def test_kernels_launched_per_call(g, n_fwd, n_fwd_bwd):
    args = operands(g)
    got_fwd, got_both = launches(fwd, *args), launches(fwd_bwd, *args)
    assert got_fwd["custom-call"] == 1 and got_both["custom-call"] == 3
    assert "while" not in got_fwd and "while" not in got_both
    assert sum(got_fwd.values()) == n_fwd, got_fwd
    assert sum(got_both.values()) == n_fwd_bwd, got_both


# G=64 on 8192 rows (M, K, N as above), aligned to 128: (forward launches, forward+backward
# launches). The [T, G] comparison replaces the work list: the cumsum (2 passes) and the
# comparison with its count (1 fusion) for the forward; the backward adds the drhs order.
ALIGNED_G, ALIGNED_FWD, ALIGNED_FWD_BWD = 64, 1 + 3, 3 + 5


def test_aligned_calls_launch_fewer_tiles():
    g, m, k, n = ALIGNED_G, 8192, 1024, 1024
    args = operands(g, m, k, n)
    aligned = compiled_text(lambda *a: fwd_bwd(*a, align=128), *args)
    plain = compiled_text(fwd_bwd, *args)
    got = launches(None, text=aligned)
    assert got["custom-call"] == 3 and "while" not in got
    assert sum(got.values()) == ALIGNED_FWD_BWD, got
    fwd_only = launches(lambda a, b, s, d: grouped_matmul(a, b, s, backend="pallas_gpu",
                                                          group_alignment=128), *args)
    assert sum(fwd_only.values()) == ALIGNED_FWD, fwd_only
    # the grids, as pallas_plan models them: bf16 defaults bk=64, bn=128; aligned bm=128 (it
    # divides 128), the work list's bm=64 (pallas_plan.choose_block_m at G=64)
    bm_plain = pallas_plan.choose_block_m(m, g, "bfloat16")
    t_al = pallas_plan.row_tiles_launched(m, g, 128, aligned=True)
    t_pl = pallas_plan.row_tiles_launched(m, g, bm_plain, aligned=False)
    assert (t_al, bm_plain, t_pl) == (64, 64, 191)
    assert triton_grids(aligned) == {"dropless_gmm_aligned": t_al * n // 128,
                                     "dropless_gmm_dlhs_aligned": t_al * k // 128,
                                     "dropless_gmm_drhs": g * (k // 64) * (n // 128)}
    assert triton_grids(plain) == {"dropless_gmm": t_pl * n // 128,
                                   "dropless_gmm_dlhs": t_pl * k // 128,
                                   "dropless_gmm_drhs": g * (k // 64) * (n // 128)}
    # rows launched: 64 tiles of 128 for 8192 rows against 191 of 64 (12,224 rows)
    assert t_al * 128 < t_pl * bm_plain
