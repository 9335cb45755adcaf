// A fixed set of compute threads for the CPU backend. One step issues a few
// dozen parallel loops per layer, so dispatch must cost microseconds: idle
// workers poll briefly before sleeping, the calling thread works too, and a
// loop never waits for a worker that has not started one of its tasks (on a
// busy machine a worker may not run for milliseconds).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/functional/function_ref.h"

namespace coalesce::engine::cpu {

class ThreadPool {
 public:
  // `threads` counts the calling thread: 1 runs everything inline.
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // Calls fn(task, worker) for every task in [0, num_tasks) and returns when
  // all have returned. `worker` in [0, size()) names the calling thread, for
  // per-thread scratch. Tasks are claimed one at a time by whichever thread
  // is free, so uneven tasks balance. One caller at a time.
  void ParallelFor(int num_tasks, absl::FunctionRef<void(int task, int worker)> fn);

 private:
  void WorkerLoop(int worker);
  // Claims and runs tasks of the current loop until none are left.
  void RunTasks(int worker);

  std::vector<std::thread> workers_;
  // The current loop: num_tasks in the high 32 bits, the next unclaimed task
  // in the low 32. A task is claimed by compare-and-swap of the whole word,
  // so a claim succeeds only against the loop that is current, whose fn_ is
  // then valid until its task is done (the caller waits for that).
  std::atomic<uint64_t> job_{0};
  std::atomic<int> done_{0};  // tasks of the current loop that have returned
  const absl::FunctionRef<void(int, int)>* fn_ = nullptr;

  std::mutex mu_;  // pairs the sleep of an idle worker with its wake-up
  std::condition_variable wake_;
  bool stop_ = false;  // guarded by mu_
};

}  // namespace coalesce::engine::cpu
