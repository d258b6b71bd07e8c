// Work items shared out between the calling thread and XLA's intra-op threads: both C++ kernels
// run their items through share_out.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace cbjax_kernels {

template <typename Fn>
struct SharedItems {
  explicit SharedItems(Fn f) : fn(std::move(f)) {}
  Fn fn;
  std::atomic<int64_t> next{0}, done{0};
};

// Runs fn(i) for every i in [0, n) and returns when all have run. Items are claimed from a shared
// counter by the caller and by helper tasks on XLA's pool. The caller is one of the workers, so
// there is one helper fewer than the pool has threads: with one more, a thread descheduled while
// holding the last items kept the others spinning (docs/benchmarks-history, section 15). Helpers hold the
// state (fn and whatever it owns) by shared_ptr: one that starts after the call returned finds
// no item left and touches nothing else.
template <typename Fn>
void share_out(xla::ffi::ThreadPool& pool, int64_t n, Fn fn) {
  if (n <= 0) return;
  auto state = std::make_shared<SharedItems<Fn>>(std::move(fn));
  auto drain = [](SharedItems<Fn>& s, int64_t count) {
    for (int64_t i; (i = s.next.fetch_add(1)) < count;) {
      s.fn(i);
      s.done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads() - 1, n - 1);
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([state, drain, n] { drain(*state, n); });
  drain(*state, n);
  while (state->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

}  // namespace cbjax_kernels
