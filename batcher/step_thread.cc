#include "batcher/step_thread.h"

#include <utility>

namespace coalesce::batcher {

StepThread::StepThread() : thread_([this] { Run(); }) {}

StepThread::~StepThread() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void StepThread::Post(std::function<void()> job) {
  absl::MutexLock lock(&mu_);
  job_ = std::move(job);
  done_ = false;
}

void StepThread::Wait() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(&done_));
}

void StepThread::Run() {
  while (true) {
    std::function<void()> job;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &StepThread::HasJobOrStop));
      if (job_ == nullptr) return;  // stopping, nothing posted
      job = std::move(job_);
      job_ = nullptr;
    }
    job();
    absl::MutexLock lock(&mu_);
    done_ = true;
  }
}

}  // namespace coalesce::batcher
