"""The winner table `auto` reads on CUDA: buckets, lookups, provenance, and its fallbacks.

Legend: M rows (sorted by group), K contraction dim, N output dim, G groups.

Lookups run on CPU: `auto` decides when a function is traced (every platform's branch is
traced), so tracing a function inside `auto_scope(events=...)` with `device_scope(kind, table)`
shows what CUDA would run without lowering anything for it.
"""
import copy
import json
import pathlib

import jax
import jax.numpy as jnp
import pytest

from dropless.ops import grouped_matmul
from dropless.ops.gmm import registry, shapes, winners
from dropless.ops.gmm.baselines import reference_gmm
from dropless.ops.gmm.tiled import tiled_gmm
from tests._support.gmm_reference import assert_same_with_grads, operands, with_grads

H200 = "NVIDIA H200"
PROV = {f: f"x-{f}" for f in winners.PROVENANCE_FIELDS}


def row(bucket, direction, backend, kind=H200):
    return {"device_kind": kind, "bucket": bucket, "direction": direction, "backend": backend,
            "shape": "test", "times_ms": {}}


def table(*rows):
    return {"provenance": dict(PROV), "rows": list(rows)}


def test_bucket_by_hand():
    # rows a group, K, N each rounded up to a power of four (>= 64)
    assert winners.bucket(8192, 1024, 1024, 64) == "r256_k1k_n1k"      # 128 rows -> 256
    assert winners.bucket(8192, 1024, 1024, 8) == "r1k_k1k_n1k"        # 1024 -> 1k
    assert winners.bucket(100, 10, 65, 4) == "r64_k64_n256"            # 25 -> 64; 65 -> 256
    assert winners.bucket(196608, 7168, 4096, 32) == "r16k_k16k_n4k"
    assert winners.bucket(10, 8, 8, 0) == "r64_k64_n64"                # G=0 counts as one


def test_every_table_shape_has_its_own_bucket():
    got = [winners.bucket(s.m, s.k, s.n, s.g) for s in shapes.SHAPES]
    assert len(set(got)) == len(shapes.SHAPES), dict(zip((s.label for s in shapes.SHAPES), got))


def test_committed_table_provenance_and_rows():
    path = pathlib.Path(winners.__file__).with_name(winners.TABLE_FILE)
    tab = json.loads(path.read_text())
    winners.check_table(tab)
    prov = tab["provenance"]
    for f in winners.PROVENANCE_FIELDS:
        assert prov[f], f
    assert "H200" in prov["device"] and prov["commit"] == "0f0b70e"
    assert pathlib.Path(__file__).parents[3].joinpath(
        prov["source"].split()[0]).exists(), prov["source"]
    for r in tab["rows"]:
        assert r["backend"] in registry.grouped_matmul_backends()
        # the winner is the backend with the lowest time at every routing measured
        times = r["times_ms"]
        for routing in times[r["backend"]]:
            assert times[r["backend"]][routing] == min(t[routing] for t in times.values())


def test_lookup_hits_misses_and_bad_direction():
    tab = table(row("r256_k1k_n1k", "fwd", "tiled"), row("r256_k1k_n1k", "drhs", "reference"))
    assert winners.winner(H200, 8192, 1024, 1024, 64, "fwd", tab) == "tiled"
    assert winners.winner(H200, 8192, 1024, 1024, 64, "drhs", tab) == "reference"
    assert winners.winner(H200, 8192, 1024, 1024, 64, "dlhs", tab) is None     # no row
    assert winners.winner(H200, 8192, 1024, 1024, 8, "fwd", tab) is None       # other bucket
    assert winners.winner("NVIDIA H100 80GB HBM3", 8192, 1024, 1024, 64, "fwd", tab) is None
    assert winners.winner(None, 8192, 1024, 1024, 64, "fwd", tab) is None      # no GPU
    with pytest.raises(ValueError, match="direction='bwd'"):
        winners.lookup(H200, "r256_k1k_n1k", "bwd", tab)


@pytest.mark.parametrize("damage, match", [
    (lambda t: t.pop("provenance"), "no 'provenance'"),
    (lambda t: t["provenance"].pop("commit"), r"lacks \['commit'\]"),
    (lambda t: t["rows"][0].pop("backend"), r"row 0 lacks \['backend'\]"),
    (lambda t: t["rows"].append(copy.deepcopy(t["rows"][0])), "repeats"),
    (lambda t: t["rows"][0].update(direction="up"), "direction='up'"),
])
def test_check_table_names_what_is_wrong(damage, match):
    tab = table(row("r64_k64_n64", "fwd", "tiled"))
    damage(tab)
    with pytest.raises(ValueError, match=match):
        winners.check_table(tab, "winners.json")


def traced_choice(tab, m=256, k=64, n=64, g=4, kind=H200, refused=frozenset()):
    """What `auto` chose for CUDA when a fwd+bwd of these dims is traced under `tab`."""
    events = []
    lhs = jax.ShapeDtypeStruct((m, k), jnp.float32)
    rhs = jax.ShapeDtypeStruct((g, k, n), jnp.float32)
    gs = jax.ShapeDtypeStruct((g,), jnp.int32)

    def f(a, b, s):
        return jax.grad(lambda a, b: grouped_matmul(a, b, s).sum(), argnums=(0, 1))(a, b)
    with winners.device_scope(kind, tab), registry.auto_scope(events=events, refused=refused):
        jax.jit(f).trace(lhs, rhs, gs)
    cuda = [e for e in events if e["asked"] == "auto" and e["platform"] == "cuda"]
    assert len({e["shape"] for e in cuda}) == 1
    return cuda[-1]


def default_cuda():
    return registry.resolve_backend("auto", "cuda")


def test_auto_takes_the_tables_winner_per_direction():
    b = winners.bucket(256, 64, 64, 4)
    got = traced_choice(table(row(b, "fwd", "tiled"), row(b, "dlhs", "reference"),
                              row(b, "drhs", "tiled")))
    assert got["backend"] == "tiled"
    assert got["directions"] == {"fwd": "tiled", "dlhs": "reference", "drhs": "tiled"}
    assert got["by"] == f"winner table: {H200} {b}"
    # one winner for all three: no per-direction split
    same = traced_choice(table(*(row(b, d, "reference") for d in shapes.DIRECTIONS)))
    assert same["backend"] == "reference" and "directions" not in same


def test_shape_or_device_outside_the_table_gets_the_chains_default():
    tab = table(row(winners.bucket(256, 64, 64, 4), "fwd", "tiled"))
    assert traced_choice(tab, m=4096)["backend"] == default_cuda()       # another bucket
    assert traced_choice(tab, kind="NVIDIA B200")["backend"] == default_cuda()
    got = traced_choice(tab)   # fwd from the table, dlhs and drhs: the chain's default
    assert got["directions"] == {"fwd": "tiled", "dlhs": default_cuda(), "drhs": default_cuda()}


def test_a_row_naming_an_unavailable_backend_falls_back(monkeypatch):
    b = winners.bucket(256, 64, 64, 4)
    unregistered = traced_choice(table(row(b, "fwd", "no_such_backend")))
    assert unregistered["backend"] == default_cuda() and "by" not in unregistered
    monkeypatch.setitem(registry._REGISTRY, "broken", registry.BackendSpec(
        "broken", tiled_gmm, "test", problem=lambda: "broken is not installed"))
    assert traced_choice(table(row(b, "fwd", "broken")))["backend"] == default_cuda()
    not_jittable = traced_choice(table(row(b, "fwd", "loop")))
    assert not_jittable["backend"] == default_cuda()


def test_a_refused_winner_falls_back_to_the_chains_default():
    b = winners.bucket(256, 64, 64, 4)
    tab = table(*(row(b, d, "tiled") for d in shapes.DIRECTIONS))
    key = ((256, 64), "float32", (4, 64, 64), "float32", "int32", "float32")
    assert traced_choice(tab)["backend"] == "tiled"
    assert traced_choice(tab, refused=frozenset({("tiled", key)}))["backend"] == default_cuda()
    assert traced_choice(tab, refused=frozenset({("tiled", None)}))["backend"] == default_cuda()
    with winners.device_scope(H200, tab):
        assert registry.fallback_after("tiled", "cuda", key) == default_cuda()
        assert registry.fallback_after("tiled", "cpu", key) is None      # CPU reads no table


def test_the_device_kind_is_the_scopes_else_the_abstract_gpu_lowered_for():
    from dropless.ops.gpu.triton_check import abstract_gpu_target
    assert winners.device_kind() is None            # a CPU process, nothing named
    with abstract_gpu_target("NVIDIA H100 80GB HBM3"):
        assert winners.device_kind() == "NVIDIA H100 80GB HBM3"
        with winners.device_scope(H200):
            assert winners.device_kind() == H200


def test_stand_ins_override_the_table():
    b = winners.bucket(256, 64, 64, 4)
    tab = table(*(row(b, d, "tiled") for d in shapes.DIRECTIONS))
    with registry.stand_in("standin_w", reference_gmm, first_on="cuda"):
        assert traced_choice(tab)["backend"] == "standin_w"


@pytest.mark.parametrize("sizes", [[5, 0, 3, 4], [0, 0, 16, 0], [2, 3, 1, 4]])   # last: tail
def test_per_direction_gmm_matches_the_reference(sizes):
    lhs, rhs, gs, dy = operands(16, 8, 6, sizes, seed=3)
    calls = []

    def spy(name, fn):
        def f(*a, **kw):
            calls.append(name)
            return fn(*a, **kw)
        return f
    fns = (spy("fwd", tiled_gmm), spy("dlhs", reference_gmm), spy("drhs", tiled_gmm))
    got = with_grads(lambda a, b: registry.per_direction_gmm(
        a, b, gs, out_dtype=jnp.float32, fns=fns), lhs, rhs, dy)
    want = with_grads(lambda a, b: reference_gmm(a, b, gs, out_dtype=jnp.float32), lhs, rhs, dy)
    assert_same_with_grads(got, want)
    assert calls[0] == "fwd" and set(calls[1:]) == {"dlhs", "drhs"}


def test_the_fallback_probes_every_directions_backend():
    from dropless.ops.gmm import fallback
    split = {"asked": "auto", "backend": "tokamax", "shape": None,
             "directions": {"fwd": "tokamax", "dlhs": "mosaic_gpu", "drhs": "pallas_gpu"}}
    assert fallback._backends(split) == ["mosaic_gpu", "pallas_gpu", "tokamax"]
    assert fallback._backends({"asked": "auto", "backend": "tiled", "shape": None}) == ["tiled"]
