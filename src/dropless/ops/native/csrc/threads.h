// What the native library's handlers share: how many workers run a call, the parallel loop they
// run it with, and huge pages for large fresh outputs. Included by every handler's source; all
// of csrc/*.cc are built into one library (load.py).
#ifndef DROPLESS_NATIVE_THREADS_H_
#define DROPLESS_NATIVE_THREADS_H_

#include <sched.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <thread>
#include <vector>

extern "C" void scipy_openblas_set_num_threads(int num_threads);

namespace dropless_native {

// Workers a call runs on: DROPLESS_NATIVE_THREADS, else the cores this process may run on. Every
// OpenBLAS call runs on one thread (the handlers cut the work themselves), set here once.
inline int Threads() {
  static const int n = [] {
    scipy_openblas_set_num_threads(1);
    if (const char* env = std::getenv("DROPLESS_NATIVE_THREADS")) {
      const int v = std::atoi(env);
      if (v > 0) return v;
    }
    cpu_set_t set;
    CPU_ZERO(&set);
    const int cores = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
    return std::max(cores, 1);
  }();
  return n;
}

// Run work() on min(Threads(), count) workers, the caller among them, and wait for all.
template <typename Work>
void OnWorkers(size_t count, Work& work) {
  std::vector<std::thread> pool;
  const int helpers = static_cast<int>(std::min<size_t>(Threads(), count)) - 1;
  for (int i = 0; i < helpers; ++i) pool.emplace_back(work);
  work();
  for (auto& th : pool) th.join();
}

// Run fn(i) for i in [0, count) on up to `Threads()` workers (the caller is one of them), each
// taking the next index in turn.
template <typename Fn>
void ForEachTask(size_t count, Fn fn) {
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i = next++; i < count; i = next++) fn(i);
  };
  OnWorkers(count, work);
}

// Run fn(i, next) for i in [0, count) on up to `Threads()` workers (the caller is one of them).
// A worker claims its next index before it runs the current one, so `next` is the index it runs
// after i (count: none) and fn can prefetch what that one reads.
template <typename Fn>
void ForEachTaskAhead(size_t count, Fn fn) {
  std::atomic<size_t> next{0};
  auto work = [&] {
    size_t i = next++;
    while (i < count) {
      const size_t after = next++;
      fn(i, std::min(after, count));
      i = after;
    }
  };
  OnWorkers(count, work);
}

// Ask for transparent huge pages on the 2 MiB-aligned interior of a large output buffer before
// the first write: a fresh buffer from the allocator is untouched mmapped memory, and faulting it
// in 4 KiB pages cost more than the products themselves for a [G, K, N] weight gradient (the
// kernel zeroes a huge page in one fault). A no-op where THP is off or the pages exist already.
inline void AdviseHugePages(void* data, size_t bytes) {
  constexpr uintptr_t kHuge = uintptr_t{1} << 21;
  const uintptr_t lo = (reinterpret_cast<uintptr_t>(data) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t hi = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(kHuge - 1);
  if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);
}

}  // namespace dropless_native

#endif  // DROPLESS_NATIVE_THREADS_H_
