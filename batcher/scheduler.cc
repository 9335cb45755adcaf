#include "batcher/scheduler.h"

#include <algorithm>

namespace coalesce::batcher {

std::string_view HoldReasonName(HoldReason reason) {
  switch (reason) {
    case HoldReason::kNone:
      return "none";
    case HoldReason::kNoFreeSlot:
      return "no_free_slot";
    case HoldReason::kWindowOpen:
      return "window_open";
    case HoldReason::kNoFreeBlocks:
      return "no_free_kv_blocks";
    case HoldReason::kStaticBatchRunning:
      return "static_batch_running";
  }
  return "unknown";
}

Decision Scheduler::Schedule(const QueueState& state, absl::Time now) const {
  Decision decision;
  if (state.waiting.empty()) return decision;

  // 1. Static batching admits only into an empty engine.
  if (config_.mode == BatchingMode::kStatic && state.running > 0) {
    decision.hold = HoldReason::kStaticBatchRunning;
    return decision;
  }
  const int free_slots = config_.max_batch_size - state.running;
  if (free_slots <= 0) {
    decision.hold = HoldReason::kNoFreeSlot;
    return decision;
  }

  // 2. The coalescing window: hold the arrivals until they can fill the free
  //    slots or the oldest has waited long enough.
  const absl::Time window_end = state.waiting.front().arrival + config_.batch_window;
  const bool window_closed = config_.batch_window <= absl::ZeroDuration() ||
                             static_cast<int>(state.waiting.size()) >= free_slots ||
                             now >= window_end;
  if (!window_closed) {
    decision.hold = HoldReason::kWindowOpen;
    decision.reconsider_at = window_end;
    return decision;
  }

  // 3. Admit in arrival order while slots and KV blocks last.
  int blocks_left = state.free_blocks;
  for (const WaitingRequest& request : state.waiting) {
    if (static_cast<int>(decision.admit.size()) == free_slots) {
      decision.hold = HoldReason::kNoFreeSlot;
      break;
    }
    if (request.blocks_needed > blocks_left) {
      decision.hold = HoldReason::kNoFreeBlocks;
      break;
    }
    blocks_left -= request.blocks_needed;
    decision.admit.push_back(request.id);
  }
  return decision;
}

}  // namespace coalesce::batcher
