// The register-tiled kernel and the choice between it and OpenBLAS's sgemm for one group's
// product (kernel.h says what each entry point computes). The kernel reads A in place (but the NT
// form's small copy of a^T and the TN form's transpose of a) and B's panels copied side by side
// (`PacksB`; the NT form's packed a^T is read as it is), keeps an
// MR x NV-vector tile of C in registers, and prefetches the worker's next task's operands
// while it runs the contraction.
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <vector>

#include "kernel.h"
#include "vec.h"

extern "C" {
// OpenBLAS's CBLAS as the scipy-openblas32 wheel exports it (symbols prefixed `scipy_`).
enum CBLAS_ORDER { CblasRowMajor = 101, CblasColMajor = 102 };
enum CBLAS_TRANSPOSE { CblasNoTrans = 111, CblasTrans = 112 };
void scipy_cblas_sgemm(CBLAS_ORDER order, CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int m, int n,
                       int k, float alpha, const float* a, int lda, const float* b, int ldb,
                       float beta, float* c, int ldc);
}

namespace dropless_native {
namespace {

// ---- MKL's sgemm, where the `mkl` wheel is installed (kernel.h: Kernel) ----
// The same CBLAS signature as OpenBLAS's; opened by `dropless_use_mkl` (load.py passes the
// wheel's libmkl_rt) with MKL's sequential threading layer: the handlers cut the work into
// tasks themselves, one GEMM a worker, as they do for OpenBLAS.
using SgemmFn = void (*)(CBLAS_ORDER, CBLAS_TRANSPOSE, CBLAS_TRANSPOSE, int, int, int, float,
                         const float*, int, const float*, int, float, float*, int);
std::atomic<SgemmFn> g_mkl_sgemm{nullptr};
constexpr int kMklThreadingSequential = 1;   // MKL_THREADING_SEQUENTIAL (mkl_service.h)

// ---- The prefetch queue (kernel.h: SetPrefetch) ----
inline int64_t PrefetchBytes() { return L2Bytes() / 4 * 3; }
constexpr int kMaxSpans = 4;

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

// ---- B's panels copied side by side ----
// Read in place, a row of a B panel is `ldb` floats from the next: at ldb = 1024 (4 KiB) every
// row starts a new page and falls in the same L1 sets, so the L1's stride prefetcher (which stays
// within a page) does not fetch them and the panel is read from L2 at its latency. Copied to
// [rows, panel] side by side, the panel is one sequential stream. `PacksB` says where it is
// copied (kernel.h: the setting kPackB, by default wherever the rows are apart and A has more
// than one tile of rows to reuse it).
bool PacksB(bool b_padded, int64_t ldb, int64_t width, int64_t m, int64_t mr) {
  if (b_padded || ldb == width || m <= mr) return false;
  return Setting(kPackB) != 2;
}

// panels [p0, p1) of b (each `width` floats of its `rows` rows) into this worker's buffer,
// panel after panel, each [rows, width]
const float* PackPanels(const float* b, int64_t ldb, int64_t rows, int64_t p0, int64_t p1,
                        int64_t width) {
  thread_local std::vector<float> buf;
  buf.resize((p1 - p0) * rows * width);
  float* out = buf.data();
  for (int64_t pnl = p0; pnl < p1; ++pnl)
    for (int64_t q = 0; q < rows; ++q, out += width)
      std::memcpy(out, b + q * ldb + pnl * width, sizeof(float) * width);
  return buf.data();
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
    const bool fits = int64_t{sizeof(float)} * kc * whole <= L2Bytes() / 2;
    if (PacksB(b_padded, ldb, NV * kVW, m, MR)) {
      // whole panels copied to [kc, panel] rows side by side (PackPanels), read from there
      constexpr int64_t kW = NV * kVW;
      const int64_t panels = n / kW;
      auto run = [&](int64_t p0, int64_t p1, int64_t r0, int64_t rows, const float* packed,
                     bool lone) {
        for (int64_t pnl = p0; pnl < p1; ++pnl) {
          TileRows<MR, NV>(rows, kc, ak + r0 * sar, sar, sac, packed + (pnl - p0) * kc * kW, kW,
                           c + r0 * scr + pnl * kW * scc, scr, scc, static_cast<int>(kW), acc,
                           stream);
        }
        for (int64_t j = panels * kW; lone && j < whole; j += kVW) {
          TileRows<MR, 1>(rows, kc, ak + r0 * sar, sar, sac, bk + j, ldb, c + r0 * scr + j * scc,
                          scr, scc, static_cast<int>(std::min<int64_t>(kVW, n - j)), acc, stream);
        }
      };
      if (fits) {
        const float* packed = PackPanels(bk, ldb, kc, 0, panels, kW);
        for (int64_t r0 = 0; r0 < m; r0 += MR)
          run(0, panels, r0, std::min<int64_t>(MR, m - r0), packed, true);
      } else {
        for (int64_t pnl = 0; pnl < panels; ++pnl) {
          const float* packed = PackPanels(bk, ldb, kc, pnl, pnl + 1, kW);
          run(pnl, pnl + 1, 0, m, packed, false);
        }
        run(panels, panels, 0, m, nullptr, true);   // the lone vectors
      }
    } else if (fits) {
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
// cache line.
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

}  // namespace

bool MklReady() { return g_mkl_sgemm.load(std::memory_order_relaxed) != nullptr; }

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

void OwnGemmNT(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
               int64_t ldb, float* c, int64_t ldc, bool accumulate, const float* a2,
               const float* b2) {
  for (int64_t i0 = 0; i0 < m; i0 += kNtRows) {
    const int64_t rows = std::min(kNtRows, m - i0);
    NtChunk(rows, n, k, a + i0 * lda, lda, b, ldb, c + i0 * ldc, ldc, accumulate);
    if (a2 != nullptr) NtChunk(rows, n, k, a2 + i0 * lda, lda, b2, ldb, c + i0 * ldc, ldc, true);
  }
}

namespace {

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

// The TN form (drhs: a^T @ b, the contraction over a group's rows) transposes a where it has at
// least this many rows, so that a tile's broadcasts read A's rows in order (read in place, each
// step's values are in another row of a, `lda` floats on). Below it, as at 32-row groups, the
// copy costs more than it saves.
constexpr int64_t kTransposeRows = 128;
// floats of a^T a worker transposes at a time (4 MiB: 1024 of K's rows of a 1024-row group; a
// 4096-row group at K = 7168 would otherwise keep 117 MB in each worker)
constexpr int64_t kTransposeFloats = int64_t{1} << 20;

}  // namespace

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
    constexpr int64_t kW = kDualNV * kVW;
    const bool pack = PacksB(false, ldb, kW, m, kMR);
    for (; j + kW <= whole; j += kW) {
      const float *p1 = b1 + k0 * ldb + j, *p2 = b2 + k0 * ldb + j;
      int64_t step = ldb;
      if (pack) {   // the two panels' rows side by side: [kc, 2 kW], b1's first
        thread_local std::vector<float> both;
        both.resize(kc * 2 * kW);
        for (int64_t q = 0; q < kc; ++q) {
          std::memcpy(&both[q * 2 * kW], p1 + q * ldb, sizeof(float) * kW);
          std::memcpy(&both[q * 2 * kW + kW], p2 + q * ldb, sizeof(float) * kW);
        }
        p1 = both.data();
        p2 = both.data() + kW;
        step = 2 * kW;
      }
      DualTileRows<kMR, kDualNV>(m, kc, ak, lda, p1, p2, step, g + j, u + j, h + j, ldc, acc,
                                 finish, stream && finish);
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

void Gemm(Kernel kernel, bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a,
          int64_t lda, const float* b, int64_t ldb, bool accumulate, float* c, int64_t ldc,
          bool stream) {
  if (kernel == kMkl && !MklReady()) kernel = kOpenBlas;
  CountGemms(kernel, 1);
  const CBLAS_TRANSPOSE ops[2] = {CblasNoTrans, CblasTrans};
  if (kernel == kOpenBlas) {
    scipy_cblas_sgemm(CblasRowMajor, ops[ta], ops[tb], m, n, k, 1.0f, a, lda, b, ldb,
                      accumulate ? 1.0f : 0.0f, c, ldc);
  } else if (kernel == kMkl) {
    g_mkl_sgemm.load(std::memory_order_relaxed)(CblasRowMajor, ops[ta], ops[tb], m, n, k, 1.0f,
                                               a, lda, b, ldb, accumulate ? 1.0f : 0.0f, c, ldc);
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

}  // namespace dropless_native

// Opens MKL's runtime library at `path` (the `mkl` wheel's libmkl_rt) for the MKL kernel: its
// sequential threading layer set before any other call, its cblas_sgemm kept. Returns 1, or 0
// (nothing changed) where the library or a symbol is missing.
extern "C" int dropless_use_mkl(const char* path) {
  void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) return 0;
  auto set_layer = reinterpret_cast<int (*)(int)>(dlsym(lib, "MKL_Set_Threading_Layer"));
  auto sgemm = reinterpret_cast<dropless_native::SgemmFn>(dlsym(lib, "cblas_sgemm"));
  if (set_layer == nullptr || sgemm == nullptr) return 0;
  set_layer(dropless_native::kMklThreadingSequential);
  dropless_native::g_mkl_sgemm.store(sgemm);
  return 1;
}
