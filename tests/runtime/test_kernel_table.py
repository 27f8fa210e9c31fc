"""runtime/kernel_table.py: the per-kernel table of a profiler trace, against traces whose
kernels are known (synthetic XSpaces in the format `jax.profiler.trace` writes, built through
jaxlib's own text-proto reader) and a real CPU trace of a jitted function run a known number
of times."""
from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.profiler import ProfileData

from dropless.runtime.kernel_table import GROUPS, group, kernel_table, trace_files

# metadata: 1 dropless_gmm, 2 loop_gather_fusion, 3 MemcpyH2D, 4 while, 5 body_thunk;
# stats: 10 hlo_op, 11 tf_op (the op's name stack)
_META = """
  event_metadata { key: 1 value { id: 1 name: "dropless_gmm" } }
  event_metadata { key: 2 value { id: 2 name: "loop_gather_fusion" } }
  event_metadata { key: 3 value { id: 3 name: "MemcpyH2D" } }
  event_metadata { key: 4 value { id: 4 name: "while" } }
  event_metadata { key: 5 value { id: 5 name: "body_thunk" } }
  stat_metadata { key: 10 value { id: 10 name: "hlo_op" } }
  stat_metadata { key: 11 value { id: 11 name: "tf_op" } }
"""


def _event(meta: int, start_us: float, dur_us: float, *stats: tuple[int, str]) -> str:
    st = " ".join(f'stats {{ metadata_id: {k} str_value: "{v}" }}' for k, v in stats)
    return (f"events {{ metadata_id: {meta} offset_ps: {int(start_us * 1e6)} "
            f"duration_ps: {int(dur_us * 1e6)} {st} }}")


def _plane(name: str, lines: dict[str, list[str]]) -> str:
    body = "".join(f'  lines {{ id: {i + 1} name: "{ln}" timestamp_ns: 1000 {" ".join(evs)} }}\n'
                   for i, (ln, evs) in enumerate(lines.items()))
    return f'planes {{ id: 1 name: "{name}"\n{body}{_META}}}\n'


def _write(path: Path, *planes: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(ProfileData.text_proto_to_serialized_xspace("".join(planes)))


def _gpu_plane(scale: float = 1.0) -> str:
    return _plane("/device:GPU:0", {
        "Stream #7(Compute)": [
            _event(1, 0, 50 * scale, (10, "custom-call.1")),
            _event(1, 60, 30 * scale),
            _event(2, 100, 20 * scale, (10, "gather_fusion.2"),
                   (11, "jit(step)/attention/gather")),
        ],
        "Stream #8(MemcpyH2D)": [_event(3, 0, 5 * scale)],
        # a line derived from the streams: the same time again, never counted
        "XLA Ops": [_event(1, 0, 50 * scale), _event(2, 100, 20 * scale)],
    })


def test_gpu_streams_summed_by_name_derived_lines_not_counted(tmp_path):
    _write(tmp_path / "plugins/profile/2026_01_01_00_00_00/host.xplane.pb", _gpu_plane())
    rows = kernel_table(tmp_path)
    got = {r["name"]: (r["count"], r["total_us"], r["group"]) for r in rows}
    assert got == {"dropless_gmm": (2, pytest.approx(80.0), "moe_gmm"),
                   "loop_gather_fusion": (1, pytest.approx(20.0), "attention"),
                   "MemcpyH2D": (1, pytest.approx(5.0), "other")}
    assert [r["name"] for r in rows] == ["dropless_gmm", "loop_gather_fusion", "MemcpyH2D"]
    assert sum(r["share"] for r in rows) == pytest.approx(1.0)
    assert rows[0]["share"] == pytest.approx(80 / 105)
    assert rows[0]["hlo_op"] == "custom-call.1" and rows[0]["scope"] is None
    assert rows[1]["scope"] == "jit(step)/attention/gather"


def test_newest_run_and_every_host_of_it(tmp_path):
    old = tmp_path / "plugins/profile/2026_01_01_00_00_00"
    new = tmp_path / "plugins/profile/2026_01_02_00_00_00"
    _write(old / "a.xplane.pb", _gpu_plane(scale=100.0))
    _write(new / "a.xplane.pb", _gpu_plane())
    _write(new / "b.xplane.pb", _gpu_plane())
    assert trace_files(tmp_path) == [new / "a.xplane.pb", new / "b.xplane.pb"]
    rows = {r["name"]: r for r in kernel_table(tmp_path)}
    assert rows["dropless_gmm"]["count"] == 4
    assert rows["dropless_gmm"]["total_us"] == pytest.approx(160.0)
    # one file given: that file only
    assert kernel_table(old / "a.xplane.pb")[0]["total_us"] == pytest.approx(8000.0)


def test_host_thunks_innermost_only_when_no_device(tmp_path):
    host = _plane("/host:CPU", {"worker": [
        _event(4, 0, 100, (10, "while.1")),       # contains the two below: not counted
        _event(5, 10, 30, (10, "fusion.1")),
        _event(5, 50, 40, (10, "fusion.1")),
        _event(1, 200, 10, (10, "custom-call.2")),
        _event(2, 300, 99),                        # no hlo_op: not an XLA thunk
    ]})
    _write(tmp_path / "plugins/profile/r/h.xplane.pb", host)
    got = {r["name"]: (r["count"], r["total_us"]) for r in kernel_table(tmp_path)}
    assert got == {"body_thunk": (2, pytest.approx(70.0)),
                   "dropless_gmm": (1, pytest.approx(10.0))}


def test_device_plane_wins_over_host_thunks(tmp_path):
    host = _plane("/host:CPU", {"worker": [_event(5, 0, 30, (10, "fusion.1"))]})
    _write(tmp_path / "plugins/profile/r/h.xplane.pb", host + _gpu_plane())
    assert "body_thunk" not in {r["name"] for r in kernel_table(tmp_path)}


def test_real_cpu_trace_counts_each_thunk_once_a_call(tmp_path):
    f = jax.jit(lambda a: jnp.tanh(a @ a).sum() + jnp.sort(a, axis=0)[0, 0])
    x = jnp.ones((128, 128))
    f(x).block_until_ready()
    calls = 3
    with jax.profiler.trace(str(tmp_path)):
        for _ in range(calls):
            f(x).block_until_ready()
    rows = kernel_table(tmp_path)
    assert rows
    hlo = f.lower(x).compile().as_text()
    for r in rows:
        assert r["count"] % calls == 0, r
        assert r["total_us"] > 0
        assert re.search(rf"\b{re.escape(r['hlo_op'])}\b", hlo), r["hlo_op"]
        assert r["group"] in GROUPS


def test_no_trace_names_the_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path))):
        kernel_table(tmp_path)
    with pytest.raises(FileNotFoundError):
        kernel_table(tmp_path / "missing")


@pytest.mark.parametrize("name, scope, want", [
    ("dropless_gmm_drhs", "", "moe_gmm"),
    ("ragged_dot_mgpu_kernel", "", "moe_gmm"),
    ("fusion.3", "jit(step)/moe/router/dot_general", "router"),
    ("input_reduce_fusion", "jit(step)/moe/top_k", "router"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma", "", "attention"),
    ("loop_gather_fusion", "jit(step)/attention/gather", "attention"),
    ("DeviceRadixSortOnesweepKernel", "", "dispatch_permute"),
    ("input_scatter_fusion", "", "dispatch_permute"),
    ("loop_multiply_fusion", "jit(step)/adamw/mul", "optimizer"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "", "other"),
    ("loop_add_fusion", "jit(step)/property/add", "other"),
])
def test_group(name, scope, want):
    assert group(name, scope) == want
    assert group(name.upper(), scope.upper()) == want
