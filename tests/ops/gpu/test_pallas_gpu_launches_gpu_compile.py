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
"""
import collections
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import SingleDeviceSharding

from dropless.ops import grouped_matmul
from dropless.ops.gpu.triton_check import abstract_gpu_target
from tests._support import cuda_compile

cuda_compile.require_plugin()

FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast"}
_OP = re.compile(r"^\s*(?:ROOT )?%\S+ = .*? ([a-z][a-z0-9-]*)\(", re.M)


def launches(fn, *args) -> collections.Counter:
    """Device instructions of `fn`'s compiled entry computation, by opcode."""
    with abstract_gpu_target("NVIDIA H100 80GB HBM3"):
        text = jax.jit(fn).lower(*args).compile().as_text()
    entry = text[text.index("\nENTRY"):]
    return collections.Counter(op for op in _OP.findall(entry) if op not in FREE)


def operands(g, m=8192, k=1024, n=1024):
    sh = SingleDeviceSharding(cuda_compile.devices("h100", 1)[0])
    return (jax.ShapeDtypeStruct((m, k), jnp.bfloat16, sharding=sh),
            jax.ShapeDtypeStruct((g, k, n), jnp.bfloat16, sharding=sh),
            jax.ShapeDtypeStruct((g,), jnp.int32, sharding=sh),
            jax.ShapeDtypeStruct((m, n), jnp.bfloat16, sharding=sh))


def fwd(lhs, rhs, gs, dy):
    return grouped_matmul(lhs, rhs, gs, backend="pallas_gpu")


def fwd_bwd(lhs, rhs, gs, dy):
    out, vjp = jax.vjp(lambda a, b: grouped_matmul(a, b, gs, backend="pallas_gpu"), lhs, rhs)
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
