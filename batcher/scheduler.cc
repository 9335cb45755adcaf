#include "batcher/scheduler.h"

#include <algorithm>
#include <limits>

namespace coalesce::batcher {

std::string_view BatchingModeName(BatchingMode mode) {
  switch (mode) {
    case BatchingMode::kContinuous:
      return "continuous";
    case BatchingMode::kStatic:
      return "static";
    case BatchingMode::kStaticPadded:
      return "static_padded";
  }
  return "?";
}

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

namespace {
bool AgingEnabled(const SchedulerConfig& config) {
  return config.priority_aging > absl::ZeroDuration() &&
         config.priority_aging < absl::InfiniteDuration();
}

// Whole aging intervals in `waited` (0 for none or negative).
int64_t AgingLevels(absl::Duration waited, absl::Duration interval) {
  if (waited <= absl::ZeroDuration()) return 0;
  absl::Duration remainder;
  return absl::IDivDuration(waited, interval, &remainder);
}
}  // namespace

int Scheduler::EffectivePriority(const WaitingRequest& request, absl::Time now) const {
  if (!AgingEnabled(config_)) return request.priority;
  const int64_t levels = AgingLevels(now - request.arrival, config_.priority_aging);
  return static_cast<int>(
      std::min<int64_t>(int64_t{request.priority} + levels, std::numeric_limits<int>::max()));
}

Decision Scheduler::Schedule(const QueueState& state, absl::Time now) const {
  Decision decision;
  auto reconsider = [&decision](absl::Time t) {
    if (t == absl::InfiniteFuture()) return;
    if (!decision.reconsider_at || t < *decision.reconsider_at) decision.reconsider_at = t;
  };

  // 1. Expiry: deadlines and the queue timeout. The rest stay in line.
  std::vector<const WaitingRequest*> line;
  auto position = [&state](const WaitingRequest* r) {
    return static_cast<int>(r - state.waiting.data());
  };
  for (const WaitingRequest& request : state.waiting) {
    const absl::Time queue_limit =
        request.preempted ? absl::InfiniteFuture() : request.arrival + config_.max_queue_wait;
    if (now >= request.deadline) {
      decision.expired.push_back({position(&request), ExpiryReason::kDeadline});
    } else if (now >= queue_limit) {
      decision.expired.push_back({position(&request), ExpiryReason::kQueueTimeout});
    } else {
      line.push_back(&request);
      reconsider(std::min(request.deadline, queue_limit));
    }
  }
  if (line.empty()) return decision;

  // 2. Order: effective priority, then arrival, then id (a total order).
  std::vector<std::pair<int, const WaitingRequest*>> order;
  for (const WaitingRequest* r : line) order.emplace_back(EffectivePriority(*r, now), r);
  std::sort(order.begin(), order.end(), [](const auto& a, const auto& b) {
    if (a.first != b.first) return a.first > b.first;
    if (a.second->arrival != b.second->arrival) return a.second->arrival < b.second->arrival;
    return a.second->id < b.second->id;
  });
  if (AgingEnabled(config_)) {
    // The order can change when the next request ages one level.
    for (const WaitingRequest* r : line) {
      const int64_t levels = AgingLevels(now - r->arrival, config_.priority_aging);
      reconsider(r->arrival + (levels + 1) * config_.priority_aging);
    }
  }

  // 3. Static batching admits only into an empty engine.
  if (config_.mode != BatchingMode::kContinuous && state.running > 0) {
    decision.hold = HoldReason::kStaticBatchRunning;
    return decision;
  }
  const int free_slots = config_.max_batch_size - state.running;
  if (free_slots <= 0) {
    decision.hold = HoldReason::kNoFreeSlot;
    return decision;
  }

  // 4. The coalescing window: hold the arrivals until they can fill the free
  //    slots or the oldest has waited long enough.
  absl::Time oldest = absl::InfiniteFuture();
  for (const WaitingRequest* r : line) oldest = std::min(oldest, r->arrival);
  const absl::Time window_end = oldest + config_.batch_window;
  int slots_wanted = 0;
  for (const WaitingRequest* r : line) slots_wanted += r->slots;
  const bool window_closed = config_.batch_window <= absl::ZeroDuration() ||
                             slots_wanted >= free_slots || now >= window_end;
  if (!window_closed) {
    decision.hold = HoldReason::kWindowOpen;
    reconsider(window_end);
    return decision;
  }

  // 5. Admit in order while slots and KV blocks last.
  int blocks_left = state.free_blocks;
  int slots_left = free_slots;
  for (const auto& [priority, request] : order) {
    if (request->slots > slots_left) {
      decision.hold = HoldReason::kNoFreeSlot;
      break;
    }
    if (request->blocks_needed > blocks_left) {
      decision.hold = HoldReason::kNoFreeBlocks;
      break;
    }
    slots_left -= request->slots;
    blocks_left -= request->blocks_needed;
    decision.admit.push_back(position(request));
  }
  return decision;
}

}  // namespace coalesce::batcher
