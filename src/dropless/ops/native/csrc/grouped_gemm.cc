// A CPU grouped GEMM for XLA's FFI: one GEMM per group, on each group's rows in place (no
// copies, no masked rows), float32. A group's GEMM is OpenBLAS's sgemm or the library's
// register-tiled kernel (kernel.h: `KernelChoice` says which).
//
// Legend: M rows (sorted by group), K contraction dim, N output dim, G groups.
//
// One handler, three products, chosen by the attribute `mode`:
//   0  forward  out[M, N]    rows of g:  a[M, K] @ b[g]          (b = rhs [G, K, N])
//   1  dlhs     out[M, K]    rows of g:  a[M, N] @ b[g]^T        (a = dy, b = rhs [G, K, N])
//   2  drhs     out[G, K, N] group g:    a[rows, K]^T @ b[rows, N]  (a = lhs, b = dy)
// Group g covers rows [start_g, end_g) with end_g = min(sum(max(sizes[:g+1], 0)), M) (ragged_dot
// semantics: negative sizes count as zero, a group is cut at row M). Rows past the last group
// and empty groups' weight gradients are written as zeros, never computed, so a NaN reaches only
// the rows and the group it belongs to.
#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "kernel.h"
#include "tasks.h"
#include "threads.h"
#include "vec.h"

namespace ffi = xla::ffi;

namespace {

using dropless_native::AdviseHugePages;
using dropless_native::CutTasks;
using dropless_native::Gemm;
using dropless_native::GroupBounds;
using dropless_native::Kernel;
using dropless_native::KernelChoice;
using dropless_native::RunParallel;
using dropless_native::SetPrefetch;
using dropless_native::StreamFence;
using dropless_native::Streams;
using dropless_native::Task;

// the calibrated kernel setting of each mode's form (kernel.h)
constexpr dropless_native::SettingId kForms[3] = {dropless_native::kKernelNN,
                                                  dropless_native::kKernelNT,
                                                  dropless_native::kKernelTN};

struct Problem {
  int32_t mode;
  int64_t m, k, n;   // k, n: rhs's [K, N] (forward, dlhs); lhs's K and dy's N (drhs)
  const float* a;
  const float* b;
  float* out;
  KernelChoice kernels;
  bool stream;   // the forward's or drhs's output is written with streaming stores
};

void RunTask(const Problem& p, const Task& t) {
  const int64_t k = p.k, n = p.n, len = t.hi - t.lo, rows = t.end - t.start;
  const Kernel own = p.kernels.Which();
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

// The product of `mode` on raw operands (the handler's work once its operands are checked):
// a [m, K or N], b [G, K, N] (forward, dlhs) or [m, N] (drhs), out as the mode has it
void RunGroupedGemm(int32_t mode, const float* a, const float* b, const int32_t* sizes,
                    int64_t g_count, int64_t m, int64_t k, int64_t n, float* out) {
  const int64_t count = mode == 2 ? g_count * k * n : m * (mode == 0 ? n : k);
  if (count == 0) return;
  AdviseHugePages(out, sizeof(float) * count);
  const Problem p{mode, m, k, n, a, b, out, KernelChoice::Now(kForms[mode]),
                  mode != 1 && Streams(count)};
  // out's row width (forward, dlhs) or one group's [K, N] block (drhs)
  const int64_t width = mode == 0 ? p.n : mode == 1 ? p.k : p.k * p.n;
  const int64_t inner = mode == 0 ? p.k : mode == 1 ? p.n : 1;   // 0: every product is zero

  const auto bounds = GroupBounds(sizes, g_count, p.m);
  if (mode != 2) {
    const int64_t done = inner == 0 ? 0 : bounds[g_count];
    std::memset(p.out + done * width, 0, sizeof(float) * (p.m - done) * width);
    if (inner == 0) return;
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
  RunGroupedGemm(mode, a.typed_data(), b.typed_data(), sizes.typed_data(),
                 sizes.element_count(), ad[0], mode == 2 ? ad[1] : bd[1],
                 mode == 2 ? bd[1] : bd[2], out->typed_data());
  return ffi::Error::Success();
}

}  // namespace

// the grouped GEMM on raw operands, for the calibration (native/calibrate.py times each choice
// on the handler's own path without XLA)
extern "C" void dropless_run_grouped_gemm(int32_t mode, const float* a, const float* b,
                                          const int32_t* sizes, int64_t g_count, int64_t m,
                                          int64_t k, int64_t n, float* out) {
  if (mode >= 0 && mode <= 2) RunGroupedGemm(mode, a, b, sizes, g_count, m, k, n, out);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(DroplessGroupedGemmF32, GroupedGemm,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("mode"));
