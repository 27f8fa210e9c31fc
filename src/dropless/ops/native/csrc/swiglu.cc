// The SwiGLU expert FFN's products for XLA's FFI, float32, with its elementwise steps fused in:
// each row task finishes its rows while they are in cache, so no [M, F] intermediate is written
// and read back by a separate pass. Each group's products run on OpenBLAS's sgemm or the
// library's register-tiled kernel (kernel.h: `KernelChoice`), cut into row tasks as the grouped
// GEMM's forward is (tasks.h).
//
// Legend: M rows (sorted by expert), D model dim, F expert hidden dim, G experts (groups).
//
//   gate_up_swiglu  g = x @ wg[g], u = x @ wu[g], h = silu(g) * u        -> g, u, h  [M, F]
//   swiglu_dlhs     dh = dy @ wd[g]^T, then dg = dh * u * silu'(g), du = dh * silu(g)  -> dg, du
//   dual_dlhs       dx = dg @ wg[g]^T + du @ wu[g]^T                       -> dx  [M, D]
// Groups as in grouped_gemm.cc (ragged_dot semantics); rows past the last group are written as
// zeros, never computed.
#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"
#include "kernel.h"
#include "tasks.h"
#include "threads.h"
#include "vec.h"

namespace ffi = xla::ffi;

namespace {

using dropless_native::AdviseHugePages;
using dropless_native::CountGemms;
using dropless_native::FastExp;
using dropless_native::ForRowTasks;
using dropless_native::Gemm;
using dropless_native::GroupBounds;
using dropless_native::Kernel;
using dropless_native::KernelChoice;
using dropless_native::kOwn;
using dropless_native::kVW;
using dropless_native::LoadVec;
using dropless_native::OwnGateUp;
using dropless_native::OwnGemmNT;
using dropless_native::SetPrefetch;
using dropless_native::Sigmoid;
using dropless_native::StoreVec;
using dropless_native::StreamFence;
using dropless_native::Streams;
using dropless_native::Vec;
using dropless_native::VecExp;
using dropless_native::VecSigmoid;

void ZeroRows(float* p, int64_t from, int64_t to, int64_t width) {
  if (to > from) std::memset(p + from * width, 0, sizeof(float) * (to - from) * width);
}

// x [m, d], wg and wu [G, d, f] -> g, u, h [m, f] (the handler's work on raw operands)
void RunGateUp(const float* px, const float* pwg, const float* pwu, const int32_t* sizes,
               int64_t g_count, int64_t m, int64_t d, int64_t f, float* pg, float* pu,
               float* ph) {
  if (m * f == 0) return;
  for (float* p : {pg, pu, ph}) AdviseHugePages(p, sizeof(float) * m * f);
  const auto bounds = GroupBounds(sizes, g_count, m);
  const int64_t done = d == 0 ? 0 : bounds.back();
  for (float* p : {pg, pu, ph}) ZeroRows(p, done, m, f);
  if (d == 0) return;
  const KernelChoice kernels = KernelChoice::Now(dropless_native::kKernelGateUp);
  auto spans = [&](int64_t grp, int64_t lo, int64_t hi, bool same) {
    const int64_t w = same ? 0 : d * f;
    SetPrefetch({{pwg + grp * d * f, w}, {pwu + grp * d * f, w}, {px + lo * d, (hi - lo) * d}});
  };
  const bool stream = Streams(m * f);
  ForRowTasks(bounds, 2 * d * f, spans, [&](int64_t grp, int64_t lo, int64_t hi) {
    const Kernel own = kernels.Which();
    if (own == kOwn) {
      CountGemms(kOwn, 2);
      OwnGateUp(hi - lo, f, d, px + lo * d, d, pwg + grp * d * f, pwu + grp * d * f, f,
                pg + lo * f, pu + lo * f, ph + lo * f, f, stream);
      if (stream) StreamFence();
      return;
    }
    Gemm(own, false, false, hi - lo, f, d, px + lo * d, d, pwg + grp * d * f, f, false,
         pg + lo * f, f);
    Gemm(own, false, false, hi - lo, f, d, px + lo * d, d, pwu + grp * d * f, f, false,
         pu + lo * f, f);
    for (int64_t i = lo * f; i < hi * f; ++i) ph[i] = pg[i] * Sigmoid(pg[i]) * pu[i];
  });
}

ffi::Error GateUpSwiglu(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> wg,
                        ffi::Buffer<ffi::F32> wu, ffi::Buffer<ffi::S32> sizes,
                        ffi::ResultBuffer<ffi::F32> g_out, ffi::ResultBuffer<ffi::F32> u_out,
                        ffi::ResultBuffer<ffi::F32> h_out) {
  RunGateUp(x.typed_data(), wg.typed_data(), wu.typed_data(), sizes.typed_data(),
            sizes.element_count(), x.dimensions()[0], x.dimensions()[1], wg.dimensions()[2],
            g_out->typed_data(), u_out->typed_data(), h_out->typed_data());
  return ffi::Error::Success();
}

// dy [m, d], wd [G, f, d], g and u [m, f] -> dg, du [m, f] (the handler's work on raw operands)
void RunSwigluDlhs(const float* pdy, const float* pwd, const float* pg, const float* pu,
                   const int32_t* sizes, int64_t g_count, int64_t m, int64_t d, int64_t f,
                   float* pdg, float* pdu) {
  if (m * f == 0) return;
  for (float* p : {pdg, pdu}) AdviseHugePages(p, sizeof(float) * m * f);
  const auto bounds = GroupBounds(sizes, g_count, m);
  const int64_t done = d == 0 ? 0 : bounds.back();
  for (float* p : {pdg, pdu}) ZeroRows(p, done, m, f);
  if (d == 0) return;
  const KernelChoice kernels = KernelChoice::Now(dropless_native::kKernelNT);
  auto spans = [&](int64_t grp, int64_t lo, int64_t hi, bool same) {
    SetPrefetch({{pwd + grp * f * d, same ? 0 : f * d}, {pdy + lo * d, (hi - lo) * d},
                 {pg + lo * f, (hi - lo) * f}, {pu + lo * f, (hi - lo) * f}});
  };
  // dh lands in dg's rows, then both gradients are finished in place
  auto finish = [&](int64_t from, int64_t to) {
    int64_t i = from * f;
    for (; i + kVW <= to * f; i += kVW) {   // the loop below, a vector at a time
      const Vec gv = LoadVec(pg + i), s = VecSigmoid(gv), dh = LoadVec(pdg + i);
      StoreVec(pdu + i, dh * (gv * s));
      StoreVec(pdg + i, dh * LoadVec(pu + i) * (s + gv * s * (1.0f - s)));
    }
    for (; i < to * f; ++i) {
      const float s = Sigmoid(pg[i]), dh = pdg[i];
      pdu[i] = dh * (pg[i] * s);
      pdg[i] = dh * pu[i] * (s + pg[i] * s * (1.0f - s));
    }
  };
  ForRowTasks(bounds, d * f, spans, [&](int64_t grp, int64_t lo, int64_t hi) {
    const Kernel own = kernels.Which();
    Gemm(own, false, true, hi - lo, f, d, pdy + lo * d, d, pwd + grp * f * d, d, false,
         pdg + lo * f, f);
    finish(lo, hi);
  });
}

ffi::Error SwigluDlhs(ffi::Buffer<ffi::F32> dy, ffi::Buffer<ffi::F32> wd,
                      ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> u,
                      ffi::Buffer<ffi::S32> sizes, ffi::ResultBuffer<ffi::F32> dg_out,
                      ffi::ResultBuffer<ffi::F32> du_out) {
  RunSwigluDlhs(dy.typed_data(), wd.typed_data(), g.typed_data(), u.typed_data(),
                sizes.typed_data(), sizes.element_count(), dy.dimensions()[0],
                dy.dimensions()[1], wd.dimensions()[1], dg_out->typed_data(),
                du_out->typed_data());
  return ffi::Error::Success();
}

// a1, a2 [m, f], w1, w2 [G, d, f] -> a1 @ w1[g]^T + a2 @ w2[g]^T  [m, d] (the handler's work on
// raw operands)
void RunDualDlhs(const float* p1, const float* pw1, const float* p2, const float* pw2,
                 const int32_t* sizes, int64_t g_count, int64_t m, int64_t d, int64_t f,
                 float* po) {
  if (m * d == 0) return;
  AdviseHugePages(po, sizeof(float) * m * d);
  const auto bounds = GroupBounds(sizes, g_count, m);
  const int64_t done = f == 0 ? 0 : bounds.back();
  ZeroRows(po, done, m, d);
  if (f == 0) return;
  const KernelChoice kernels = KernelChoice::Now(dropless_native::kKernelNT);
  auto spans = [&](int64_t grp, int64_t lo, int64_t hi, bool same) {
    const int64_t w = same ? 0 : d * f;
    SetPrefetch({{pw1 + grp * d * f, w}, {pw2 + grp * d * f, w}, {p1 + lo * f, (hi - lo) * f},
                 {p2 + lo * f, (hi - lo) * f}});
  };
  ForRowTasks(bounds, 2 * d * f, spans, [&](int64_t grp, int64_t lo, int64_t hi) {
    const Kernel own = kernels.Which();
    if (own == kOwn) {   // both products of a chunk of rows while it is in cache
      CountGemms(kOwn, 2);
      OwnGemmNT(hi - lo, d, f, p1 + lo * f, f, pw1 + grp * d * f, f, po + lo * d, d, false,
                p2 + lo * f, pw2 + grp * d * f);
      return;
    }
    Gemm(own, false, true, hi - lo, d, f, p1 + lo * f, f, pw1 + grp * d * f, f, false,
         po + lo * d, d);
    Gemm(own, false, true, hi - lo, d, f, p2 + lo * f, f, pw2 + grp * d * f, f, true,
         po + lo * d, d);
  });
}

ffi::Error DualDlhs(ffi::Buffer<ffi::F32> a1, ffi::Buffer<ffi::F32> w1,
                    ffi::Buffer<ffi::F32> a2, ffi::Buffer<ffi::F32> w2,
                    ffi::Buffer<ffi::S32> sizes, ffi::ResultBuffer<ffi::F32> out) {
  RunDualDlhs(a1.typed_data(), w1.typed_data(), a2.typed_data(), w2.typed_data(),
              sizes.typed_data(), sizes.element_count(), a1.dimensions()[0],
              w1.dimensions()[1], a1.dimensions()[1], out->typed_data());
  return ffi::Error::Success();
}

}  // namespace

// the fused forward and backward on raw operands, for the calibration (native/calibrate.py)
extern "C" void dropless_run_gate_up(const float* x, const float* wg, const float* wu,
                                     const int32_t* sizes, int64_t g_count, int64_t m, int64_t d,
                                     int64_t f, float* g, float* u, float* h) {
  RunGateUp(x, wg, wu, sizes, g_count, m, d, f, g, u, h);
}
extern "C" void dropless_run_swiglu_dlhs(const float* dy, const float* wd, const float* g,
                                         const float* u, const int32_t* sizes, int64_t g_count,
                                         int64_t m, int64_t d, int64_t f, float* dg, float* du) {
  RunSwigluDlhs(dy, wd, g, u, sizes, g_count, m, d, f, dg, du);
}
extern "C" void dropless_run_dual_dlhs(const float* a1, const float* w1, const float* a2,
                                       const float* w2, const int32_t* sizes, int64_t g_count,
                                       int64_t m, int64_t d, int64_t f, float* out) {
  RunDualDlhs(a1, w1, a2, w2, sizes, g_count, m, d, f, out);
}

// the elementwise exp the fused handlers use, exported for the tests
extern "C" void dropless_fast_exp(const float* x, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = FastExp(x[i]);
}
// the same a vector at a time (VecExp, the fused handlers' vector loops), n a whole number of
// vectors (`dropless_vector_floats`)
extern "C" void dropless_fast_exp_vec(const float* x, float* out, int64_t n) {
  for (int64_t i = 0; i + kVW <= n; i += kVW) StoreVec(out + i, VecExp(LoadVec(x + i)));
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(DroplessGateUpSwigluF32, GateUpSwiglu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(DroplessSwigluDlhsF32, SwigluDlhs,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(DroplessDualDlhsF32, DualDlhs,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
