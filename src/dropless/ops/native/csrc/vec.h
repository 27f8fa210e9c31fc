// The vector arithmetic the GEMM kernels and the fused SwiGLU handlers share: a float vector of
// the widest width the build has, its loads and stores, the size of one core's L2, streaming
// stores for outputs too large to stay in cache, and exp and sigmoid written so that the
// elementwise loops vectorize.
#ifndef DROPLESS_NATIVE_VEC_H_
#define DROPLESS_NATIVE_VEC_H_

#include <unistd.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include "threads.h"

namespace dropless_native {

#if defined(__AVX512F__)
constexpr int kVW = 16;   // floats a vector
#elif defined(__AVX__)
constexpr int kVW = 8;
#else
constexpr int kVW = 4;
#endif
typedef float Vec __attribute__((vector_size(kVW * sizeof(float))));

inline Vec LoadVec(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void StoreVec(float* p, Vec v) { std::memcpy(p, &v, sizeof(v)); }

// One core's L2 in bytes (sysconf), 1 MiB where it is unknown
inline int64_t L2Bytes() {
  static const int64_t bytes = [] {
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return l2 > 0 ? int64_t{l2} : int64_t{1} << 20;
  }();
  return bytes;
}

// ---- Streaming stores ----
// A store that bypasses the caches (a non-temporal store of a whole aligned vector; a plain store
// where the address is not aligned or the build has no such instruction), so that the line is
// not first read from memory. The grouped GEMM's forward and drhs, and the fused forward, stream
// an output larger than the workers' L2s together (`StreamsOutput`): it would not stay in cache
// anyway, and a plain store would first read each of its lines from memory. A worker that
// streamed calls StreamFence before its results are read by another thread.
#if defined(__AVX__)
constexpr bool kStreams = true;
#else
constexpr bool kStreams = false;
#endif
inline void StreamVec(float* p, Vec v) {
  if ((reinterpret_cast<uintptr_t>(p) & (sizeof(Vec) - 1)) == 0) {
#if defined(__AVX512F__)
    __m512 m;
    std::memcpy(&m, &v, sizeof(m));
    _mm512_stream_ps(p, m);
    return;
#elif defined(__AVX__)
    __m256 m;
    std::memcpy(&m, &v, sizeof(m));
    _mm256_stream_ps(p, m);
    return;
#endif
  }
  StoreVec(p, v);
}
// the output size above which it is streamed (-1: never, the build has no streaming stores)
inline int64_t StreamMinBytes() { return kStreams ? Threads() * L2Bytes() : -1; }
inline bool StreamsOutput(int64_t floats) {
  return kStreams && int64_t{sizeof(float)} * floats > StreamMinBytes();
}
inline void StreamFence() {
#if defined(__AVX__)
  _mm_sfence();
#endif
}

// ---- exp and sigmoid ----
// exp(x) in float32 without branches or calls, so the elementwise loops vectorize: Cody-Waite
// range reduction x = n ln2 + r, |r| <= ln2 / 2, and Cephes's degree-6 polynomial for exp(r)
// (about 1 ulp); x is clamped to where the result is a normal float. A NaN stays NaN.
// exp(x - n ln2) for the n = round(x / ln2) of the range reduction, on a float or a vector
template <typename T>
inline T ExpReduced(T x, T n) {
  const T r = x - n * 0.693359375f + n * 2.12194440e-4f;
  T p = T{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.0f;
}

inline float FastExp(float x) {
  x = x < -87.3f ? -87.3f : x;   // (a NaN passes both: it stays NaN)
  x = x > 88.3f ? 88.3f : x;
  const float n = __builtin_floorf(x * 1.44269504089f + 0.5f);
  const float p = ExpReduced(x, n);
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

inline float Sigmoid(float x) { return 1.0f / (1.0f + FastExp(-x)); }

// FastExp and Sigmoid on a vector, the same operations lane by lane (the floor as a truncation
// corrected where it rounded up)
typedef int32_t IVec __attribute__((vector_size(kVW * sizeof(int32_t))));
inline Vec Splat(float a) { return a - Vec{}; }
inline Vec VecExp(Vec x) {
  x = x < Splat(-87.3f) ? Splat(-87.3f) : x;   // (a NaN passes both: it stays NaN)
  x = x > Splat(88.3f) ? Splat(88.3f) : x;
  const Vec y = x * 1.44269504089f + 0.5f;
  const Vec t = __builtin_convertvector(__builtin_convertvector(y, IVec), Vec);
  const Vec n = t > y ? t - 1.0f : t;
  const Vec p = ExpReduced(x, n);
  const IVec bits = (__builtin_convertvector(n, IVec) + 127) << 23;
  Vec scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}
inline Vec VecSigmoid(Vec x) { return 1.0f / (1.0f + VecExp(-x)); }

}  // namespace dropless_native

#endif  // DROPLESS_NATIVE_VEC_H_
