// Tasks handed to torch's threads as they ask for them, instead of split in equal shares up front.
//
// Why: a GEMM of a decode step streams its weights at the memory's rate, and an equal split
// waits at its end for its slowest thread. On the shared two-core machines we run on one thread
// is often late (woken after the other, or its core lent out for a while), and a decode step is
// ~65 such GEMMs with a barrier after each. Measured on a Zen 3 EPYC (1B files, the two
// schedules alternating in one process, medians of pairs): one sequence 1.01-1.05x (Q4_0, Q4_K_M,
// Q8_0), 16 sequences 1.04x, 64 sequences 1.09-1.12x (the int16 tiles' tasks are longer).
//
// The runs shrink as the queue empties (each a quarter of what is left per thread, at least one
// task), so a run is long (contiguous panels: the hardware prefetcher keeps streaming) while
// much is left, and the threads finish within one short run of each other.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace pagedllm {

class TaskQueue {
 public:
  TaskQueue(int64_t tasks, int64_t threads)
      : tasks_(tasks), share_(std::max<int64_t>(1, threads) * 4) {}

  // The next run [begin, end) of tasks; false when none is left.
  bool next(int64_t& begin, int64_t& end) {
    int64_t at = next_.load(std::memory_order_relaxed);
    while (at < tasks_) {
      const int64_t take = std::max<int64_t>(1, (tasks_ - at) / share_);
      if (next_.compare_exchange_weak(at, at + take, std::memory_order_relaxed)) {
        begin = at;
        end = at + take;
        return true;
      }
    }
    return false;
  }

 private:
  std::atomic<int64_t> next_{0};
  int64_t tasks_, share_;
};

// body(queue) once on each of torch's threads, which take the tasks [0, tasks) from the queue
// (inside a parallel region: once, on this thread, which takes them all). A thread's own state
// (scratch, accumulators) lives in body, made once per thread, not once per run.
template <typename Body>
void on_demand(int64_t tasks, const Body& body) {
  if (tasks <= 0) return;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), tasks);
  TaskQueue queue(tasks, threads);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { body(queue); });
}

}  // namespace pagedllm
