// The scheduling decision: which waiting requests join the running batch at
// this step boundary, and, when none may join yet, until when to wait. It is
// a pure function of the queue state and the time, so the coalescing window
// is tested step by step with a fake clock (tests/batcher/scheduler_test.cc).
//
// The rule (continuous batching, the default):
//   free slots = max_batch_size - running sequences
//   Nothing is admitted while there is no free slot or nobody waits.
//   Otherwise the waiting requests are admitted, oldest first, as soon as ONE
//   of these holds:
//     (a) the window is 0 (coalescing disabled);
//     (b) the waiting requests alone can fill every free slot;
//     (c) the oldest waiting request has waited `batch_window`.
//   Until then the decision says "reconsider at oldest arrival + window".
//   Admission takes requests in arrival order while a slot is free and the
//   KV-cache blocks the request needs are free; it stops at the first request
//   that does not fit (no overtaking, so a large request cannot starve).
//
// Static batching (for comparison): the same rule, but only while nothing
// runs; a batch runs until all of its sequences finish.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "absl/time/time.h"

namespace coalesce::batcher {

enum class BatchingMode { kContinuous, kStatic };

struct SchedulerConfig {
  int max_batch_size = 16;  // sequences in one engine step
  absl::Duration batch_window = absl::Milliseconds(5);
  BatchingMode mode = BatchingMode::kContinuous;
};

struct WaitingRequest {
  uint64_t id = 0;
  absl::Time arrival;     // when the server received it
  int blocks_needed = 0;  // KV-cache blocks it must hold to run
};

struct QueueState {
  std::span<const WaitingRequest> waiting;  // in arrival order
  int running = 0;                          // sequences in the batch now
  int free_blocks = 0;                      // KV-cache blocks not held
};

// Why waiting requests were not (all) admitted; for logs and tests.
enum class HoldReason {
  kNone,                // everyone waiting was admitted, or nobody waits
  kNoFreeSlot,          // the batch is full
  kWindowOpen,          // coalescing: waiting for companions
  kNoFreeBlocks,        // the next request's KV blocks are not free
  kStaticBatchRunning,  // static mode: the current batch has not finished
};
std::string_view HoldReasonName(HoldReason reason);

struct Decision {
  std::vector<uint64_t> admit;  // ids to admit now, in this order
  HoldReason hold = HoldReason::kNone;
  // Set when the decision can change by the passage of time alone: the
  // caller should decide again no later than this (the window's end).
  std::optional<absl::Time> reconsider_at;
};

class Scheduler {
 public:
  explicit Scheduler(SchedulerConfig config) : config_(config) {}
  Decision Schedule(const QueueState& state, absl::Time now) const;
  const SchedulerConfig& config() const { return config_; }

 private:
  SchedulerConfig config_;
};

}  // namespace coalesce::batcher
