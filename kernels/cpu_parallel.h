// A parallel for over XLA's intra-op thread pool, for the FFI kernels of cpu_native.cc and
// cpu_linear.cc.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jaxpaged {

// Calls fn(i) for i in [0, n) on the calling thread and up to pool.num_threads() - 1
// pool threads, items taken in order from a shared counter; returns when all are done.
// The counters live in a shared_ptr because a pool task may start after the call has
// returned: it then finds no item left and touches nothing else.
template <typename F>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t n, F fn) {
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto state = std::make_shared<State>();
  auto body = std::make_shared<F>(std::move(fn));
  auto work = [state, body, n]() {
    for (int64_t i = state->next.fetch_add(1); i < n; i = state->next.fetch_add(1)) {
      (*body)(i);
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads() - 1, n - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule(decltype(work)(work));
  work();
  while (state->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

}  // namespace jaxpaged
