#include "service/work_pool.h"

#include <pthread.h>

#include <algorithm>
#include <utility>

namespace coalesce::service {

WorkPool::WorkPool(int threads, int max_queued)
    : max_queued_(max_queued), max_large_running_(std::max(1, threads - 1)) {
  for (int i = 0; i < std::max(threads, 2); ++i) {
    threads_.emplace_back([this] { Run(); });
    pthread_setname_np(threads_.back().native_handle(), "coalesce-work");
  }
}

WorkPool::~WorkPool() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  for (std::thread& t : threads_) t.join();
}

bool WorkPool::TryPost(std::function<void()> job, bool large) {
  absl::MutexLock lock(&mu_);
  if (stop_ || static_cast<int>(small_.size() + large_.size()) >= max_queued_) return false;
  (large ? large_ : small_).push_back(std::move(job));
  return true;
}

bool WorkPool::CanTakeJob() const {
  return !small_.empty() || (!large_.empty() && large_running_ < max_large_running_) ||
         (stop_ && large_.empty());
}

void WorkPool::Run() {
  while (true) {
    std::function<void()> job;
    bool large = false;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &WorkPool::CanTakeJob));
      if (!small_.empty()) {
        job = std::move(small_.front());
        small_.pop_front();
      } else if (!large_.empty() && large_running_ < max_large_running_) {
        job = std::move(large_.front());
        large_.pop_front();
        large = true;
        ++large_running_;
      } else {
        return;  // stopping, and nothing left
      }
    }
    job();
    if (large) {
      absl::MutexLock lock(&mu_);
      --large_running_;
    }
  }
}

}  // namespace coalesce::service
