"""runtime.hlo_kernels: the kernels of hand-written HLO modules (a fusion with a dot, loops of
known, nested and unknown trip counts, a cuBLAS custom call with a tuple result, in-place and
sliced operands, an async fusion, a conditional) checked against hand arithmetic; a real jitted
CPU function's dot FLOPs and a scan's trip count; the roofline times against hand arithmetic.
"""
from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest

from dropless.runtime import hlo_kernels as hk

DOT_MODULE = """HloModule m, is_scheduled=true

%fused_dot (p0: bf16[64,128], p1: bf16[128,32]) -> f32[64,32] {
  %p0 = bf16[64,128]{1,0} parameter(0)
  %p1 = bf16[128,32]{1,0} parameter(1)
  %d = f32[64,32]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %t = f32[64,32]{1,0} tanh(%d)
}

%fused_bmm (q0: f32[4,64,128], q1: f32[4,128,32]) -> f32[4,64,32] {
  %q0 = f32[4,64,128]{2,1,0} parameter(0)
  %q1 = f32[4,128,32]{2,1,0} parameter(1)
  ROOT %bd = f32[4,64,32]{2,1,0} dot(%q0, %q1), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}
}

ENTRY %main (a: bf16[64,128], b: bf16[128,32], c: f32[4,64,128], e: f32[4,128,32]) -> (f32[64,32], f32[4,64,32]) {
  %a = bf16[64,128]{1,0} parameter(0), metadata={op_name="a"}
  %b = bf16[128,32]{1,0} parameter(1)
  %c = f32[4,64,128]{2,1,0} parameter(2)
  %e = f32[4,128,32]{2,1,0} parameter(3)
  %gemm = f32[64,32]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_dot, metadata={op_name="jit(f)/moe/ragged_dot_general" stack_frame_id=3}, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %bmm = f32[4,64,32]{2,1,0} fusion(%c, %e), kind=kCustom, calls=%fused_bmm, metadata={op_name="jit(f)/attention/bqhk,bshk->bhqs/dot_general"}, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %bc = bf16[64,128]{1,0} bitcast(%a)
  ROOT %tuple = (f32[64,32]{1,0}, f32[4,64,32]{2,1,0}) tuple(%gemm, %bmm)
}
"""


def _by_name(rows: list[dict]) -> dict[str, dict]:
    return {r["name"]: r for r in rows}


def test_a_fusion_reads_its_operands_writes_its_result_and_does_its_dots_flops():
    rows = _by_name(hk.kernels(DOT_MODULE))
    assert set(rows) == {"gemm", "bmm"}          # parameters, bitcast, tuple launch nothing
    g = rows["gemm"]
    assert g["kind"] == "__triton_gemm" and g["count"] == 1 and g["note"] is None
    assert g["bytes_read"] == 64 * 128 * 2 + 128 * 32 * 2
    assert g["bytes_written"] == 64 * 32 * 4
    assert g["flops"] == 2 * 64 * 32 * 128 and g["precision"] == "bf16"
    assert g["scope"] == "jit(f)/moe/ragged_dot_general" and g["group"] == "moe_gmm"
    b = rows["bmm"]
    assert b["kind"] == "__triton_nested_gemm_fusion" and b["group"] == "attention"
    assert b["flops"] == 2 * 4 * 64 * 32 * 128 and b["precision"] == "float32"
    assert b["bytes_read"] == 4 * 64 * 128 * 4 + 4 * 128 * 32 * 4
    assert b["bytes_written"] == 4 * 64 * 32 * 4


LOOP_MODULE = """HloModule loops, is_scheduled=true

%fused_sin (x0: f32[256]) -> f32[256] {
  %x0 = f32[256]{0} parameter(0)
  ROOT %s = f32[256]{0} sine(%x0)
}

%fused_slice (buf0: f32[4,256], i0: s32[]) -> f32[1,256] {
  %buf0 = f32[4,256]{1,0} parameter(0)
  %i0 = s32[] parameter(1)
  %z = s32[] constant(0)
  %bc0 = f32[4,256]{1,0} bitcast(%buf0)
  ROOT %ds = f32[1,256]{1,0} dynamic-slice(%bc0, %i0, %z), dynamic_slice_sizes={1,256}
}

%fused_update (buf1: f32[4,256], u1: f32[1,256], i1: s32[]) -> f32[4,256] {
  %buf1 = f32[4,256]{1,0} parameter(0)
  %u1 = f32[1,256]{1,0} parameter(1)
  %i1 = s32[] parameter(2)
  %z1 = s32[] constant(0)
  ROOT %dus = f32[4,256]{1,0} dynamic-update-slice(%buf1, %u1, %i1, %z1)
}

%inner_body (ib: (s32[], f32[256])) -> (s32[], f32[256]) {
  %ib = (s32[], f32[256]{0}) parameter(0)
  %iv = s32[] get-tuple-element(%ib), index=0
  %ix = f32[256]{0} get-tuple-element(%ib), index=1
  %inner_fusion = f32[256]{0} fusion(%ix), kind=kLoop, calls=%fused_sin, metadata={op_name="jit(f)/while/body/while/body/sin"}
  ROOT %it = (s32[], f32[256]{0}) tuple(%iv, %inner_fusion)
}

%inner_cond (ic: (s32[], f32[256])) -> pred[] {
  %ic = (s32[], f32[256]{0}) parameter(0)
  %icv = s32[] get-tuple-element(%ic), index=0
  %three = s32[] constant(3)
  ROOT %ilt = pred[] compare(%icv, %three), direction=LT
}

%outer_body (ob: (s32[], f32[256], f32[4,256], f32[4,256])) -> (s32[], f32[256], f32[4,256], f32[4,256]) {
  %ob = (s32[], f32[256]{0}, f32[4,256]{1,0}, f32[4,256]{1,0}) parameter(0)
  %ov = s32[] get-tuple-element(%ob), index=0
  %ox = f32[256]{0} get-tuple-element(%ob), index=1
  %xs = f32[4,256]{1,0} get-tuple-element(%ob), index=2
  %ys = f32[4,256]{1,0} get-tuple-element(%ob), index=3
  %outer_fusion = f32[256]{0} fusion(%ox), kind=kLoop, calls=%fused_sin, metadata={op_name="jit(f)/while/body/sin"}
  %slice_fusion = f32[1,256]{1,0} fusion(%xs, %ov), kind=kLoop, calls=%fused_slice, metadata={op_name="jit(f)/while/body/dynamic_slice"}
  %async = ((f32[4,256]{1,0}, s32[]), f32[1,256]{1,0}, u32[]) fusion-start(%xs, %ov), kind=kLoop, calls=%fused_slice
  %async_done = f32[1,256]{1,0} fusion-done(%async)
  %update_fusion = f32[4,256]{1,0} fusion(%ys, %slice_fusion, %ov), kind=kLoop, calls=%fused_update, metadata={op_name="jit(f)/while/body/dynamic_update_slice"}
  %zero = s32[] constant(0)
  %it0 = (s32[], f32[256]{0}) tuple(%zero, %outer_fusion)
  %inner = (s32[], f32[256]{0}) while(%it0), condition=%inner_cond, body=%inner_body, backend_config={"known_trip_count":{"n":"3"}}
  %inner_x = f32[256]{0} get-tuple-element(%inner), index=1
  ROOT %ot = (s32[], f32[256]{0}, f32[4,256]{1,0}, f32[4,256]{1,0}) tuple(%ov, %inner_x, %xs, %update_fusion)
}

%outer_cond (oc: (s32[], f32[256], f32[4,256], f32[4,256])) -> pred[] {
  %oc = (s32[], f32[256]{0}, f32[4,256]{1,0}, f32[4,256]{1,0}) parameter(0)
  %ocv = s32[] get-tuple-element(%oc), index=0
  %four = s32[] constant(4)
  ROOT %olt = pred[] compare(%ocv, %four), direction=LT
}

%open_body (pb: (s32[], f32[256])) -> (s32[], f32[256]) {
  %pb = (s32[], f32[256]{0}) parameter(0)
  %pv = s32[] get-tuple-element(%pb), index=0
  %px = f32[256]{0} get-tuple-element(%pb), index=1
  %open_fusion = f32[256]{0} fusion(%px), kind=kLoop, calls=%fused_sin
  ROOT %pt = (s32[], f32[256]{0}) tuple(%pv, %open_fusion)
}

%open_cond (pc: (s32[], f32[256])) -> pred[] {
  %pc = (s32[], f32[256]{0}) parameter(0)
  %pcx = f32[256]{0} get-tuple-element(%pc), index=1
  %psum = f32[] reduce(%pcx, %pcx), dimensions={0}, to_apply=%fused_sin
  %lim = f32[] constant(1)
  ROOT %plt = pred[] compare(%psum, %lim), direction=LT
}

ENTRY %main (x: f32[256], xs: f32[4,256], ys: f32[4,256], w: f32[16,8], v: f32[8,16]) -> f32[16,16] {
  %x = f32[256]{0} parameter(0)
  %xsp = f32[4,256]{1,0} parameter(1)
  %ysp = f32[4,256]{1,0} parameter(2)
  %w = f32[16,8]{1,0} parameter(3)
  %v = f32[8,16]{1,0} parameter(4)
  %z0 = s32[] constant(0)
  %t0 = (s32[], f32[256]{0}, f32[4,256]{1,0}, f32[4,256]{1,0}) tuple(%z0, %x, %xsp, %ysp)
  %outer = (s32[], f32[256]{0}, f32[4,256]{1,0}, f32[4,256]{1,0}) while(%t0), condition=%outer_cond, body=%outer_body, metadata={op_name="jit(f)/while"}, backend_config={"known_induction_variable":{"tuple_index":"0"},"known_trip_count":{"n":"4"}}
  %t1 = (s32[], f32[256]{0}) tuple(%z0, %x)
  %open = (s32[], f32[256]{0}) while(%t1), condition=%open_cond, body=%open_body
  %cublas = (f32[16,16]{1,0}, s8[1024]{0}) custom-call(%w, %v), custom_call_target="__cublas$gemm", metadata={op_name="jit(f)/optimizer/dot_general"}, backend_config={"gemm_backend_config":{"alpha_real":1,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %copy = f32[4,256]{0,1} copy(%xsp)
  ROOT %out = f32[16,16]{1,0} get-tuple-element(%cublas), index=0
}
"""


def test_loops_multiply_their_trip_counts_and_an_unknown_one_is_counted_once_and_noted():
    rows = _by_name(hk.kernels(LOOP_MODULE))
    assert set(rows) == {"outer_fusion", "slice_fusion", "async", "update_fusion",
                         "inner_fusion", "open_fusion", "psum", "plt", "cublas", "copy"}
    assert rows["outer_fusion"]["count"] == 4
    assert rows["inner_fusion"]["count"] == 4 * 3                    # nested: 4 x 3
    for name in ("outer_fusion", "inner_fusion", "slice_fusion", "cublas", "copy"):
        assert rows[name]["note"] is None, name
    # no known trip count: the body and the condition once each, both noted
    for name in ("open_fusion", "psum", "plt"):
        assert rows[name]["count"] == 1
        assert rows[name]["note"] == "loop open has no known trip count: counted once"
    # the known loops' conditions launch nothing (XLA:GPU runs the body n times)
    assert all(r["computation"] not in ("outer_cond", "inner_cond") for r in rows.values())
    assert rows["inner_fusion"]["computation"] == "inner_body"
    assert rows["outer_fusion"]["bytes_read"] == rows["outer_fusion"]["bytes_written"] == 1024


def test_sliced_operands_read_the_slice_and_in_place_updates_write_the_update():
    rows = _by_name(hk.kernels(LOOP_MODULE))
    s = rows["slice_fusion"]       # reads one row of f32[4,256] (through a bitcast) + the index
    assert (s["bytes_read"], s["bytes_written"]) == (256 * 4 + 4, 256 * 4)
    a = rows["async"]              # the same, started asynchronously: element 1 is the result
    assert (a["bytes_read"], a["bytes_written"], a["kind"]) == (256 * 4 + 4, 256 * 4, "kLoop")
    u = rows["update_fusion"]      # the f32[4,256] buffer is updated in place: not read
    assert (u["bytes_read"], u["bytes_written"]) == (256 * 4 + 4, 256 * 4)
    c = rows["copy"]
    assert (c["bytes_read"], c["bytes_written"], c["kind"]) == (4096, 4096, "copy")


def test_a_cublas_custom_call_counts_its_gemm_and_its_tuple_result():
    c = _by_name(hk.kernels(LOOP_MODULE))["cublas"]
    assert c["kind"] == "__cublas$gemm" and c["group"] == "optimizer"
    assert c["flops"] == 2 * 16 * 16 * 8 and c["precision"] == "float32"
    assert c["bytes_read"] == (16 * 8 + 8 * 16) * 4
    assert c["bytes_written"] == 16 * 16 * 4 + 1024           # result + s8 workspace


COND_MODULE = """HloModule c

%b0 (a0: f32[8]) -> f32[8] {
  %a0 = f32[8]{0} parameter(0)
  ROOT %n0 = f32[8]{0} negate(%a0), metadata={op_name="jit(f)/router/neg"}
}

%b1 (a1: f32[8]) -> f32[8] {
  %a1 = f32[8]{0} parameter(0)
  ROOT %n1 = f32[8]{0} sort(%a1), dimensions={0}, to_apply=%b0
}

%wrapped (cv: f32[2,3,5,7], ck: f32[3,3,7,11]) -> f32[2,1,3,11] {
  %cv = f32[2,3,5,7]{3,2,1,0} parameter(0)
  %ck = f32[3,3,7,11]{3,2,1,0} parameter(1)
  ROOT %conv = f32[2,1,3,11]{3,2,1,0} convolution(%cv, %ck), window={size=3x3}, dim_labels=b01f_01io->b01f
}

ENTRY %main (i: s32[], x: f32[8], cx: f32[2,3,5,7], k: f32[3,3,7,11]) -> f32[8] {
  %i = s32[] parameter(0)
  %x = f32[8]{0} parameter(1)
  %cx = f32[2,3,5,7]{3,2,1,0} parameter(2)
  %k = f32[3,3,7,11]{3,2,1,0} parameter(3)
  %conv_fusion = f32[2,1,3,11]{3,2,1,0} fusion(%cx, %k), kind=kLoop, calls=%wrapped
  %c = f32[8]{0} conditional(%i, %x, %x), branch_computations={%b0, %b1}
  ROOT %r = f32[8]{0} call(%c), to_apply=%b0
}
"""


def test_branches_are_all_listed_and_noted_calls_are_entered_and_convolutions_count():
    rows = hk.kernels(COND_MODULE)
    by = _by_name(rows)
    assert set(by) == {"conv_fusion", "n0", "n1"}
    assert by["n1"]["kind"] == "sort" and by["n1"]["note"] == ("a branch of c: one branch "
                                                               "runs")
    # %b0 is reached twice (a branch and the call): one row, two launches
    assert by["n0"]["count"] == 2 and by["n0"]["group"] == "router"
    # 2 x out elements (2*1*3*11) x (3*3*7 kernel taps per output feature)
    assert by["conv_fusion"]["flops"] == 2 * (2 * 1 * 3 * 11) * (3 * 3 * 7)


UNFUSED_MODULE = """HloModule u

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

ENTRY %main (t: f32[1000,64], i: s32[10,1], u: f32[10,64], k: s32[]) -> f32[1000,64] {
  %t = f32[1000,64]{1,0} parameter(0)
  %i = s32[10,1]{1,0} parameter(1)
  %u = f32[10,64]{1,0} parameter(2)
  %k = s32[] parameter(3)
  %z = s32[] constant(0)
  %ds = f32[8,64]{1,0} dynamic-slice(%t, %k, %z), dynamic_slice_sizes={8,64}
  %g = f32[10,64]{1,0} gather(%t, %i), offset_dims={1}, collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=1, slice_sizes={1,64}
  %dus = f32[1000,64]{1,0} dynamic-update-slice(%t, %ds, %k, %z)
  ROOT %sc = f32[1000,64]{1,0} scatter(%dus, %i, %u), update_window_dims={1}, inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=%add, metadata={op_name="jit(f)/moe/combine/scatter-add"}
}
"""


def test_unfused_slices_gathers_and_in_place_updates():
    rows = _by_name(hk.kernels(UNFUSED_MODULE))
    assert set(rows) == {"ds", "g", "dus", "sc"}      # the scatter's reducer launches nothing
    # a constant operand is a buffer read too: the indices %k and %z are 4 bytes each
    assert (rows["ds"]["bytes_read"], rows["ds"]["bytes_written"]) == (8 * 64 * 4 + 8, 2048)
    assert (rows["g"]["bytes_read"], rows["g"]["bytes_written"]) == (10 * 64 * 4 + 40, 2560)
    assert (rows["dus"]["bytes_read"], rows["dus"]["bytes_written"]) == (2048 + 8, 2048)
    sc = rows["sc"]        # updates + indices read, the f32[1000,64] buffer updated in place
    assert (sc["bytes_read"], sc["bytes_written"]) == (2560 + 40, 2560)
    assert sc["group"] == "dispatch_permute" and sc["flops"] == 0


def test_shape_bytes_and_bad_input():
    assert hk.shape_bytes("f32[256,128]{1,0}") == 256 * 128 * 4
    assert hk.shape_bytes("(s32[], /*index=1*/bf16[2,3]{1,0}, pred[7])") == 4 + 12 + 7
    assert hk.shape_bytes("s4[3]") == 2 and hk.shape_bytes("f8e4m3fn[10]") == 10
    with pytest.raises(ValueError, match="unknown element type 'q7'"):
        hk.shape_bytes("q7[4]")
    with pytest.raises(ValueError, match="no ENTRY computation"):
        hk.kernels("HloModule empty\n")
    with pytest.raises(ValueError, match="not an instruction"):
        hk.kernels("ENTRY %m () -> f32[] {\n  nonsense\n}\n")


def test_the_roofline_times_and_the_groups_against_hand_arithmetic():
    hw = SimpleNamespace(hbm_bw=1e12, hbm_efficiency=0.5, peak_bf16=1e15,
                         gemm_efficiency=0.5)
    rows = hk.kernels(LOOP_MODULE)
    recs = hk.predict(rows, hw, peak=lambda p: {"float32": 2e14}.get(p))
    kern = _by_name([r for r in recs if r["event"] == "kernel"])
    inner = kern["inner_fusion"]                 # 2048 bytes x 12 launches at 0.5 TB/s
    assert inner["total_us"] == pytest.approx(12 * 2048 / 0.5e12 * 1e6, rel=1e-12)
    assert inner["bound"] == "memory" and inner["bytes"] == 12 * 2048
    cub = kern["cublas"]                        # 4096 FLOPs at 1e14 vs 2048 bytes at 5e11
    mem_s, flop_s = (1024 + 2048) / 0.5e12, 4096 / 1e14
    assert cub["total_us"] == pytest.approx(max(mem_s, flop_s) * 1e6, rel=1e-12)
    assert cub["bound"] == ("compute" if flop_s > mem_s else "memory")
    total = sum(r["total_us"] for r in kern.values())
    assert sum(r["share"] for r in kern.values()) == pytest.approx(1.0)
    groups = {r["group"]: r for r in recs if r["event"] == "group"}
    assert set(groups) == {"attention", "moe_gmm", "dispatch_permute", "router", "optimizer",
                           "other"}
    assert groups["optimizer"]["total_us"] == pytest.approx(cub["total_us"])
    assert groups["optimizer"]["flops"] == 4096
    assert sum(g["total_us"] for g in groups.values()) == pytest.approx(total)
    assert [r["event"] for r in recs] == ["kernel"] * len(kern) + ["group"] * 6
    ts = [r["total_us"] for r in recs if r["event"] == "kernel"]
    assert ts == sorted(ts, reverse=True)
    # compute-bound at the bf16 peak when no peak function is given: 4096 / 5e14
    no_peak = _by_name(hk.predict(rows, hw)[:len(kern)])["cublas"]
    assert no_peak["total_us"] == pytest.approx(max(mem_s, 4096 / 5e14) * 1e6, rel=1e-12)


def test_a_jitted_cpu_function_dot_flops_and_a_scan_trip_count():
    def f(a, b):
        return jnp.tanh(jnp.dot(a, b)) + 1.0

    text = jax.jit(f).lower(jnp.ones((256, 512)), jnp.ones((512, 128))).compile().as_text()
    rows = hk.kernels(text)
    assert sum(r["flops"] for r in rows) == 2 * 256 * 512 * 128
    dot = [r for r in rows if r["flops"]]
    assert len(dot) == 1 and dot[0]["count"] == 1
    assert dot[0]["bytes_read"] >= (256 * 512 + 512 * 128) * 4   # both operands, f32

    def g(x):
        return jax.lax.scan(lambda c, _: (jnp.sin(c) * 2.0, None), x, None, length=3)[0]

    rows = hk.kernels(jax.jit(g).lower(jnp.ones((64, 64))).compile().as_text())
    sin = [r for r in rows if "sin" in r["scope"] or "mul" in r["scope"]]
    assert sin and all(r["count"] == 3 for r in sin)
    assert all(r["note"] is None for r in rows)


GMM_MODULE = """HloModule gmm, is_scheduled=true

ENTRY %main (x: bf16[512,64], w: bf16[4,64,32], gs: s32[4], dy: bf16[512,32]) -> (bf16[512,32], bf16[512,64], bf16[4,64,32], f32[512,32]) {
  %x = bf16[512,64]{1,0} parameter(0)
  %w = bf16[4,64,32]{2,1,0} parameter(1)
  %gs = s32[4]{0} parameter(2)
  %dy = bf16[512,32]{1,0} parameter(3)
  %fwd = bf16[512,32]{1,0} custom-call(%gs, %x, %w), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(f)/moe/dropless_gmm/pallas_call"}
  %dlhs = bf16[512,64]{1,0} custom-call(%gs, %dy, %w), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(f)/moe/dropless_gmm_dlhs/pallas_call"}
  %drhs = bf16[4,64,32]{2,1,0} custom-call(%gs, %x, %dy), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(f)/moe/dropless_gmm_drhs/pallas_call"}
  %other = f32[512,32]{1,0} custom-call(%x, %w), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(f)/attention/pallas_call"}
  ROOT %t = (bf16[512,32]{1,0}, bf16[512,64]{1,0}, bf16[4,64,32]{2,1,0}, f32[512,32]{1,0}) tuple(%fwd, %dlhs, %drhs, %other)
}
"""


def test_a_grouped_matmul_kernel_does_the_useful_flops_of_its_shapes():
    """A Pallas/Mosaic custom call of the grouped-matmul group: 2 M K N from its rows operand
    and result, in each direction (forward [M, K] -> [M, N], dlhs [M, N] -> [M, K], the weight
    gradient [M, K], [M, N] -> [G, K, N]); another group's custom call does none."""
    rows = _by_name(hk.kernels(GMM_MODULE))
    for name in ("fwd", "dlhs", "drhs"):
        assert rows[name]["group"] == "moe_gmm"
        assert rows[name]["flops"] == 2 * 512 * 64 * 32 and rows[name]["precision"] == "bf16"
    assert rows["drhs"]["kind"] == "mosaic_gpu_v2"
    assert rows["other"]["group"] == "attention" and rows["other"]["flops"] == 0
    assert rows["fwd"]["bytes_read"] == 4 * 4 + 512 * 64 * 2 + 4 * 64 * 32 * 2
