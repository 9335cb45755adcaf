// A thread that runs one job at a time for the engine loop: Post, then Wait.
// With EngineLoopOptions::overlap_steps the backend's step runs here while
// the loop's own thread streams the previous step's tokens.
#pragma once

#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace coalesce::batcher {

class StepThread {
 public:
  StepThread();
  ~StepThread();
  void Post(std::function<void()> job);
  void Wait();  // until the posted job has run

 private:
  void Run();
  bool HasJobOrStop() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || job_ != nullptr; }

  absl::Mutex mu_;
  std::function<void()> job_ ABSL_GUARDED_BY(mu_);
  bool done_ ABSL_GUARDED_BY(mu_) = true;  // the last posted job has run
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace coalesce::batcher
