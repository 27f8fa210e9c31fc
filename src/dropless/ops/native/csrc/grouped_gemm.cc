// A CPU grouped GEMM for XLA's FFI: one GEMM per group, on each group's rows in place (no
// copies, no masked rows), float32. A group's GEMM is OpenBLAS's sgemm or the register-tiled
// kernel below (`KernelChoice` says which).
//
// Legend: M rows (sorted by group), K contraction dim, N output dim, G groups.
//
// One handler, three products, chosen by the attribute `mode`:
//   0  forward  out[M, N]    rows of g:  a[M, K] @ b[g]          (b = rhs [G, K, N])
//   1  dlhs     out[M, K]    rows of g:  a[M, N] @ b[g]^T        (a = dy, b = rhs [G, K, N])
//   2  drhs     out[G, K, N] group g:    a[rows, K]^T @ b[rows, N]  (a = lhs, b = dy)
// Three more handlers fuse the SwiGLU expert FFN's elementwise steps into its products (each
// row task finishes its rows while they are in cache; no [M, F] intermediate is written and read
// back by a separate pass):
//   gate_up_swiglu  g = x @ wg[g], u = x @ wu[g], h = silu(g) * u        -> g, u, h  [M, F]
//   swiglu_dlhs     dh = dy @ wd[g]^T, then dg = dh * u * silu'(g), du = dh * silu(g)  -> dg, du
//   dual_dlhs       dx = dg @ wg[g]^T + du @ wu[g]^T                       -> dx  [M, D]
// Group g covers rows [start_g, end_g) with end_g = min(sum(max(sizes[:g+1], 0)), M) (ragged_dot
// semantics: negative sizes count as zero, a group is cut at row M). Rows past the last group
// and empty groups' weight gradients are written as zeros, never computed, so a NaN reaches only
// the rows and the group it belongs to.
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <thread>
#include <vector>

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"
#include "threads.h"

extern "C" {
// OpenBLAS's CBLAS as the scipy-openblas32 wheel exports it (symbols prefixed `scipy_`).
enum CBLAS_ORDER { CblasRowMajor = 101, CblasColMajor = 102 };
enum CBLAS_TRANSPOSE { CblasNoTrans = 111, CblasTrans = 112 };
void scipy_cblas_sgemm(CBLAS_ORDER order, CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int m, int n,
                       int k, float alpha, const float* a, int lda, const float* b, int ldb,
                       float beta, float* c, int ldc);
}

namespace ffi = xla::ffi;

namespace {

using dropless_native::AdviseHugePages;
using dropless_native::ForEachTaskAhead;
using dropless_native::Threads;

// Every GEMM runs on one thread; the parallelism is ours: the products are cut into tasks (row
// ranges of a group for forward and dlhs, row ranges of a group's [K, N] block for drhs), smaller
// towards the end (`CutTasks`), and `Threads()` workers take them in turn. OpenBLAS's own
// threading costs more than it saves on a 32-row group and cannot be limited per call in this
// build.
constexpr int64_t kTaskMacs = int64_t{1} << 24;   // smallest task worth its own call

// ---- The register-tiled kernel ----
// Each product is cut into tiles of MR rows x NV vectors of C held in registers; the loop over
// the contraction broadcasts MR values of A and loads NV vectors of one row of B (read in place,
// no packing), in chunks (`ChunkRows`) so a B panel stays in L2. The NT form (c = a @ b^T)
// computes c^T = b @ a^T, with a^T packed kNtRows rows at a time (a small copy that stays in cache; its
// rows padded to whole vectors, all computed in one pass of up to 3 vectors where AVX-512 has
// the registers) and c written transposed (in registers, `StoreTransposed8`, where AVX-512
// has the shuffles). Where it runs instead of OpenBLAS is `KernelChoice`'s rule.
#if defined(__AVX512F__)
constexpr int kVW = 16;   // floats a vector
constexpr int kMR = 6, kNV = 4, kNtMR = 8, kNtNV = 2;   // 32 vector registers
#elif defined(__AVX__)
constexpr int kVW = 8;
constexpr int kMR = 6, kNV = 2, kNtMR = 6, kNtNV = 2;   // 16 vector registers
#else
constexpr int kVW = 4;
constexpr int kMR = 6, kNV = 2, kNtMR = 6, kNtNV = 2;
#endif
constexpr int64_t kNtRows = 64;
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

// The contraction's chunk for a B panel `panel_floats` wide: the rows that fill half of one
// core's L2 (2048 rows of a 64-float panel in a 1 MiB L2), so the panel stays there while A's
// tiles sweep it. A product whose contraction fits one chunk writes each tile of C once, and
// can stream it; a second chunk reads C back (a [1024 rows, 1024] @ [1024, 512] forward in
// 512-row chunks was 5% slower, docs/grouped_matmul.md).
inline int64_t ChunkRows(int64_t panel_floats) {
  const int64_t rows = L2Bytes() / 2 / (int64_t{sizeof(float)} * panel_floats);
  return std::max<int64_t>(rows / 16 * 16, 256);
}

// ---- Streaming stores ----
// A store that bypasses the caches (a non-temporal store of a whole aligned vector; a plain store
// where the address is not aligned or the build has no such instruction), so that the line is
// not first read from memory. The grouped GEMM's forward and drhs stream an output larger than
// the workers' L2s together (`StreamsOutput`), which would not stay in cache anyway: at 256
// groups (K = 512, N = 128) drhs's 64 MiB of [K, N] blocks ran 1.7x faster for it and the down
// projection's 16 MiB forward 1.2x (docs/grouped_matmul.md). A worker that streamed calls
// StreamFence before its results are read by another thread.
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

// ---- Prefetching the next task's operands ----
// A worker knows its next task while it runs the current one (ForEachTaskAhead). The tiled
// kernel's contraction loop prefetches that task's operands into L2, one cache line a step, so
// their memory latency overlaps this task's arithmetic: a 32-row group's weights (256 KiB at
// K = 512, N = 128) are otherwise read from memory by its first row tile, which has too little
// arithmetic to hide them. A task's prefetch stops at `PrefetchBytes()`: three quarters of the
// L2 (768 KiB of a 1 MiB L2, the best of 256, 512, 768 and 1024 KiB at 256 groups of 32 rows,
// docs/grouped_matmul.md; 768 KiB where the L2's size is unknown).
inline int64_t PrefetchBytes() { return L2Bytes() / 4 * 3; }
constexpr int kMaxSpans = 4;

struct Span {
  const float* data;
  int64_t floats;
};

struct PrefetchQueue {
  const char* next = nullptr;   // the line the kernel prefetches next, up to end
  const char* end = nullptr;
  Span spans[kMaxSpans];        // what follows spans[at - 1]
  int count = 0, at = 0;

  void Advance() {
    next = end = nullptr;
    if (at < count) {
      next = reinterpret_cast<const char*>(spans[at].data);
      end = next + sizeof(float) * spans[at].floats;
      ++at;
    }
  }
};
thread_local PrefetchQueue g_prefetch;

// The spans the kernel prefetches from now on (empty: none), cut to PrefetchBytes() in all
void SetPrefetch(std::initializer_list<Span> spans) {
  PrefetchQueue& q = g_prefetch;
  q.count = q.at = 0;
  int64_t budget = PrefetchBytes() / static_cast<int64_t>(sizeof(float));
  for (const Span& s : spans) {
    if (q.count == kMaxSpans || budget == 0) break;
    if (s.floats <= 0) continue;
    const int64_t take = std::min(s.floats, budget);
    q.spans[q.count++] = {s.data, take};
    budget -= take;
  }
  q.Advance();
}

#if defined(__AVX512F__)
// c[j * ldc + r] (+)= acc[r][v][l] for j = v * 16 + l < cols and r < 8: each 8 x 16 block is
// transposed in registers (two shuffle stages give 4 r-values of one j per 128-bit lane), so a
// row j of c gets two 4-float stores instead of eight scalar ones.
template <int NV>
void StoreTransposed8(const Vec (&acc)[8][NV], float* c, int64_t ldc, int cols, bool accumulate) {
  for (int v = 0; v < NV && v * kVW < cols; ++v) {
    __m512 a[8];
    for (int r = 0; r < 8; ++r) std::memcpy(&a[r], &acc[r][v], sizeof(__m512));
    float half[2][4][16];   // [r 0-3 | 4-7][q]: lane l holds rows r of j = 16 v + 4 l + q
    for (int h = 0; h < 2; ++h) {
      const __m512 t0 = _mm512_unpacklo_ps(a[4 * h], a[4 * h + 1]);
      const __m512 t1 = _mm512_unpackhi_ps(a[4 * h], a[4 * h + 1]);
      const __m512 t2 = _mm512_unpacklo_ps(a[4 * h + 2], a[4 * h + 3]);
      const __m512 t3 = _mm512_unpackhi_ps(a[4 * h + 2], a[4 * h + 3]);
      _mm512_storeu_ps(half[h][0], _mm512_shuffle_ps(t0, t2, 0x44));
      _mm512_storeu_ps(half[h][1], _mm512_shuffle_ps(t0, t2, 0xEE));
      _mm512_storeu_ps(half[h][2], _mm512_shuffle_ps(t1, t3, 0x44));
      _mm512_storeu_ps(half[h][3], _mm512_shuffle_ps(t1, t3, 0xEE));
    }
    const int rows = std::min(kVW, cols - v * kVW);
    for (int i = 0; i < rows; ++i) {
      float* q = c + (v * kVW + i) * ldc;
      const int l = i / 4, qq = i % 4;
      __m128 lo = _mm_loadu_ps(&half[0][qq][4 * l]), hi = _mm_loadu_ps(&half[1][qq][4 * l]);
      if (accumulate) {
        lo = _mm_add_ps(lo, _mm_loadu_ps(q));
        hi = _mm_add_ps(hi, _mm_loadu_ps(q + 4));
      }
      _mm_storeu_ps(q, lo);
      _mm_storeu_ps(q + 4, hi);
    }
  }
}
#endif

// c[MR, cols] (+)= A[MR, k] @ B[k, NV * kVW][:, :cols], A(r, p) = a[r * sar + p * sac], B's rows
// ldb apart (NV * kVW of each readable), C(r, j) = c[r * scr + j * scc]
template <int MR, int NV>
void Tile(int64_t k, const float* a, int64_t sar, int64_t sac, const float* b, int64_t ldb,
          float* c, int64_t scr, int64_t scc, int cols, bool accumulate, bool stream) {
  Vec acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = Vec{};
  const char* pf = g_prefetch.next;
  const char* const pf_end = g_prefetch.end;
  for (int64_t p = 0; p < k; ++p) {
    Vec bv[NV];
    for (int v = 0; v < NV; ++v) bv[v] = LoadVec(b + p * ldb + v * kVW);
    if (pf < pf_end) {
      __builtin_prefetch(pf, 0, 2);
      pf += 64;
    }
    for (int r = 0; r < MR; ++r) {
      const Vec av = a[r * sar + p * sac] - Vec{};
      for (int v = 0; v < NV; ++v) acc[r][v] += av * bv[v];
    }
  }
  g_prefetch.next = pf;
  if (pf >= pf_end) g_prefetch.Advance();
  if (scc == 1 && cols == NV * kVW) {
    if (stream && !accumulate) {
      for (int r = 0; r < MR; ++r)
        for (int v = 0; v < NV; ++v) StreamVec(c + r * scr + v * kVW, acc[r][v]);
      return;
    }
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < NV; ++v) {
        float* q = c + r * scr + v * kVW;
        StoreVec(q, accumulate ? LoadVec(q) + acc[r][v] : acc[r][v]);
      }
    return;
  }
#if defined(__AVX512F__)
  if constexpr (MR == 8) {
    if (scr == 1) {   // the NT form's c^T tile: 8 floats of each of `cols` rows of c
      StoreTransposed8<NV>(acc, c, scc, cols, accumulate);
      return;
    }
  }
#endif
  float buf[MR][NV * kVW];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) StoreVec(&buf[r][v * kVW], acc[r][v]);
  for (int j = 0; j < cols; ++j)
    for (int r = 0; r < MR; ++r) {
      float* q = c + r * scr + j * scc;
      *q = accumulate ? *q + buf[r][j] : buf[r][j];
    }
}

// Tile over m rows: MR at a time, then one smaller tile for the rest
template <int MR, int NV>
void TileRows(int64_t m, int64_t k, const float* a, int64_t sar, int64_t sac, const float* b,
              int64_t ldb, float* c, int64_t scr, int64_t scc, int cols, bool accumulate,
              bool stream) {
  int64_t r = 0;
  for (; r + MR <= m; r += MR) {
    Tile<MR, NV>(k, a + r * sar, sar, sac, b, ldb, c + r * scr, scr, scc, cols, accumulate,
                 stream);
  }
  a += r * sar;
  c += r * scr;
  switch (m - r) {
#define DROPLESS_REST(x) \
    case x: if constexpr (x < MR) Tile<x, NV>(k, a, sar, sac, b, ldb, c, scr, scc, cols, accumulate, stream); break;
    DROPLESS_REST(1) DROPLESS_REST(2) DROPLESS_REST(3) DROPLESS_REST(4) DROPLESS_REST(5)
    DROPLESS_REST(6) DROPLESS_REST(7)
#undef DROPLESS_REST
    default: break;
  }
}

// c[m, n] (+)= A[m, k] @ b[k, n] with A and C strided as in Tile. b_padded: b's rows are
// readable up to n rounded up to whole vectors (the last partial vector is then computed whole
// and stored in part); otherwise the last n % kVW columns are summed one by one.
template <int MR, int NV>
void OwnGemm(int64_t m, int64_t n, int64_t k, const float* a, int64_t sar, int64_t sac,
             const float* b, int64_t ldb, bool b_padded, float* c, int64_t scr, int64_t scc,
             bool accumulate, bool stream = false) {
  const int64_t chunk = ChunkRows(NV * kVW);
  stream = stream && k <= chunk;   // (a C written in several chunks is read back)
  for (int64_t k0 = 0; k0 < k; k0 += chunk) {
    const int64_t kc = std::min(chunk, k - k0);
    const bool acc = accumulate || k0 > 0;
    const float* ak = a + k0 * sac;
    const float* bk = b + k0 * ldb;
    // columns computed in whole vectors: where b's rows are padded, all of them
    const int64_t whole = b_padded ? (n + kVW - 1) / kVW * kVW : n / kVW * kVW;
    // every whole-vector column block of rows [r0, r0 + rows)
    auto blocks = [&](int64_t r0, int64_t rows) {
      const float* ar = ak + r0 * sar;
      float* cr = c + r0 * scr;
      int64_t j = 0;
      for (; j + NV * kVW <= whole; j += NV * kVW) {
        TileRows<MR, NV>(rows, kc, ar, sar, sac, bk + j, ldb, cr + j * scc, scr, scc,
                         static_cast<int>(std::min<int64_t>(NV * kVW, n - j)), acc, stream);
      }
      for (; j < whole; j += kVW) {
        TileRows<MR, 1>(rows, kc, ar, sar, sac, bk + j, ldb, cr + j * scc, scr, scc,
                        static_cast<int>(std::min<int64_t>(kVW, n - j)), acc, stream);
      }
    };
    // Where the chunk of b fits half the L2, each tile of A's rows runs every column block
    // (A's tile read from L1 again, b from L2); else each column block runs every row of A, so
    // that its panel stays in L2. The NT form's packed b is small: read the other way, its
    // [1024, 512] weights were fetched from L3 once a column block
    if (int64_t{sizeof(float)} * kc * whole <= L2Bytes() / 2) {
      for (int64_t r0 = 0; r0 < m; r0 += MR) blocks(r0, std::min<int64_t>(MR, m - r0));
    } else {
      blocks(0, m);
    }
    int64_t j = whole;
    for (; j < n; ++j)
      for (int64_t r = 0; r < m; ++r) {
        float sum = 0.0f;
        for (int64_t p = 0; p < kc; ++p) sum += ak[r * sar + p * sac] * bk[p * ldb + j];
        float* q = c + r * scr + j * scc;
        *q = acc ? *q + sum : sum;
      }
  }
}

#if defined(__AVX512F__)
// r[q] = column q of the 16 x 16 block whose rows are r[0..15] (three shuffle stages)
inline void Transpose16(__m512 (&r)[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < 4; ++i) {
      t[8 * h + i] = _mm512_shuffle_f32x4(r[8 * h + i], r[8 * h + i + 4], 0x88);
      t[8 * h + i + 4] = _mm512_shuffle_f32x4(r[8 * h + i], r[8 * h + i + 4], 0xDD);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
  }
}
#endif

// out[p * width + i] = a[i * lda + p] for i < rows, p < k, and 0 for rows <= i < width: the
// transpose of a's rows, each row of out padded to `width` floats. Whole 16 x 16 blocks are
// transposed in registers where AVX-512 has the shuffles: a scalar transpose writes one float a
// cache line, and took a tenth of the NT form's time at 1024-row groups.
void PackTransposed(const float* a, int64_t lda, int64_t rows, int64_t k, float* out,
                    int64_t width) {
  int64_t i0 = 0, p0 = 0;
#if defined(__AVX512F__)
  const int64_t whole_k = k / 16 * 16;
  for (; i0 + 16 <= rows; i0 += 16) {
    for (int64_t p = 0; p < whole_k; p += 16) {
      __m512 r[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(a + (i0 + i) * lda + p);
      Transpose16(r);
      for (int q = 0; q < 16; ++q) _mm512_storeu_ps(out + (p + q) * width + i0, r[q]);
    }
  }
  p0 = whole_k;   // rows [0, i0) lack only the columns [whole_k, k)
#endif
  for (int64_t p = 0; p < k; ++p) {
    float* o = out + p * width;
    for (int64_t i = p < p0 ? i0 : 0; i < rows; ++i) o[i] = a[i * lda + p];
    for (int64_t i = rows; i < width; ++i) o[i] = 0.0f;
  }
}

// c[rows, n] (+)= a[rows, k] @ b[n, k]^T for rows <= kNtRows: c^T = b @ a^T, a^T packed
void NtChunk(int64_t rows, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
             int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  thread_local std::vector<float> pack;   // a^T [k, rows rounded up to whole vectors]
  const int64_t width = (rows + kVW - 1) / kVW * kVW;
  pack.resize(k * width);
  PackTransposed(a, lda, rows, k, pack.data(), width);
  if constexpr (kVW == 16) {   // 8 x 3 vectors fit the 32 registers: 48 rows in one pass
    if (width == 3 * kVW) {
      OwnGemm<kNtMR, 3>(n, rows, k, b, ldb, 1, pack.data(), width, true, c, 1, ldc, accumulate);
      return;
    }
  }
  OwnGemm<kNtMR, kNtNV>(n, rows, k, b, ldb, 1, pack.data(), width, true, c, 1, ldc, accumulate);
}

// c[m, n] (+)= a[m, k] @ b[n, k]^T, plus a2[m, k] @ b2[n, k]^T where a2 is given (a2 and b2
// strided as a and b), kNtRows rows at a time: a chunk's second product adds into its rows of c
// while they are in cache.
void OwnGemmNT(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
               int64_t ldb, float* c, int64_t ldc, bool accumulate, const float* a2 = nullptr,
               const float* b2 = nullptr) {
  for (int64_t i0 = 0; i0 < m; i0 += kNtRows) {
    const int64_t rows = std::min(kNtRows, m - i0);
    NtChunk(rows, n, k, a + i0 * lda, lda, b, ldb, c + i0 * ldc, ldc, accumulate);
    if (a2 != nullptr) NtChunk(rows, n, k, a2 + i0 * lda, lda, b2, ldb, c + i0 * ldc, ldc, true);
  }
}

// Which kernel runs a group's products: `g_kernel` forces one; otherwise the tiled kernel in
// AVX-512 builds, for every group (it ran ahead of OpenBLAS's AVX-512 kernels from 32- to
// 1024-row groups), and OpenBLAS elsewhere (an AVX2 build of the tiled kernel lost to OpenBLAS's
// Haswell kernels; docs/grouped_matmul.md).
// 0 neither forced, 1 the tiled kernel, 2 OpenBLAS: set by dropless_set_kernel (openblas.py: from
// DROPLESS_NATIVE_KERNEL when the library loads, and by `use_kernel`), read at each call
std::atomic<int> g_kernel{0};

struct KernelChoice {
  int forced;

  static KernelChoice Now() { return {g_kernel.load(std::memory_order_relaxed)}; }
  bool Own() const { return forced != 0 ? forced == 1 : kVW == 16; }
};

// GEMMs run by each kernel in this process (the tests check which one ran)
std::atomic<int64_t> g_gemm_calls[2] = {};   // [0] OpenBLAS, [1] the tiled kernel

// The TN form (drhs: a^T @ b, the contraction over a group's rows) transposes a where it has at
// least this many rows, so that a tile's broadcasts read A's rows in order. Read in place, each
// step's values are in another row of a, `lda` floats on: 8% slower at 1024-row groups with both
// threads on cold operands. At 32-row groups the copy costs more than it saves
// (docs/grouped_matmul.md).
constexpr int64_t kTransposeRows = 128;
// floats of a^T a worker transposes at a time (4 MiB: 1024 of K's rows of a 1024-row group; a
// 4096-row group at K = 7168 would otherwise keep 117 MB in each worker)
constexpr int64_t kTransposeFloats = int64_t{1} << 20;

inline void CountGemms(bool own, int64_t count) {
  g_gemm_calls[own ? 1 : 0].fetch_add(count, std::memory_order_relaxed);
}

// c[m, n] = (or += where accumulate) op(a) @ op(b), row-major, op = the transpose where ta / tb
// (not both): OpenBLAS's sgemm or the tiled kernel

void Gemm(bool own, bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a,
          int64_t lda, const float* b, int64_t ldb, bool accumulate, float* c, int64_t ldc,
          bool stream = false) {
  CountGemms(own, 1);
  if (!own) {
    scipy_cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
                      m, n, k, 1.0f, a, lda, b, ldb, accumulate ? 1.0f : 0.0f, c, ldc);
  } else if (tb) {
    OwnGemmNT(m, n, k, a, lda, b, ldb, c, ldc, accumulate);
  } else if (ta && k < kTransposeRows) {
    OwnGemm<kMR, kNV>(m, n, k, a, 1, lda, b, ldb, false, c, ldc, 1, accumulate, stream);
  } else if (ta) {   // a^T's rows a slice at a time: [rows, k], at most kTransposeFloats
    thread_local std::vector<float> at;
    const int64_t step = std::max<int64_t>(1, std::min(m, kTransposeFloats / k));
    at.resize(step * k);
    for (int64_t r0 = 0; r0 < m; r0 += step) {
      const int64_t rows = std::min(step, m - r0);
      PackTransposed(a + r0, lda, k, rows, at.data(), k);
      OwnGemm<kMR, kNV>(rows, n, k, at.data(), k, 1, b, ldb, false, c + r0 * ldc, ldc, 1,
                        accumulate, stream);
    }
  } else {
    OwnGemm<kMR, kNV>(m, n, k, a, lda, 1, b, ldb, false, c, ldc, 1, accumulate, stream);
  }
}

struct Problem {
  int32_t mode;
  int64_t m, k, n;   // k, n: rhs's [K, N] (forward, dlhs); lhs's K and dy's N (drhs)
  const float* a;
  const float* b;
  float* out;
  KernelChoice kernels;
  bool stream;   // the forward's or drhs's output is written with streaming stores
};

struct Task {
  int64_t g, lo, hi;   // rows [lo, hi) (forward, dlhs) or rows [lo, hi) of the [K, N] block (drhs)
  int64_t start, end;  // the group's rows
};

void RunTask(const Problem& p, const Task& t) {
  const int64_t k = p.k, n = p.n, len = t.hi - t.lo, rows = t.end - t.start;
  const bool own = p.kernels.Own();
  if (p.mode == 0) {
    Gemm(own, false, false, len, n, k, p.a + t.lo * k, k, p.b + t.g * k * n, n, false,
         p.out + t.lo * n, n, p.stream);
  } else if (p.mode == 1) {
    Gemm(own, false, true, len, k, n, p.a + t.lo * n, n, p.b + t.g * k * n, n, false,
         p.out + t.lo * k, k);
  } else {
    Gemm(own, true, false, len, n, rows, p.a + t.start * k + t.lo, k, p.b + t.start * n, n,
         false, p.out + (t.g * k + t.lo) * n, n, p.stream);
  }
  if (p.stream) StreamFence();
}

// The tasks of a product over every group g: its span(g) units (the group's rows, or drhs's K
// rows of its block, from 0) of unit_macs(g) multiply-adds each, cut into pieces of at most
// max(kTaskMacs, a quarter of one worker's share) and of at most 1 / (2 x workers) of the
// work not yet cut, so the last tasks are small and no worker waits long for another's last
// one (pieces of equal size left 2-5% of the workers' time idle at 8 groups of ~1024 rows,
// docs/grouped_matmul.md). A group's pieces are about equal, whole multiples of 8 units (but
// its last).
template <typename Span, typename UnitMacs>
std::vector<Task> CutTasks(const std::vector<int64_t>& bounds, bool from_group_start, Span span,
                           UnitMacs unit_macs) {
  const int64_t g_count = static_cast<int64_t>(bounds.size()) - 1;
  const int64_t workers = Threads();
  int64_t left = 0;
  for (int64_t g = 0; g < g_count; ++g) left += span(g) * unit_macs(g);
  const int64_t most = std::max(kTaskMacs, left / (4 * workers) + 1);
  std::vector<Task> tasks;
  for (int64_t g = 0; g < g_count; ++g) {
    const int64_t units = span(g), unit = std::max<int64_t>(unit_macs(g), 1);
    const int64_t base = from_group_start ? bounds[g] : 0;
    for (int64_t lo = 0; lo < units;) {
      const int64_t target = std::min(most, std::max(kTaskMacs, left / (2 * workers)));
      const int64_t pieces = ((units - lo) * unit + target - 1) / target;
      const int64_t step = std::min(units - lo, ((units - lo + pieces - 1) / pieces + 7) / 8 * 8);
      tasks.push_back({g, base + lo, base + lo + step, bounds[g], bounds[g + 1]});
      left -= step * unit;
      lo += step;
    }
  }
  return tasks;
}

std::vector<int64_t> GroupBounds(const ffi::Buffer<ffi::S32>& sizes, int64_t m) {
  const int64_t g_count = sizes.element_count();
  const int32_t* ps = sizes.typed_data();
  std::vector<int64_t> bounds(g_count + 1, 0);   // group g: rows [bounds[g], bounds[g + 1])
  for (int64_t g = 0; g < g_count; ++g) {
    bounds[g + 1] = std::min(bounds[g] + std::max<int64_t>(ps[g], 0), m);
  }
  return bounds;
}

// The operands task t reads, to prefetch while the task before it runs (`prev`: that task). A
// group's weights, or (drhs) its rows, are left out where the task before had the same group.
void SetPrefetch(const Problem& p, const Task& t, const Task& prev) {
  const int64_t k = p.k, n = p.n, rows = t.end - t.start, len = t.hi - t.lo;
  const bool same = t.g == prev.g;
  if (p.mode == 2) {
    // the task's rows of the output block too where they are not streamed (RunTask)
    const bool streamed = p.stream && p.kernels.Own();
    SetPrefetch({{p.a + t.start * k, same ? 0 : rows * k}, {p.b + t.start * n, same ? 0 : rows * n},
                 {p.out + (t.g * k + t.lo) * n, streamed ? 0 : len * n}});
  } else {
    const int64_t width = p.mode == 0 ? k : n;   // a's row width
    SetPrefetch({{p.b + t.g * k * n, same ? 0 : k * n}, {p.a + t.lo * width, len * width}});
  }
}

// Run fn(task) for every task on `Threads()` workers, each taking the next task in turn and
// prefetching the one after it (spans(next, task) sets what is prefetched).
template <typename Spans, typename Fn>
void RunParallel(const std::vector<Task>& tasks, Spans spans, Fn fn) {
  ForEachTaskAhead(tasks.size(), [&](size_t i, size_t next) {
    if (next < tasks.size()) {
      spans(tasks[next], tasks[i]);
    } else {
      SetPrefetch({});
    }
    fn(tasks[i]);
  });
}

ffi::Error GroupedGemm(ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b,
                       ffi::Buffer<ffi::S32> sizes, ffi::ResultBuffer<ffi::F32> out,
                       int32_t mode) {
  const auto ad = a.dimensions();
  const auto bd = b.dimensions();
  if (mode < 0 || mode > 2) {
    return ffi::Error::InvalidArgument("dropless_grouped_gemm: mode must be 0, 1 or 2");
  }
  if (ad.size() != 2 || bd.size() != (mode == 2 ? 2u : 3u)) {
    return ffi::Error::InvalidArgument("dropless_grouped_gemm: operand ranks do not match mode");
  }
  if (out->element_count() == 0) return ffi::Error::Success();
  AdviseHugePages(out->typed_data(), sizeof(float) * out->element_count());
  const Problem p{mode, ad[0], mode == 2 ? ad[1] : bd[1], mode == 2 ? bd[1] : bd[2],
                  a.typed_data(), b.typed_data(), out->typed_data(), KernelChoice::Now(),
                  mode != 1 && StreamsOutput(out->element_count())};
  const int64_t g_count = sizes.element_count();
  // out's row width (forward, dlhs) or one group's [K, N] block (drhs)
  const int64_t width = mode == 0 ? p.n : mode == 1 ? p.k : p.k * p.n;
  const int64_t inner = mode == 0 ? p.k : mode == 1 ? p.n : 1;   // 0: every product is zero

  const auto bounds = GroupBounds(sizes, p.m);
  if (mode != 2) {
    const int64_t done = inner == 0 ? 0 : bounds[g_count];
    std::memset(p.out + done * width, 0, sizeof(float) * (p.m - done) * width);
    if (inner == 0) return ffi::Error::Success();
  }
  auto rows = [&](int64_t g) { return bounds[g + 1] - bounds[g]; };
  std::vector<Task> tasks;
  if (mode == 2) {   // each group's [K, N] block in pieces of its K rows
    for (int64_t g = 0; g < g_count; ++g) {
      if (rows(g) == 0) std::memset(p.out + g * width, 0, sizeof(float) * width);
    }
    tasks = CutTasks(bounds, false, [&](int64_t g) { return rows(g) == 0 ? 0 : p.k; },
                     [&](int64_t g) { return rows(g) * p.n; });
  } else {
    tasks = CutTasks(bounds, true, rows, [&](int64_t) { return p.k * p.n; });
  }
  RunParallel(tasks, [&](const Task& t, const Task& prev) { SetPrefetch(p, t, prev); },
              [&](const Task& t) { RunTask(p, t); });
  return ffi::Error::Success();
}



// Run fn(group, lo, hi) over every group's rows, cut into tasks of about equal work (as the
// grouped GEMM cuts its forward), on `Threads()` workers; spans(group, lo, hi, same) sets what a
// worker prefetches for its next task while it runs the one before (same: of the same group).
template <typename Spans, typename Fn>
void ForRowTasks(const std::vector<int64_t>& bounds, int64_t macs_per_row, Spans spans, Fn fn) {
  const auto tasks = CutTasks(bounds, true, [&](int64_t g) { return bounds[g + 1] - bounds[g]; },
                              [&](int64_t) { return macs_per_row; });
  RunParallel(tasks,
              [&](const Task& t, const Task& prev) { spans(t.g, t.lo, t.hi, t.g == prev.g); },
              [&](const Task& t) { fn(t.g, t.lo, t.hi); });
}

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

// ---- The gate and up products in one tile ----
// g and u [MR, NV vectors] = A[MR, k] @ B1 and @ B2, sharing A's broadcasts (MR x 2 NV
// accumulators: the registers of one MR x 2NV tile); where `finish` (the contraction's last
// chunk), h = silu(g) * u is computed in registers, so no pass reads g and u back. Where
// `accumulate`, g and u hold the earlier chunks' sums. C(r, j) = c[r * ldc + j].
template <int MR, int NV>
void DualTile(int64_t k, const float* a, int64_t lda, const float* b1, const float* b2,
              int64_t ldb, float* g, float* u, float* h, int64_t ldc, bool accumulate,
              bool finish, bool stream) {
  Vec acc1[MR][NV], acc2[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc1[r][v] = acc2[r][v] = Vec{};
  const char* pf = g_prefetch.next;
  const char* const pf_end = g_prefetch.end;
  for (int64_t p = 0; p < k; ++p) {
    Vec bv1[NV], bv2[NV];
    for (int v = 0; v < NV; ++v) {
      bv1[v] = LoadVec(b1 + p * ldb + v * kVW);
      bv2[v] = LoadVec(b2 + p * ldb + v * kVW);
    }
    if (pf < pf_end) {
      __builtin_prefetch(pf, 0, 2);
      pf += 64;
    }
    for (int r = 0; r < MR; ++r) {
      const Vec av = a[r * lda + p] - Vec{};
      for (int v = 0; v < NV; ++v) {
        acc1[r][v] += av * bv1[v];
        acc2[r][v] += av * bv2[v];
      }
    }
  }
  g_prefetch.next = pf;
  if (pf >= pf_end) g_prefetch.Advance();
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) {
      const int64_t at = r * ldc + v * kVW;
      Vec gv = acc1[r][v], uv = acc2[r][v];
      if (accumulate) {
        gv += LoadVec(g + at);
        uv += LoadVec(u + at);
      }
      if (finish && stream) {
        StreamVec(g + at, gv);
        StreamVec(u + at, uv);
        StreamVec(h + at, gv * VecSigmoid(gv) * uv);
      } else {
        StoreVec(g + at, gv);
        StoreVec(u + at, uv);
        if (finish) StoreVec(h + at, gv * VecSigmoid(gv) * uv);
      }
    }
}

template <int MR, int NV>
void DualTileRows(int64_t m, int64_t k, const float* a, int64_t lda, const float* b1,
                  const float* b2, int64_t ldb, float* g, float* u, float* h, int64_t ldc,
                  bool accumulate, bool finish, bool stream) {
  int64_t r = 0;
  for (; r + MR <= m; r += MR) {
    DualTile<MR, NV>(k, a + r * lda, lda, b1, b2, ldb, g + r * ldc, u + r * ldc, h + r * ldc,
                     ldc, accumulate, finish, stream);
  }
  a += r * lda;
  const int64_t at = r * ldc;
  switch (m - r) {
#define DROPLESS_REST(x) \
    case x: if constexpr (x < MR) DualTile<x, NV>(k, a, lda, b1, b2, ldb, g + at, u + at, h + at, ldc, accumulate, finish, stream); break;
    DROPLESS_REST(1) DROPLESS_REST(2) DROPLESS_REST(3) DROPLESS_REST(4) DROPLESS_REST(5)
#undef DROPLESS_REST
    default: break;
  }
}

// g = a @ b1, u = a @ b2 and h = silu(g) * u, all [m, n] (ldc apart), a [m, k] (lda apart), b1
// and b2 [k, n] (ldb apart), on the tiled kernel. Columns past the last whole vector run two
// plain GEMMs and a scalar pass.
void OwnGateUp(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b1,
               const float* b2, int64_t ldb, float* g, float* u, float* h, int64_t ldc,
               bool stream) {
  constexpr int kDualNV = kNV / 2;   // g's and u's vectors: the registers of one kMR x kNV tile
  const int64_t whole = n / kVW * kVW, chunk = ChunkRows(2 * kDualNV * kVW);
  for (int64_t k0 = 0; k0 < k; k0 += chunk) {
    const int64_t kc = std::min(chunk, k - k0);
    const bool acc = k0 > 0, finish = k0 + kc >= k;
    const float* ak = a + k0;
    int64_t j = 0;
    for (; j + kDualNV * kVW <= whole; j += kDualNV * kVW) {
      DualTileRows<kMR, kDualNV>(m, kc, ak, lda, b1 + k0 * ldb + j, b2 + k0 * ldb + j, ldb,
                                 g + j, u + j, h + j, ldc, acc, finish, stream && finish);
    }
    for (; j < whole; j += kVW) {
      DualTileRows<kMR, 1>(m, kc, ak, lda, b1 + k0 * ldb + j, b2 + k0 * ldb + j, ldb, g + j,
                           u + j, h + j, ldc, acc, finish, stream && finish);
    }
  }
  if (whole < n) {
    OwnGemm<kMR, 1>(m, n - whole, k, a, lda, 1, b1 + whole, ldb, false, g + whole, ldc, 1, false);
    OwnGemm<kMR, 1>(m, n - whole, k, a, lda, 1, b2 + whole, ldb, false, u + whole, ldc, 1, false);
    for (int64_t r = 0; r < m; ++r)
      for (int64_t j = whole; j < n; ++j) {
        const int64_t at = r * ldc + j;
        h[at] = g[at] * Sigmoid(g[at]) * u[at];
      }
  }
}

void ZeroRows(float* p, int64_t from, int64_t to, int64_t width) {
  if (to > from) std::memset(p + from * width, 0, sizeof(float) * (to - from) * width);
}

// x [M, D], wg and wu [G, D, F] -> g, u, h [M, F]
ffi::Error GateUpSwiglu(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> wg,
                        ffi::Buffer<ffi::F32> wu, ffi::Buffer<ffi::S32> sizes,
                        ffi::ResultBuffer<ffi::F32> g_out, ffi::ResultBuffer<ffi::F32> u_out,
                        ffi::ResultBuffer<ffi::F32> h_out) {
  const int64_t m = x.dimensions()[0], d = x.dimensions()[1], f = wg.dimensions()[2];
  if (g_out->element_count() == 0) return ffi::Error::Success();
  float *pg = g_out->typed_data(), *pu = u_out->typed_data(), *ph = h_out->typed_data();
  for (float* p : {pg, pu, ph}) AdviseHugePages(p, sizeof(float) * m * f);
  const auto bounds = GroupBounds(sizes, m);
  const int64_t done = d == 0 ? 0 : bounds.back();
  for (float* p : {pg, pu, ph}) ZeroRows(p, done, m, f);
  if (d == 0) return ffi::Error::Success();
  const float *px = x.typed_data(), *pwg = wg.typed_data(), *pwu = wu.typed_data();
  const KernelChoice kernels = KernelChoice::Now();
  auto spans = [&](int64_t grp, int64_t lo, int64_t hi, bool same) {
    const int64_t w = same ? 0 : d * f;
    SetPrefetch({{pwg + grp * d * f, w}, {pwu + grp * d * f, w}, {px + lo * d, (hi - lo) * d}});
  };
  const bool stream = StreamsOutput(m * f);
  ForRowTasks(bounds, 2 * d * f, spans, [&](int64_t grp, int64_t lo, int64_t hi) {
    const bool own = kernels.Own();
    if (own) {
      CountGemms(true, 2);
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
  return ffi::Error::Success();
}

// dy [M, D], wd [G, F, D], g and u [M, F] -> dg, du [M, F]
ffi::Error SwigluDlhs(ffi::Buffer<ffi::F32> dy, ffi::Buffer<ffi::F32> wd,
                      ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> u,
                      ffi::Buffer<ffi::S32> sizes, ffi::ResultBuffer<ffi::F32> dg_out,
                      ffi::ResultBuffer<ffi::F32> du_out) {
  const int64_t m = dy.dimensions()[0], d = dy.dimensions()[1], f = wd.dimensions()[1];
  if (dg_out->element_count() == 0) return ffi::Error::Success();
  float *pdg = dg_out->typed_data(), *pdu = du_out->typed_data();
  for (float* p : {pdg, pdu}) AdviseHugePages(p, sizeof(float) * m * f);
  const auto bounds = GroupBounds(sizes, m);
  const int64_t done = d == 0 ? 0 : bounds.back();
  for (float* p : {pdg, pdu}) ZeroRows(p, done, m, f);
  if (d == 0) return ffi::Error::Success();
  const float *pdy = dy.typed_data(), *pwd = wd.typed_data();
  const float *pg = g.typed_data(), *pu = u.typed_data();
  const KernelChoice kernels = KernelChoice::Now();
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
    const bool own = kernels.Own();
    Gemm(own, false, true, hi - lo, f, d, pdy + lo * d, d, pwd + grp * f * d, d, false,
         pdg + lo * f, f);
    finish(lo, hi);
  });
  return ffi::Error::Success();
}

// a1, a2 [M, F], w1, w2 [G, D, F] -> a1 @ w1[g]^T + a2 @ w2[g]^T  [M, D]
ffi::Error DualDlhs(ffi::Buffer<ffi::F32> a1, ffi::Buffer<ffi::F32> w1,
                    ffi::Buffer<ffi::F32> a2, ffi::Buffer<ffi::F32> w2,
                    ffi::Buffer<ffi::S32> sizes, ffi::ResultBuffer<ffi::F32> out) {
  const int64_t m = a1.dimensions()[0], f = a1.dimensions()[1], d = w1.dimensions()[1];
  if (out->element_count() == 0) return ffi::Error::Success();
  float* po = out->typed_data();
  AdviseHugePages(po, sizeof(float) * m * d);
  const auto bounds = GroupBounds(sizes, m);
  const int64_t done = f == 0 ? 0 : bounds.back();
  ZeroRows(po, done, m, d);
  if (f == 0) return ffi::Error::Success();
  const float *p1 = a1.typed_data(), *pw1 = w1.typed_data();
  const float *p2 = a2.typed_data(), *pw2 = w2.typed_data();
  const KernelChoice kernels = KernelChoice::Now();
  auto spans = [&](int64_t grp, int64_t lo, int64_t hi, bool same) {
    const int64_t w = same ? 0 : d * f;
    SetPrefetch({{pw1 + grp * d * f, w}, {pw2 + grp * d * f, w}, {p1 + lo * f, (hi - lo) * f},
                 {p2 + lo * f, (hi - lo) * f}});
  };
  ForRowTasks(bounds, 2 * d * f, spans, [&](int64_t grp, int64_t lo, int64_t hi) {
    const bool own = kernels.Own();
    if (own) {   // both products of a chunk of rows while it is in cache
      CountGemms(true, 2);
      OwnGemmNT(hi - lo, d, f, p1 + lo * f, f, pw1 + grp * d * f, f, po + lo * d, d, false,
                p2 + lo * f, pw2 + grp * d * f);
      return;
    }
    Gemm(own, false, true, hi - lo, d, f, p1 + lo * f, f, pw1 + grp * d * f, f, false,
         po + lo * d, d);
    Gemm(own, false, true, hi - lo, d, f, p2 + lo * f, f, pw2 + grp * d * f, f, true,
         po + lo * d, d);
  });
  return ffi::Error::Success();
}

}  // namespace

// the kernel choice (0 neither forced, 1 the tiled kernel, 2 OpenBLAS), and GEMMs run so far by
// OpenBLAS (own = 0) or by the tiled kernel (own = 1)
extern "C" void dropless_set_kernel(int choice) { g_kernel.store(choice); }
extern "C" int dropless_kernel() { return g_kernel.load(); }
extern "C" int64_t dropless_gemm_calls(int own) { return g_gemm_calls[own ? 1 : 0].load(); }

// floats a vector of the tiled kernel (16: an AVX-512 build, where `KernelChoice` may pick it)
extern "C" int dropless_vector_floats() { return kVW; }
// the size above which the grouped GEMM's forward and drhs outputs are streamed (-1: never)
extern "C" int64_t dropless_stream_min_bytes() { return StreamMinBytes(); }
// the tiled kernel's contraction chunk (`ChunkRows`): of the forward's and drhs's tiles
// (`panel` 0), the NT form's (1, its 2-vector pass) and the fused gate and up tiles (2)
extern "C" int64_t dropless_chunk_rows(int panel) {
  return ChunkRows(panel == 0 ? kNV * kVW : panel == 1 ? kNtNV * kVW : 2 * (kNV / 2) * kVW);
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(DroplessGroupedGemmF32, GroupedGemm,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("mode"));

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
