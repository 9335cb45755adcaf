// A few threads that run the service's CPU-heavy request work (parsing,
// tokenizing, detokenizing) off gRPC's callback threads. Those threads also
// run every stream's write completions, so a 4 MiB prompt tokenized on one
// of them stalled every other stream; here it only delays its own call.
//
// Two lanes: large jobs (a big prompt, seconds of work) never take the last
// thread, so a small request never waits behind them; small jobs go first.
// The queue is bounded: TryPost refuses work beyond it, and the caller
// answers RESOURCE_EXHAUSTED.
#pragma once

#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace coalesce::service {

class WorkPool {
 public:
  // `threads` >= 2 (one is kept for small jobs); at most `max_queued` jobs
  // wait (those running excluded).
  WorkPool(int threads, int max_queued);
  ~WorkPool();  // runs what is queued, then joins

  // Queues `job`, or returns false when the queue is full or the pool stops.
  bool TryPost(std::function<void()> job, bool large = false);

  int threads() const { return static_cast<int>(threads_.size()); }

 private:
  void Run();
  bool CanTakeJob() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int max_queued_;
  const int max_large_running_;
  absl::Mutex mu_;
  std::deque<std::function<void()>> small_ ABSL_GUARDED_BY(mu_);
  std::deque<std::function<void()>> large_ ABSL_GUARDED_BY(mu_);
  int large_running_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace coalesce::service
