// A CPU grouped GEMM for XLA's FFI on bfloat16 operands, on Intel's AMX tiles: TDPBF16PS adds a
// 16 x 32 bf16 tile times a 32 x 16 one into a 16 x 16 float32 tile, so every product
// accumulates in float32 and is rounded once to the bf16 output, to nearest even. The same
// three products, group rules and zero rules as the float32 handler (grouped_gemm.cc):
//   0  forward  out[M, N]    rows of g:  a[M, K] @ b[g]             (b = rhs [G, K, N])
//   1  dlhs     out[M, K]    rows of g:  a[M, N] @ b[g]^T           (a = dy, b = rhs [G, K, N])
//   2  drhs     out[G, K, N] group g:    a[rows, K]^T @ b[rows, N]  (a = lhs, b = dy)
// Built where the compiler targets AMX-BF16 with AVX-512 (-march=native on Sapphire Rapids and
// later); it runs once the kernel grants the process the tile state (arch_prctl), and
// `dropless_amx_ready` says whether it does. As the hardware defines them, TDPBF16PS and the
// float32 -> bf16 conversion treat denormal inputs as zero.
//
// Legend: M rows (sorted by group), K contraction dim, N output dim, G groups, R a group's rows;
// Kp a contraction padded to a multiple of 32.
//
// What the tiles read (each tile row is 64 bytes):
//   A  16 rows of 32 contraction values, `lda` bytes apart: the operand's rows in place where a
//      block has 32 whole rows and the contraction is a multiple of 32, else a zero-padded
//      copy; for drhs the rows are lhs's columns, gathered from `Pairs` below.
//   B  panels of 16 output columns, [Kp / 2][16][2] with (p, c, e) = B[2p + e][column c] (the
//      pairs TDPBF16PS multiplies), zero past the contraction; each panel contiguous.
// A block of C is 32 x 32 in four tiles (tmm0-3) from two A tiles (tmm4-5) and two B tiles
// (tmm6-7); a block of up to 16 rows, or the last 16 columns, uses only the tiles it needs.
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "tasks.h"
#include "threads.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    defined(__AVX512BW__)
#define DROPLESS_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace ffi = xla::ffi;

namespace {

using dropless_native::CutTasks;
using dropless_native::GroupBounds;
using dropless_native::RunParallel;
using dropless_native::Task;

constexpr int64_t Pad32(int64_t x) { return (x + 31) / 32 * 32; }
constexpr int64_t Panels(int64_t n) { return (n + 15) / 16; }

#if DROPLESS_AMX

bool AmxGranted() {
  // ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA: once a process, for all its threads
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// every tile 16 rows of 64 bytes, on the calling thread
void ConfigureTiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

// ---- Packing ----
// B's panels from rows [0, k) and columns [0, n) of a row-major operand (ld apart), rows 2p and
// 2p + 1 interleaved, read row by row (each pair of rows once, in order); `panel` values apart
// in dst (0: Pad32(k) * 16, the panels of these rows alone), so a range of rows starting at a
// multiple of 32 can be packed into its place among a longer contraction's panels
void PackPanelsKN(const uint16_t* src, int64_t ld, int64_t k, int64_t n, uint16_t* dst,
                  int64_t panel = 0) {
  const int64_t kp = Pad32(k), panels = Panels(n);
  if (panel == 0) panel = kp * 16;
  for (int64_t p = 0; p < kp / 2; ++p) {
    const int64_t r = 2 * p;
    for (int64_t j = 0; j < panels; ++j) {
      const __mmask16 mask =
          static_cast<__mmask16>((1u << std::min<int64_t>(16, n - 16 * j)) - 1);
      const __m256i lo = r < k ? _mm256_maskz_loadu_epi16(mask, src + r * ld + 16 * j)
                               : _mm256_setzero_si256();
      const __m256i hi = r + 1 < k ? _mm256_maskz_loadu_epi16(mask, src + (r + 1) * ld + 16 * j)
                                   : _mm256_setzero_si256();
      const __m512i pairs = _mm512_or_si512(_mm512_cvtepu16_epi32(lo),
                                            _mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
      _mm512_storeu_si512(dst + j * panel + p * 32, pairs);
    }
  }
}

// B's panels of w^T for w row-major [n, k] (ld apart; dlhs: the output's columns are w's rows,
// the contraction its columns): panel j, pair p holds w[16j + c][2p], w[16j + c][2p + 1]
void PackPanelsNK(const uint16_t* w, int64_t ld, int64_t n, int64_t k, uint16_t* dst) {
  const int64_t kp = Pad32(k), panels = Panels(n);
  const bool even = k % 2 == 0 && ld % 2 == 0;
  const __m512i rows = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(static_cast<int>(ld / 2)));
  for (int64_t j = 0; j < panels; ++j) {
    const int64_t cols = std::min<int64_t>(16, n - 16 * j);
    const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
    uint16_t* panel = dst + j * kp * 16;
    const uint16_t* base = w + 16 * j * ld;
    for (int64_t p = 0; p < kp / 2; ++p) {
      uint16_t* out = panel + p * 32;
      if (even && 2 * p < k) {
        _mm512_storeu_si512(out, _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask, rows,
                                                              base + 2 * p, 4));
      } else {
        for (int64_t c = 0; c < 16; ++c) {
          const bool in = c < cols;
          out[2 * c] = in && 2 * p < k ? base[c * ld + 2 * p] : 0;
          out[2 * c + 1] = in && 2 * p + 1 < k ? base[c * ld + 2 * p + 1] : 0;
        }
      }
    }
  }
}

// rows [0, rows) x columns [c0, c0 + kc) of a row-major operand with `width` columns (ld apart)
// as a zero-padded [32, kc] block
void PackRows(const uint16_t* src, int64_t ld, int64_t rows, int64_t width, int64_t c0,
              int64_t kc, uint16_t* dst) {
  const int64_t cols = std::max<int64_t>(0, std::min(kc, width - c0));
  for (int64_t r = 0; r < 32; ++r) {
    const int64_t copied = r < rows ? cols : 0;
    if (copied) std::memcpy(dst + r * kc, src + r * ld + c0, sizeof(uint16_t) * copied);
    std::memset(dst + r * kc + copied, 0, sizeof(uint16_t) * (kc - copied));
  }
}

// drhs's A: columns [k0, k0 + 32) of the task's lhs columns (`pairs`: them packed as panels
// over the group's Rp rows, PackPanelsKN's layout) as rows, over contraction values [c0, c0 + kc)
// -> [32, kc]; columns at or past k are zeros
void GatherColumns(const uint16_t* pairs, int64_t rp, int64_t k0, int64_t k, int64_t c0,
                   int64_t kc, uint16_t* dst) {
  const __m512i idx = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(16));
  for (int64_t c = 0; c < 32; ++c) {
    uint16_t* row = dst + c * kc;
    if (k0 + c >= k) {
      std::memset(row, 0, sizeof(uint16_t) * kc);
      continue;
    }
    const uint16_t* col = pairs + ((k0 + c) / 16) * rp * 16 + ((k0 + c) % 16) * 2;
    for (int64_t p = c0 / 2; p < (c0 + kc) / 2; p += 16) {   // 32 contraction values a step
      _mm512_storeu_si512(row + 2 * p - c0, _mm512_i32gather_epi32(idx, col + p * 32, 4));
    }
  }
}

// ---- One block of C ----
// c[rows, cols] (rows <= 32, cols <= 32) (+)= A (two tiles' rows, lda bytes apart) @ the
// panels' rows at b0 and b1 (b1 unused when cols <= 16), over kc contraction values. `acc`
// ([32, 32] float32) carries a partial sum between contraction chunks: read where `first` is
// false, written where `last` is false; where `last`, c is written to out (ldo apart) as bf16,
// rounded to nearest even.
void Block(const char* a, int64_t lda, int64_t rows, const uint16_t* b0, const uint16_t* b1,
           int64_t cols, int64_t kc, bool first, bool last, float* acc, uint16_t* out,
           int64_t ldo) {
  const bool two_rows = rows > 16, two_cols = cols > 16;
  if (first) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  } else {
    _tile_loadd(0, acc, 128);
    _tile_loadd(1, acc + 16, 128);
    _tile_loadd(2, acc + 512, 128);
    _tile_loadd(3, acc + 528, 128);
  }
  for (int64_t s = 0; s < kc / 32; ++s) {
    _tile_loadd(4, a + s * 64, lda);
    _tile_loadd(6, b0 + s * 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (two_cols) {
      _tile_loadd(7, b1 + s * 512, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (two_rows) {
      _tile_loadd(5, a + 16 * lda + s * 64, lda);
      _tile_dpbf16ps(2, 5, 6);
      if (two_cols) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, acc, 128);
  _tile_stored(1, acc + 16, 128);
  _tile_stored(2, acc + 512, 128);
  _tile_stored(3, acc + 528, 128);
  if (!last) return;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t h = 0; h < cols; h += 16) {
      const __mmask16 mask = static_cast<__mmask16>((1u << std::min<int64_t>(16, cols - h)) - 1);
      const __m512 v = _mm512_loadu_ps(acc + r * 32 + h);
      _mm256_mask_storeu_epi16(out + r * ldo + h, mask, (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

// ---- A worker's buffers, kept between tasks and calls ----
// `panels` holds the B panels of one group of one call (`call`, `group`), so the tasks a worker
// runs on one group pack its B once, into memory that is already mapped and in cache.
struct Buffers {
  int64_t call = -1, group = -1;
  std::vector<uint16_t> panels, pairs, block;
  std::vector<float> acc;
};

class BufferPool {
 public:
  static constexpr size_t kKeepBytes = size_t{64} << 20;

  std::unique_ptr<Buffers> Take() {
    std::lock_guard<std::mutex> lock(mu_);
    if (free_.empty()) return std::make_unique<Buffers>();
    auto b = std::move(free_.back());
    free_.pop_back();
    return b;
  }
  // a buffer set past kKeepBytes (a weight gradient over one group of many thousand rows) is
  // freed rather than kept for the next call
  void Give(std::unique_ptr<Buffers> b) {
    const size_t bytes = sizeof(uint16_t) * (b->panels.capacity() + b->pairs.capacity() +
                                             b->block.capacity()) +
                         sizeof(float) * b->acc.capacity();
    if (bytes > kKeepBytes) return;
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(std::move(b));
  }

 private:
  std::mutex mu_;
  std::vector<std::unique_ptr<Buffers>> free_;
};

BufferPool g_pool;
std::atomic<int64_t> g_calls{0};

template <typename T>
T* Sized(std::vector<T>& v, int64_t count) {
  if (static_cast<int64_t>(v.size()) < count) v.resize(count);
  return v.data();
}

// The contraction's chunk: 512 values. A block's 32 rows of A and its pair of B panels are
// 32 KiB each at 512 values (L1 is 48 KiB on Sapphire Rapids); 256-value chunks fit L1 together
// but carry twice the partial sums through memory, and ran no faster on the Xeon
constexpr int64_t kChunk = 512;

// rows [0, rows) of C (out, ldo apart) = A @ B over kp contraction values: a_block(r0, c0, kc)
// gives the A rows from r0 (up to 32) over contraction values [c0, c0 + kc) as (pointer, bytes
// between rows); B is `panels` (n columns). Each 32-row block runs the contraction in chunks
// (`kChunk`), each chunk against every pair of panels, its partial sums carried in `buf.acc`.
template <typename ABlock>
void RowsTimesPanels(int64_t rows, int64_t kp, const uint16_t* panels, int64_t n,
                     ABlock a_block, Buffers& buf, uint16_t* out, int64_t ldo) {
  const int64_t n_blocks = (n + 31) / 32;
  const bool chunked = kp > kChunk;
  float* acc = Sized(buf.acc, chunked ? n_blocks * 1024 : 1024);
  for (int64_t r0 = 0; r0 < rows; r0 += 32) {
    for (int64_t c0 = 0; c0 < kp; c0 += kChunk) {
      const int64_t kc = std::min(kChunk, kp - c0);
      const auto [a, lda] = a_block(r0, c0, kc);
      for (int64_t j = 0; j < n_blocks; ++j) {
        const uint16_t* b0 = panels + 2 * j * kp * 16 + c0 * 16;
        Block(a, lda, std::min<int64_t>(32, rows - r0), b0, b0 + kp * 16,
              std::min<int64_t>(32, n - 32 * j), kc, c0 == 0, c0 + kc >= kp,
              chunked ? acc + j * 1024 : acc, out + r0 * ldo + 32 * j, ldo);
      }
    }
  }
}

// ---- The three products ----
void RunAmxGemm(int32_t mode, const uint16_t* a, const uint16_t* b, const int32_t* sizes,
                int64_t g_count, int64_t m, int64_t k, int64_t n, uint16_t* out) {
  const auto bounds = GroupBounds(sizes, g_count, m);
  const int64_t call = g_calls++;
  dropless_native::AdviseHugePages(out, sizeof(uint16_t) * (mode == 2 ? g_count * k * n
                                                            : m * (mode == 0 ? n : k)));
  auto rows = [&](int64_t g) { return bounds[g + 1] - bounds[g]; };
  if (mode != 2) {
    // out[M, n_out] = a[M, inner] @ B[g]: forward B = b[g] [K, N]; dlhs B = b[g]^T [N, K]
    const int64_t inner = mode == 0 ? k : n, n_out = mode == 0 ? n : k;
    const int64_t done = inner == 0 ? 0 : bounds[g_count];
    std::memset(out + done * n_out, 0, sizeof(uint16_t) * (m - done) * n_out);
    if (inner == 0 || n_out == 0) return;
    const int64_t kp = Pad32(inner), panel_size = kp * 16 * Panels(n_out);
    const auto tasks = CutTasks(bounds, true, rows, [&](int64_t) { return inner * n_out; }, 32);
    RunParallel(tasks, [](const Task&, const Task&) {}, [&](const Task& t) {
      auto buf = g_pool.Take();
      uint16_t* panels = Sized(buf->panels, panel_size);
      if (buf->call != call || buf->group != t.g) {
        if (mode == 0) {
          PackPanelsKN(b + t.g * k * n, n, k, n, panels);
        } else {
          PackPanelsNK(b + t.g * k * n, n, k, n, panels);
        }
        buf->call = call;
        buf->group = t.g;
      }
      uint16_t* block = Sized(buf->block, 32 * kChunk);
      const uint16_t* rows_a = a + t.lo * inner;
      const int64_t len = t.hi - t.lo;
      auto a_block = [&](int64_t r0, int64_t c0, int64_t kc) -> std::pair<const char*, int64_t> {
        if (inner % 32 == 0 && r0 + 32 <= len) {
          return {reinterpret_cast<const char*>(rows_a + r0 * inner + c0), inner * 2};
        }
        PackRows(rows_a + r0 * inner, inner, std::min<int64_t>(32, len - r0), inner, c0, kc,
                 block);
        return {reinterpret_cast<const char*>(block), kc * 2};
      };
      ConfigureTiles();
      RowsTimesPanels(len, kp, panels, n_out, a_block, *buf, out + t.lo * n_out, n_out);
      _tile_release();
      g_pool.Give(std::move(buf));
    });
    return;
  }
  // drhs: out[g] [K, N] = lhs[rows of g]^T @ dy[rows of g]; the contraction is the group's rows
  for (int64_t g = 0; g < g_count; ++g) {
    if (rows(g) == 0 || k == 0 || n == 0) {
      std::memset(out + g * k * n, 0, sizeof(uint16_t) * k * n);
    }
  }
  if (k == 0 || n == 0) return;
  // dy's rows as B's panels, every group's once for all workers (so the memory this takes is one
  // copy of dy, whatever the workers), packed in pieces of kPackRows rows in parallel
  constexpr int64_t kPackRows = 256;
  std::vector<int64_t> offset(g_count + 1, 0);
  for (int64_t g = 0; g < g_count; ++g) offset[g + 1] = offset[g] + Pad32(rows(g)) * 16 * Panels(n);
  auto shared = g_pool.Take();
  uint16_t* dy_panels = Sized(shared->panels, offset[g_count]);
  shared->call = -1;   // (no group's weights any more)
  std::vector<std::pair<int64_t, int64_t>> pieces;   // (group, first row)
  for (int64_t g = 0; g < g_count; ++g) {
    for (int64_t r0 = 0; r0 < rows(g); r0 += kPackRows) pieces.emplace_back(g, r0);
  }
  dropless_native::ForEachTask(pieces.size(), [&](size_t i) {
    const auto [g, r0] = pieces[i];
    PackPanelsKN(b + (bounds[g] + r0) * n, n, std::min(kPackRows, rows(g) - r0), n,
                 dy_panels + offset[g] + r0 * 16, Pad32(rows(g)) * 16);
  });
  const auto tasks = CutTasks(bounds, false, [&](int64_t g) { return rows(g) == 0 ? 0 : k; },
                              [&](int64_t g) { return rows(g) * n; }, 32);
  RunParallel(tasks, [](const Task&, const Task&) {}, [&](const Task& t) {
    auto buf = g_pool.Take();
    buf->call = -1;
    const int64_t r = t.end - t.start, rp = Pad32(r), len = t.hi - t.lo;
    uint16_t* pairs = Sized(buf->pairs, rp * 16 * Panels(len));
    PackPanelsKN(a + t.start * k + t.lo, k, r, len, pairs);
    ConfigureTiles();
    uint16_t* block = Sized(buf->block, 32 * kChunk);
    auto a_block = [&](int64_t r0, int64_t c0, int64_t kc) -> std::pair<const char*, int64_t> {
      GatherColumns(pairs, rp, r0, len, c0, kc, block);
      return {reinterpret_cast<const char*>(block), kc * 2};
    };
    RowsTimesPanels(len, rp, dy_panels + offset[t.g], n, a_block, *buf,
                    out + (t.g * k + t.lo) * n, n);
    _tile_release();
    g_pool.Give(std::move(buf));
  });
  g_pool.Give(std::move(shared));
}

#endif  // DROPLESS_AMX

ffi::Error AmxGroupedGemm(ffi::Buffer<ffi::BF16> a, ffi::Buffer<ffi::BF16> b,
                          ffi::Buffer<ffi::S32> sizes, ffi::ResultBuffer<ffi::BF16> out,
                          int32_t mode) {
#if DROPLESS_AMX
  if (!AmxGranted()) {
    return ffi::Error::Internal("dropless_grouped_gemm_bf16: the OS refused the AMX tile state");
  }
  const auto ad = a.dimensions();
  const auto bd = b.dimensions();
  if (mode < 0 || mode > 2) {
    return ffi::Error::InvalidArgument("dropless_grouped_gemm_bf16: mode must be 0, 1 or 2");
  }
  if (ad.size() != 2 || bd.size() != (mode == 2 ? 2u : 3u)) {
    return ffi::Error::InvalidArgument(
        "dropless_grouped_gemm_bf16: operand ranks do not match mode");
  }
  RunAmxGemm(mode, a.typed_data(), b.typed_data(), sizes.typed_data(),
                       sizes.element_count(), ad[0], mode == 2 ? ad[1] : bd[1],
                       mode == 2 ? bd[1] : bd[2], out->typed_data());
  return ffi::Error::Success();
#else
  return ffi::Error::Internal("dropless_grouped_gemm_bf16: this build has no AMX kernel");
#endif
}

}  // namespace

// 1 where the bf16 kernel runs here: built for AMX-BF16 and granted the tile state
extern "C" int dropless_amx_ready() {
#if DROPLESS_AMX
  return AmxGranted() ? 1 : 0;
#else
  return 0;
#endif
}

// the bf16 grouped GEMM on raw operands (bf16 as uint16 bits), for timing it without XLA; a
// no-op where dropless_amx_ready is 0
extern "C" void dropless_run_grouped_gemm_bf16(int32_t mode, const uint16_t* a,
                                               const uint16_t* b, const int32_t* sizes,
                                               int64_t g_count, int64_t m, int64_t k, int64_t n,
                                               uint16_t* out) {
#if DROPLESS_AMX
  if (mode >= 0 && mode <= 2 && AmxGranted()) {
    RunAmxGemm(mode, a, b, sizes, g_count, m, k, n, out);
  }
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(DroplessGroupedGemmBf16, AmxGroupedGemm,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>()
                                  .Attr<int32_t>("mode"));
