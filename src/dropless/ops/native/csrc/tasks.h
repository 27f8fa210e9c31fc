// How the handlers cut a product into tasks and run them on the workers: tasks of about equal
// work, smaller towards the end, each worker prefetching its next task's operands while it runs
// the current one (kernel.h: SetPrefetch). Shared by the grouped GEMM (grouped_gemm.cc) and the
// fused SwiGLU handlers (swiglu.cc).
//
// Group g covers rows [start_g, end_g) with end_g = min(sum(max(sizes[:g+1], 0)), M) (ragged_dot
// semantics: negative sizes count as zero, a group is cut at row M).
#ifndef DROPLESS_NATIVE_TASKS_H_
#define DROPLESS_NATIVE_TASKS_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "kernel.h"
#include "threads.h"

namespace dropless_native {

// Every GEMM runs on one thread; the parallelism is ours: the products are cut into tasks (row
// ranges of a group for forward and dlhs, row ranges of a group's [K, N] block for drhs), smaller
// towards the end (`CutTasks`), and `Threads()` workers take them in turn. OpenBLAS's own
// threading costs more than it saves on a 32-row group and cannot be limited per call in this
// build.
constexpr int64_t kTaskMacs = int64_t{1} << 24;   // smallest task worth its own call

struct Task {
  int64_t g, lo, hi;   // rows [lo, hi) (forward, dlhs) or rows [lo, hi) of the [K, N] block (drhs)
  int64_t start, end;  // the group's rows
};

// The tasks of a product over every group g: its span(g) units (the group's rows, or drhs's K
// rows of its block, from 0) of unit_macs(g) multiply-adds each, cut into pieces of at most
// max(kTaskMacs, a quarter of one worker's share) and of at most 1 / (2 x workers) of the
// work not yet cut, so the last tasks are small and no worker waits long for another's last
// one (with pieces of equal size, the workers that finish first sit idle). A group's pieces are
// about equal, whole multiples of `quantum` units (but its last): 8, or a kernel's block.
template <typename Span, typename UnitMacs>
std::vector<Task> CutTasks(const std::vector<int64_t>& bounds, bool from_group_start, Span span,
                           UnitMacs unit_macs, int64_t quantum = 8) {
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
      const int64_t step = std::min(
          units - lo, ((units - lo + pieces - 1) / pieces + quantum - 1) / quantum * quantum);
      tasks.push_back({g, base + lo, base + lo + step, bounds[g], bounds[g + 1]});
      left -= step * unit;
      lo += step;
    }
  }
  return tasks;
}

// [0, end_0, end_1, ...]: each group's rows from the sizes, as above
inline std::vector<int64_t> GroupBounds(const int32_t* ps, int64_t g_count, int64_t m) {
  std::vector<int64_t> bounds(g_count + 1, 0);   // group g: rows [bounds[g], bounds[g + 1])
  for (int64_t g = 0; g < g_count; ++g) {
    bounds[g + 1] = std::min(bounds[g] + std::max<int64_t>(ps[g], 0), m);
  }
  return bounds;
}
inline std::vector<int64_t> GroupBounds(const xla::ffi::Buffer<xla::ffi::S32>& sizes, int64_t m) {
  return GroupBounds(sizes.typed_data(), sizes.element_count(), m);
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

}  // namespace dropless_native

#endif  // DROPLESS_NATIVE_TASKS_H_
