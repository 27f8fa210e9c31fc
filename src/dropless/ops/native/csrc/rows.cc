// Row movement and selection for the MoE layer on CPU, for XLA's FFI: the float32 gathers that
// copy each token to its experts' rows and sum the experts' rows back, the sort of routed rows
// by expert and the router's top-k (rows.py; the layer reaches them through ops/kernels.py),
// written as plain loops over rows, which run faster than XLA:CPU's row gather, sort and TopK.
//
// Legend: R source rows, D row width, N gathered rows, T tokens, K choices per token, E experts.
//
//   gather_rows  out[i]    = s[i] * src[idx[i]]                  src [R, D], idx [N]     -> [N, D]
//   gather_sum   out[t]    = sum_k w[t, k] * src[idx[t, k]]     src [R, D], idx [T, K]  -> [T, D]
//   row_dots     out[t, k] = dot(a[t], b[idx[t, k]])            a [T, D], b [R, D]      -> [T, K]
//   sort_by_expert  order = the stable argsort of ids, inv[order[i]] = i, sizes[e] = #(ids == e)
//                   ids [N] int32 -> order [N], inv [N], sizes [E] int32: a counting sort
//   top_k        idx[t] = the K largest of x[t] (descending; equal values by lower index first),
//                   x [T, E] float32 -> idx [T, K] int32, as jax.lax.top_k orders them: a total
//                   order, -NaN < -inf < ... < -0 < +0 < ... < +inf < +NaN
// `s` and `w` may be empty ([0]): then every factor is 1 (rows copied, or summed, as they are).
// The sum over k runs in order k = 0, 1, ..., in float32. An index outside [0, R) is clamped to
// it (jnp.take's mode="clip"); with R = 0 every output is zero.
#include <algorithm>
#include <numeric>
#include <vector>
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
using dropless_native::LoadVec;
using dropless_native::Threads;
using dropless_native::Vec;

// Run fn(lo, hi) over [0, rows) in chunks of at least kTaskBytes of traffic, at most four per
// worker, on `Threads()` workers.
constexpr int64_t kTaskBytes = int64_t{1} << 18;

template <typename Fn>
void ForRowChunks(int64_t rows, int64_t bytes_per_row, Fn fn) {
  if (rows <= 0) return;
  const int64_t by_size = std::max<int64_t>(1, rows * bytes_per_row / kTaskBytes);
  const int64_t pieces = std::min<int64_t>({by_size, int64_t{4} * Threads(), rows});
  const int64_t step = (rows + pieces - 1) / pieces;
  ForEachTask(static_cast<size_t>((rows + step - 1) / step), [&](size_t i) {
    const int64_t lo = static_cast<int64_t>(i) * step;
    fn(lo, std::min(rows, lo + step));
  });
}

inline int64_t Clamp(int32_t i, int64_t rows) {
  return std::min<int64_t>(std::max<int32_t>(i, 0), rows - 1);
}

// a factor buffer is either empty (every factor 1) or holds one factor per entry
ffi::Error CheckFactors(const ffi::Buffer<ffi::F32>& f, int64_t entries, const char* what) {
  const int64_t n = f.element_count();
  if (n != 0 && n != entries) return ffi::Error::InvalidArgument(what);
  return ffi::Error::Success();
}

// whether a result buffer is [rows, cols] (nothing is written past what XLA allocated)
bool IsShape(ffi::ResultBuffer<ffi::F32>& out, int64_t rows, int64_t cols) {
  const auto od = out->dimensions();
  return od.size() == 2 && od[0] == rows && od[1] == cols;
}

ffi::Error GatherRows(ffi::Buffer<ffi::F32> src, ffi::Buffer<ffi::S32> idx,
                      ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> out) {
  const auto sd = src.dimensions();
  if (sd.size() != 2 || idx.dimensions().size() != 1) {
    return ffi::Error::InvalidArgument("dropless_gather_rows: src must be 2-D and idx 1-D");
  }
  const int64_t r = sd[0], d = sd[1], n = idx.element_count();
  if (!IsShape(out, n, d)) {
    return ffi::Error::InvalidArgument("dropless_gather_rows: the result must be [N, D]");
  }
  if (auto e = CheckFactors(scale, n, "dropless_gather_rows: scale must be [0] or [N]");
      e.failure()) {
    return e;
  }
  float* po = out->typed_data();
  if (n * d == 0) return ffi::Error::Success();
  if (r == 0) {
    std::memset(po, 0, sizeof(float) * n * d);
    return ffi::Error::Success();
  }
  AdviseHugePages(po, sizeof(float) * n * d);
  const float* ps = src.typed_data();
  const int32_t* pi = idx.typed_data();
  const float* pf = scale.element_count() ? scale.typed_data() : nullptr;
  ForRowChunks(n, 2 * d * sizeof(float), [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const float* row = ps + Clamp(pi[i], r) * d;
      float* o = po + i * d;
      if (pf == nullptr) {
        std::memcpy(o, row, sizeof(float) * d);
      } else {
        const float s = pf[i];
        for (int64_t c = 0; c < d; ++c) o[c] = s * row[c];
      }
    }
  });
  return ffi::Error::Success();
}

ffi::Error GatherSum(ffi::Buffer<ffi::F32> src, ffi::Buffer<ffi::S32> idx,
                     ffi::Buffer<ffi::F32> weights, ffi::ResultBuffer<ffi::F32> out) {
  const auto sd = src.dimensions();
  const auto id = idx.dimensions();
  if (sd.size() != 2 || id.size() != 2) {
    return ffi::Error::InvalidArgument("dropless_gather_sum: src and idx must be 2-D");
  }
  const int64_t r = sd[0], d = sd[1], t = id[0], k = id[1];
  const auto wd = weights.dimensions();
  if (weights.element_count() != 0 && (wd.size() != 2 || wd[0] != t || wd[1] != k)) {
    return ffi::Error::InvalidArgument("dropless_gather_sum: weights must be [0] or [T, K]");
  }
  if (!IsShape(out, t, d)) {
    return ffi::Error::InvalidArgument("dropless_gather_sum: the result must be [T, D]");
  }
  float* po = out->typed_data();
  if (t * d == 0) return ffi::Error::Success();
  if (r == 0 || k == 0) {
    std::memset(po, 0, sizeof(float) * t * d);
    return ffi::Error::Success();
  }
  AdviseHugePages(po, sizeof(float) * t * d);
  const float* ps = src.typed_data();
  const int32_t* pi = idx.typed_data();
  const float* pw = weights.element_count() ? weights.typed_data() : nullptr;
  ForRowChunks(t, (k + 1) * d * sizeof(float), [&](int64_t lo, int64_t hi) {
    for (int64_t tok = lo; tok < hi; ++tok) {
      float* o = po + tok * d;
      const int32_t* it = pi + tok * k;
      const float* row = ps + Clamp(it[0], r) * d;
      const float w0 = pw ? pw[tok * k] : 1.0f;
      for (int64_t c = 0; c < d; ++c) o[c] = w0 * row[c];
      for (int64_t j = 1; j < k; ++j) {
        row = ps + Clamp(it[j], r) * d;
        const float w = pw ? pw[tok * k + j] : 1.0f;
        for (int64_t c = 0; c < d; ++c) o[c] += w * row[c];
      }
    }
  });
  return ffi::Error::Success();
}

inline float Dot(const float* a, const float* b, int64_t d) {
  Vec acc[4] = {};
  int64_t c = 0;
  for (; c + 4 * kVW <= d; c += 4 * kVW) {
    for (int v = 0; v < 4; ++v) acc[v] += LoadVec(a + c + v * kVW) * LoadVec(b + c + v * kVW);
  }
  for (; c + kVW <= d; c += kVW) acc[0] += LoadVec(a + c) * LoadVec(b + c);
  const Vec sum = (acc[0] + acc[1]) + (acc[2] + acc[3]);
  float total = 0.0f;
  for (int v = 0; v < kVW; ++v) total += sum[v];
  for (; c < d; ++c) total += a[c] * b[c];
  return total;
}

ffi::Error RowDots(ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b, ffi::Buffer<ffi::S32> idx,
                   ffi::ResultBuffer<ffi::F32> out) {
  const auto ad = a.dimensions();
  const auto bd = b.dimensions();
  const auto id = idx.dimensions();
  if (ad.size() != 2 || bd.size() != 2 || id.size() != 2 || ad[1] != bd[1] || ad[0] != id[0]) {
    return ffi::Error::InvalidArgument(
        "dropless_row_dots: a [T, D], b [R, D] and idx [T, K] must agree");
  }
  const int64_t t = ad[0], d = ad[1], r = bd[0], k = id[1];
  if (!IsShape(out, t, k)) {
    return ffi::Error::InvalidArgument("dropless_row_dots: the result must be [T, K]");
  }
  float* po = out->typed_data();
  if (t * k == 0) return ffi::Error::Success();
  if (r == 0 || d == 0) {
    std::memset(po, 0, sizeof(float) * t * k);
    return ffi::Error::Success();
  }
  const float *pa = a.typed_data(), *pb = b.typed_data();
  const int32_t* pi = idx.typed_data();
  ForRowChunks(t, (k + 1) * d * sizeof(float), [&](int64_t lo, int64_t hi) {
    for (int64_t tok = lo; tok < hi; ++tok) {
      for (int64_t j = 0; j < k; ++j) {
        po[tok * k + j] = Dot(pa + tok * d, pb + Clamp(pi[tok * k + j], r) * d, d);
      }
    }
  });
  return ffi::Error::Success();
}

// ids [N] -> order [N] (a stable sort of ids' positions by id), inv [N] (order's inverse) and
// sizes [E] (how many ids name each expert). Where every id is in [0, E): one counting pass and
// one placing pass. Otherwise as the XLA form does it (ops/kernels.py): order by std::stable_sort
// on the ids' values, and sizes counting an id in [-E, 0) as id + E (numpy's negative index), any
// other out-of-range id not at all.
ffi::Error SortByExpert(ffi::Buffer<ffi::S32> ids, ffi::ResultBuffer<ffi::S32> order,
                        ffi::ResultBuffer<ffi::S32> inv, ffi::ResultBuffer<ffi::S32> sizes) {
  const int64_t n = static_cast<int64_t>(ids.element_count());
  const int64_t e = static_cast<int64_t>(sizes->element_count());
  if (static_cast<int64_t>(order->element_count()) != n ||
      static_cast<int64_t>(inv->element_count()) != n) {
    return ffi::Error::InvalidArgument(
        "dropless_sort_by_expert: order and inv must have as many entries as ids");
  }
  const int32_t* pid = ids.typed_data();
  int32_t *po = order->typed_data(), *pv = inv->typed_data(), *ps = sizes->typed_data();
  std::fill(ps, ps + e, 0);
  const bool in_range = std::all_of(pid, pid + n, [e](int32_t v) { return v >= 0 && v < e; });
  if (in_range) {
    for (int64_t i = 0; i < n; ++i) ++ps[pid[i]];
    std::vector<int64_t> next(e + 1, 0);   // the next sorted position of each expert's rows
    for (int64_t g = 0; g < e; ++g) next[g + 1] = next[g] + ps[g];
    for (int64_t i = 0; i < n; ++i) {
      const int64_t at = next[pid[i]]++;
      po[at] = static_cast<int32_t>(i);
      pv[i] = static_cast<int32_t>(at);
    }
    return ffi::Error::Success();
  }
  std::iota(po, po + n, 0);
  std::stable_sort(po, po + n, [pid](int32_t a, int32_t b) { return pid[a] < pid[b]; });
  for (int64_t i = 0; i < n; ++i) pv[po[i]] = static_cast<int32_t>(i);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t v = pid[i] < 0 ? int64_t{pid[i]} + e : pid[i];
    if (v >= 0 && v < e) ++ps[v];
  }
  return ffi::Error::Success();
}

// x's bits as an int32 that orders as jax.lax.top_k orders floats (a total order: a NaN with its
// sign bit clear above +inf, one with it set below -inf, -0 below +0)
inline int32_t OrderKey(float v) {
  int32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return bits ^ ((bits >> 31) & 0x7fffffff);
}

// x [T, E] -> idx [T, K]: each row's K largest by OrderKey, ties to the lower index, in
// descending order; one pass over a row keeping the best K in order (insertion).
ffi::Error TopK(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> idx) {
  const auto xd = x.dimensions();
  const auto id = idx->dimensions();
  if (xd.size() != 2 || id.size() != 2 || id[0] != xd[0] || id[1] > xd[1]) {
    return ffi::Error::InvalidArgument("dropless_top_k: x [T, E] and idx [T, K <= E] must agree");
  }
  const int64_t t = xd[0], e = xd[1], k = id[1];
  if (t * k == 0) return ffi::Error::Success();
  const float* px = x.typed_data();
  int32_t* pi = idx->typed_data();
  ForRowChunks(t, e * static_cast<int64_t>(sizeof(float)), [&](int64_t lo, int64_t hi) {
    std::vector<int32_t> keys(k);
    for (int64_t row = lo; row < hi; ++row) {
      const float* xr = px + row * e;
      int32_t* out = pi + row * k;
      int64_t kept = 0;   // out[:kept] and keys[:kept] hold the best so far, best first
      for (int64_t j = 0; j < e; ++j) {
        const int32_t key = OrderKey(xr[j]);
        if (kept == k && key <= keys[k - 1]) continue;   // a tie loses to the lower index
        int64_t at = kept < k ? kept++ : k - 1;
        while (at > 0 && keys[at - 1] < key) {
          keys[at] = keys[at - 1];
          out[at] = out[at - 1];
          --at;
        }
        keys[at] = key;
        out[at] = static_cast<int32_t>(j);
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DroplessGatherRowsF32, GatherRows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(DroplessGatherSumF32, GatherSum,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(DroplessRowDotsF32, RowDots,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(DroplessSortByExpert, SortByExpert,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(DroplessTopK, TopK,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
