// One group's product, as the handlers ask for it (kernel.cc): OpenBLAS's sgemm or the library's
// register-tiled kernel, the rule that picks one (`KernelChoice`), the tiled kernel's tile shapes
// and contraction chunk, the counts of GEMMs each kernel ran, and the operands the kernel
// prefetches for a worker's next task.
#ifndef DROPLESS_NATIVE_KERNEL_H_
#define DROPLESS_NATIVE_KERNEL_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <initializer_list>

#include "vec.h"

namespace dropless_native {

// ---- The machine-dependent choices, as calibrated (native/calibrate.py) ----
// Each is 0 (the build's rule) or a value set through dropless_set_setting (choice.cc) when the
// library loads, from the calibration cached for this CPU and build, and read at each call:
//   kKernelNN, kKernelNT, kKernelTN, kKernelGateUp  which kernel runs the forward's (and the
//       fused down's) products, the NT form's (dlhs, the fused backward's), the TN form's (drhs)
//       and the fused gate and up tile: a `Kernel` code (g_kernel overrides)
//   kPackB     1 the tiled kernel copies B's panels side by side (kernel.cc: PacksB), 2 not
//   kStream    1 outputs above StreamMinBytes are streamed, 2 never
//   kChunkBytes  the bytes of B a contraction chunk may fill (`ChunkRows`; 0: half the L2); not
//       calibrated (the layer's contractions fit one chunk either way): the tests set it small
//       to reach past a chunk without gigabyte operands
enum SettingId { kKernelNN = 0, kKernelNT, kKernelTN, kKernelGateUp, kPackB, kStream,
                 kChunkBytes, kSettingCount };
inline std::atomic<int> g_settings[kSettingCount] = {};
inline int Setting(SettingId id) { return g_settings[id].load(std::memory_order_relaxed); }

// whether an output of `floats` is streamed: above StreamMinBytes, unless calibrated off
inline bool Streams(int64_t floats) { return StreamsOutput(floats) && Setting(kStream) != 2; }

// ---- The register-tiled kernel's shapes ----
// Each product is cut into tiles of MR rows x NV vectors of C held in registers; the loop over
// the contraction broadcasts MR values of A and loads NV vectors of one row of B (its panel
// copied side by side first where kPackB has it, else read in place), in chunks (`ChunkRows`) so
// a B panel stays in L2. The NT form (c = a @ b^T)
// computes c^T = b @ a^T, with a^T packed kNtRows rows at a time (a small copy that stays in
// cache; its rows padded to whole vectors, all computed in one pass of up to 3 vectors where
// AVX-512 has the registers) and c written transposed (in registers, `StoreTransposed8`, where
// AVX-512 has the shuffles). Where it runs instead of OpenBLAS is `KernelChoice`'s rule.
#if defined(__AVX512F__)
constexpr int kMR = 6, kNV = 4, kNtMR = 8, kNtNV = 2;   // 32 vector registers
#else
constexpr int kMR = 6, kNV = 2, kNtMR = 6, kNtNV = 2;   // 16 vector registers
#endif
constexpr int64_t kNtRows = 64;

// The contraction's chunk for a B panel `panel_floats` wide: the rows that fill half of one
// core's L2 (2048 rows of a 64-float panel in a 1 MiB L2), so the panel stays there while A's
// tiles sweep it. A product whose contraction fits one chunk writes each tile of C once, and
// can stream it; each further chunk reads C back and adds to it, so the chunk is as long as
// half the L2 allows, not shorter.
inline int64_t ChunkRows(int64_t panel_floats) {
  const int64_t bytes = Setting(kChunkBytes) > 0 ? Setting(kChunkBytes) : L2Bytes() / 2;
  const int64_t rows = bytes / (int64_t{sizeof(float)} * panel_floats);
  return std::max<int64_t>(rows / 16 * 16, 256);
}

// ---- Which kernel runs a group's products ----
// The library's register-tiled kernel, OpenBLAS's sgemm (the scipy-openblas32 wheel, linked),
// or MKL's (the `mkl` wheel, opened at load time where it is installed: `dropless_use_mkl`),
// each run on one thread. `g_kernel` forces one; otherwise the form's calibrated choice (the
// fastest on this CPU at the calibration's probe); before a calibration, the build's rule: the
// tiled kernel in AVX-512 builds, for every group, and OpenBLAS elsewhere (an AVX2 build of the
// tiled kernel loses to OpenBLAS's Haswell kernels on the AMD EPYC and the Intel Xeon both).
// MKL chosen where it is not open runs OpenBLAS.
enum Kernel : int { kOwn = 1, kOpenBlas = 2, kMkl = 3 };
// 0 neither forced, else a Kernel: set by dropless_set_kernel (choice.cc; from
// DROPLESS_NATIVE_KERNEL when the library loads, and by `use_kernel`), read at each call
inline std::atomic<int> g_kernel{0};

// whether MKL's sgemm was opened (`dropless_use_mkl`)
bool MklReady();

struct KernelChoice {
  int forced;
  int form;   // the calibrated choice for this product's form (kKernelNN ... kKernelGateUp)

  static KernelChoice Now(SettingId form) {
    return {g_kernel.load(std::memory_order_relaxed), Setting(form)};
  }
  Kernel Which() const {
    int code = forced != 0 ? forced : form;
    if (code == 0) code = kVW == 16 ? kOwn : kOpenBlas;
    if (code == kMkl && !MklReady()) code = kOpenBlas;
    return static_cast<Kernel>(code);
  }
  bool Own() const { return Which() == kOwn; }
};

// GEMMs run by each kernel in this process (the tests check which one ran):
// [0] OpenBLAS, [1] the tiled kernel, [2] MKL
inline std::atomic<int64_t> g_gemm_calls[3] = {};

inline void CountGemms(Kernel kernel, int64_t count) {
  const int at = kernel == kOwn ? 1 : kernel == kMkl ? 2 : 0;
  g_gemm_calls[at].fetch_add(count, std::memory_order_relaxed);
}

// c[m, n] = (or += where accumulate) op(a) @ op(b), row-major, op = the transpose where ta / tb
// (not both), on `kernel`
void Gemm(Kernel kernel, bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a,
          int64_t lda, const float* b, int64_t ldb, bool accumulate, float* c, int64_t ldc,
          bool stream = false);

// c[m, n] (+)= a[m, k] @ b[n, k]^T, plus a2[m, k] @ b2[n, k]^T where a2 is given (a2 and b2
// strided as a and b), on the tiled kernel, kNtRows rows at a time: a chunk's second product
// adds into its rows of c while they are in cache.
void OwnGemmNT(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
               int64_t ldb, float* c, int64_t ldc, bool accumulate, const float* a2 = nullptr,
               const float* b2 = nullptr);

// g = a @ b1, u = a @ b2 and h = silu(g) * u, all [m, n] (ldc apart), a [m, k] (lda apart), b1
// and b2 [k, n] (ldb apart), on the tiled kernel. Columns past the last whole vector run two
// plain GEMMs and a scalar pass.
void OwnGateUp(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b1,
               const float* b2, int64_t ldb, float* g, float* u, float* h, int64_t ldc,
               bool stream);

// ---- Prefetching the next task's operands ----
// A worker knows its next task while it runs the current one (ForEachTaskAhead). The tiled
// kernel's contraction loop prefetches that task's operands into L2, one cache line a step, so
// their memory latency overlaps this task's arithmetic: a 32-row group's weights (256 KiB at
// K = 512, N = 128) are otherwise read from memory by its first row tile, which has too little
// arithmetic to hide them. A task's prefetch stops at `PrefetchBytes()`: three quarters of the
// L2 (768 KiB where the L2's size is unknown), the best of a quarter, a half, three quarters and
// all of it for groups of 32 rows.
struct Span {
  const float* data;
  int64_t floats;
};

// The spans the calling worker's kernel prefetches from now on (empty: none), cut to
// PrefetchBytes() in all
void SetPrefetch(std::initializer_list<Span> spans);

}  // namespace dropless_native

#endif  // DROPLESS_NATIVE_KERNEL_H_
