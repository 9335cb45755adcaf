#include "engine/cpu/thread_pool.h"

#include <immintrin.h>

#include <chrono>

namespace coalesce::engine::cpu {
namespace {

// How long an idle worker polls before it sleeps: longer than the gap
// between two parallel loops of one step, far shorter than the gap between
// steps of an idle server.
constexpr auto kSpin = std::chrono::microseconds(200);

bool HasWork(uint64_t job) { return (job & 0xFFFFFFFFu) < (job >> 32); }

}  // namespace

ThreadPool::ThreadPool(int threads) {
  for (int w = 1; w < threads; ++w) workers_.emplace_back([this, w] { WorkerLoop(w); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::RunTasks(int worker) {
  uint64_t job = job_.load(std::memory_order_acquire);
  while (HasWork(job)) {
    if (job_.compare_exchange_weak(job, job + 1, std::memory_order_acq_rel,
                                   std::memory_order_acquire)) {
      (*fn_)(static_cast<int>(job & 0xFFFFFFFFu), worker);
      done_.fetch_add(1, std::memory_order_release);
      job = job_.load(std::memory_order_acquire);
    }
  }
}

void ThreadPool::ParallelFor(int num_tasks, absl::FunctionRef<void(int, int)> fn) {
  if (num_tasks <= 0) return;
  if (workers_.empty() || num_tasks == 1) {
    for (int t = 0; t < num_tasks; ++t) fn(t, 0);
    return;
  }
  fn_ = &fn;
  done_.store(0, std::memory_order_relaxed);
  {
    // Under the lock, so a worker between its check and its sleep cannot miss
    // the notification.
    std::lock_guard<std::mutex> lock(mu_);
    job_.store(static_cast<uint64_t>(num_tasks) << 32, std::memory_order_release);
  }
  wake_.notify_all();
  RunTasks(0);
  // Only tasks already claimed remain, each running on some worker. On an
  // oversubscribed machine that worker may be descheduled: yield to it.
  for (int polls = 0; done_.load(std::memory_order_acquire) < num_tasks; ++polls) {
    if (polls < 4096) {
      _mm_pause();
    } else {
      std::this_thread::yield();
    }
  }
}

void ThreadPool::WorkerLoop(int worker) {
  while (true) {
    const auto spin_until = std::chrono::steady_clock::now() + kSpin;
    for (int polls = 1; !HasWork(job_.load(std::memory_order_acquire)); ++polls) {
      _mm_pause();
      if (polls % 64 == 0 && std::chrono::steady_clock::now() > spin_until) {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [&] { return stop_ || HasWork(job_.load(std::memory_order_acquire)); });
        if (stop_) return;
      }
    }
    RunTasks(worker);
  }
}

}  // namespace coalesce::engine::cpu
