// SwiGLU's elementwise step on bfloat16 rows, for XLA's FFI: the MoE layer's unfused expert FFN
// in bf16, whose grouped matmuls write g and u as bf16. Each value is widened to float32,
// computed as the float32 handlers compute it (vec.h: Sigmoid), and rounded once to bf16, to
// nearest even (a NaN stays a NaN):
//   swiglu_bf16      h = silu(g) * u                                 -> h
//   swiglu_bwd_bf16  dg = dh * u * silu'(g), du = dh * silu(g)        -> dg, du
// One pass over the rows on the library's workers, in pieces of kPiece values, a vector at a
// time (the scalar forms below for the tail).
//
// Legend: M rows, F expert hidden dim (every operand [M, F]).
#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"
#include "threads.h"
#include "vec.h"

namespace ffi = xla::ffi;

namespace {

using dropless_native::AdviseHugePages;
using dropless_native::ForEachTask;
using dropless_native::kVW;
using dropless_native::Sigmoid;
using dropless_native::Vec;
using dropless_native::VecSigmoid;

typedef uint32_t UVec __attribute__((vector_size(kVW * sizeof(uint32_t))));
typedef uint16_t HVec __attribute__((vector_size(kVW * sizeof(uint16_t))));

constexpr int64_t kPiece = int64_t{1} << 16;   // values a task

inline float Widen(uint16_t b) {
  const uint32_t bits = uint32_t{b} << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint16_t Round(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const bool nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
  return static_cast<uint16_t>(nan ? (bits >> 16) | 0x40u : rounded);
}

// Widen and Round a vector at a time
inline Vec WidenVec(const uint16_t* p) {
  HVec h;
  std::memcpy(&h, p, sizeof(h));
  const UVec bits = __builtin_convertvector(h, UVec) << 16;
  Vec f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline void RoundVec(uint16_t* p, Vec f) {
  UVec bits;
  std::memcpy(&bits, &f, sizeof(bits));
  const UVec rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const UVec out = (bits & 0x7FFFFFFFu) > 0x7F800000u ? (bits >> 16) | 0x40u : rounded;
  const HVec h = __builtin_convertvector(out, HVec);
  std::memcpy(p, &h, sizeof(h));
}

template <typename Fn>
void ForPieces(int64_t count, Fn fn) {
  ForEachTask((count + kPiece - 1) / kPiece, [&](size_t i) {
    const int64_t lo = static_cast<int64_t>(i) * kPiece;
    fn(lo, std::min(count, lo + kPiece));
  });
}

ffi::Error SwigluBf16(ffi::Buffer<ffi::BF16> g, ffi::Buffer<ffi::BF16> u,
                      ffi::ResultBuffer<ffi::BF16> h) {
  if (g.element_count() != u.element_count() || h->element_count() != g.element_count()) {
    return ffi::Error::InvalidArgument("dropless_swiglu_bf16: g, u and h differ in size");
  }
  const uint16_t* pg = reinterpret_cast<const uint16_t*>(g.typed_data());
  const uint16_t* pu = reinterpret_cast<const uint16_t*>(u.typed_data());
  uint16_t* ph = reinterpret_cast<uint16_t*>(h->typed_data());
  AdviseHugePages(ph, sizeof(uint16_t) * g.element_count());
  ForPieces(g.element_count(), [&](int64_t lo, int64_t hi) {
    int64_t i = lo;
    for (; i + kVW <= hi; i += kVW) {
      const Vec x = WidenVec(pg + i);
      RoundVec(ph + i, x * VecSigmoid(x) * WidenVec(pu + i));
    }
    for (; i < hi; ++i) {
      const float x = Widen(pg[i]);
      ph[i] = Round(x * Sigmoid(x) * Widen(pu[i]));
    }
  });
  return ffi::Error::Success();
}

ffi::Error SwigluBwdBf16(ffi::Buffer<ffi::BF16> dh, ffi::Buffer<ffi::BF16> g,
                         ffi::Buffer<ffi::BF16> u, ffi::ResultBuffer<ffi::BF16> dg,
                         ffi::ResultBuffer<ffi::BF16> du) {
  const size_t count = g.element_count();
  if (dh.element_count() != count || u.element_count() != count ||
      dg->element_count() != count || du->element_count() != count) {
    return ffi::Error::InvalidArgument("dropless_swiglu_bwd_bf16: operands differ in size");
  }
  const uint16_t* pdh = reinterpret_cast<const uint16_t*>(dh.typed_data());
  const uint16_t* pg = reinterpret_cast<const uint16_t*>(g.typed_data());
  const uint16_t* pu = reinterpret_cast<const uint16_t*>(u.typed_data());
  uint16_t* pdg = reinterpret_cast<uint16_t*>(dg->typed_data());
  uint16_t* pdu = reinterpret_cast<uint16_t*>(du->typed_data());
  AdviseHugePages(pdg, sizeof(uint16_t) * count);
  AdviseHugePages(pdu, sizeof(uint16_t) * count);
  ForPieces(count, [&](int64_t lo, int64_t hi) {
    int64_t i = lo;
    for (; i + kVW <= hi; i += kVW) {
      const Vec x = WidenVec(pg + i), s = VecSigmoid(x), d = WidenVec(pdh + i);
      RoundVec(pdu + i, d * (x * s));
      RoundVec(pdg + i, d * WidenVec(pu + i) * (s + x * s * (1.0f - s)));
    }
    for (; i < hi; ++i) {
      const float x = Widen(pg[i]), s = Sigmoid(x), d = Widen(pdh[i]);
      pdu[i] = Round(d * (x * s));
      pdg[i] = Round(d * Widen(pu[i]) * (s + x * s * (1.0f - s)));
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DroplessSwigluBf16, SwigluBf16,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(DroplessSwigluBwdBf16, SwigluBwdBf16,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>());
