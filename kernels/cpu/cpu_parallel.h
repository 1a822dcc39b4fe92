// A parallel for over XLA's intra-op thread pool, for the FFI kernels of cpu_native.cc and
// cpu_linear.cc.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

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

// Like parallel_for, but each of the P participating threads (the caller and P - 1 pool
// threads) owns a contiguous run of the items and takes them front to back; a thread that
// runs out takes the others' items from the back of their runs. For kernels that stream
// memory in item order (the panel GEMM's weights): an owner's items continue one stream,
// so its prefetches run on into its next item, where interleaved items restart a stream
// (and wait on memory) at every item.
template <typename F>
void parallel_for_runs(xla::ffi::ThreadPool& pool, int64_t n, F fn) {
  if (n <= 0) return;
  if (n > INT32_MAX) return parallel_for(pool, n, std::move(fn));  // runs pack 32-bit bounds
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), n));
  struct alignas(64) Run {
    std::atomic<uint64_t> bounds;  // front in the low 32 bits, back (exclusive) in the high
  };
  struct State {
    explicit State(int64_t parts) : runs(parts) {}
    std::vector<Run> runs;
    std::atomic<int64_t> done{0};
  };
  auto state = std::make_shared<State>(parts);
  for (int64_t p = 0; p < parts; ++p) {
    const uint64_t front = n * p / parts, back = n * (p + 1) / parts;
    state->runs[p].bounds.store(front | back << 32, std::memory_order_relaxed);
  }
  auto body = std::make_shared<F>(std::move(fn));
  // One item off a run's front (owner) or back (thief); -1 when the run is empty.
  auto take = [](Run& run, bool from_front) -> int64_t {
    uint64_t v = run.bounds.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t front = v & 0xffffffffu, back = v >> 32;
      if (front >= back) return -1;
      const uint64_t next = from_front ? (front + 1) | back << 32 : front | (back - 1) << 32;
      if (run.bounds.compare_exchange_weak(v, next, std::memory_order_acq_rel))
        return static_cast<int64_t>(from_front ? front : back - 1);
    }
  };
  auto work = [state, body, parts, take](int64_t me) {
    for (int64_t k = 0; k < parts; ++k) {
      Run& run = state->runs[(me + k) % parts];
      for (int64_t i = take(run, k == 0); i >= 0; i = take(run, k == 0)) {
        (*body)(i);
        state->done.fetch_add(1, std::memory_order_release);
      }
    }
  };
  for (int64_t p = 1; p < parts; ++p) pool.Schedule([work, p]() { work(p); });
  work(0);
  while (state->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

}  // namespace jaxpaged
